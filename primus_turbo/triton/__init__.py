"""Triton kernels and their launchers. Leaves of the import graph: nothing here imports primus_turbo.pytorch."""
