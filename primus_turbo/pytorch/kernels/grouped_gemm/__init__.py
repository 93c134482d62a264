"""Grouped GEMM kernels and helpers."""
