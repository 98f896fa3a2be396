"""structattn: structure-aware attention for PyTorch (HKT and GL-Fusion)."""

__version__ = "0.1.0"

import atexit as _atexit
import sys as _sys


def _remove_generated_modules() -> None:  # torch_geometric's generated propagate files
    if "torch_geometric" in _sys.modules:
        from structattn.utils.files import remove_generated_modules

        remove_generated_modules()


_atexit.register(_remove_generated_modules)
