"""Dense GEMM kernels."""

from primus_turbo.triton.gemm.gemm_kernel import gemm_triton, tma_compatible

__all__ = ["gemm_triton", "tma_compatible"]
