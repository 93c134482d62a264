"""MoE routing and token permutation kernels."""

from primus_turbo.triton.moe.permute_kernel import (
    expert_bounds_triton,
    expert_layout_triton,
    merge_rows_triton,
    route_dots_triton,
    scatter_rows_triton,
)
from primus_turbo.triton.moe.router_kernel import router_bwd_triton, router_fwd_triton

__all__ = [
    "expert_bounds_triton",
    "expert_layout_triton",
    "merge_rows_triton",
    "route_dots_triton",
    "router_bwd_triton",
    "router_fwd_triton",
    "scatter_rows_triton",
]
