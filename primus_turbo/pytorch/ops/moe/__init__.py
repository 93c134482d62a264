"""MoE operators."""

from primus_turbo.pytorch.ops.moe.dispatch import moe_combine, moe_dispatch
from primus_turbo.pytorch.ops.moe.permute import moe_permute, moe_unpermute, tokens_per_expert_to_mask
from primus_turbo.pytorch.ops.moe.router import fused_group_topk_routing_with_aux_score

__all__ = [
    "fused_group_topk_routing_with_aux_score",
    "moe_combine",
    "moe_dispatch",
    "moe_permute",
    "moe_unpermute",
    "tokens_per_expert_to_mask",
]
