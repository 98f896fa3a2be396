"""structattn: structure-aware attention for PyTorch (HKT and GL-Fusion)."""

__version__ = "0.1.0"

import atexit as _atexit

from structattn.utils.files import remove_generated_modules as _remove_generated_modules

_atexit.register(_remove_generated_modules)  # torch_geometric's generated propagate files
