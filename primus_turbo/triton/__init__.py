"""Triton kernels and their launchers: leaves of the import graph (nothing from primus_turbo.pytorch)."""
