"""Normalization kernels."""

from primus_turbo.triton.normalization.rmsnorm_kernel import (
    rmsnorm_bwd_triton,
    rmsnorm_fp8_triton,
    rmsnorm_fwd_triton,
    rmsnorm_rstd_triton,
)

__all__ = ["rmsnorm_bwd_triton", "rmsnorm_fp8_triton", "rmsnorm_fwd_triton", "rmsnorm_rstd_triton"]
