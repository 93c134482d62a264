"""MoE routing kernels."""

from primus_turbo.triton.moe.router_kernel import router_bwd_triton, router_fwd_triton

__all__ = ["router_bwd_triton", "router_fwd_triton"]
