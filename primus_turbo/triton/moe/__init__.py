"""MoE routing and token permutation kernels."""

from primus_turbo.triton.moe.permute_kernel import gather_rows_triton, merge_rows_triton, route_dots_triton
from primus_turbo.triton.moe.router_kernel import router_bwd_triton, router_fwd_triton

__all__ = [
    "gather_rows_triton",
    "merge_rows_triton",
    "route_dots_triton",
    "router_bwd_triton",
    "router_fwd_triton",
]
