"""Primus-Turbo: fast, fused, low-precision training operators for PyTorch."""

__version__ = "0.1.0"
