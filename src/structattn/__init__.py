"""structattn: structure-aware attention for PyTorch (HKT and GL-Fusion)."""

__version__ = "0.1.0"
