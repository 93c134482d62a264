"""The MoE router's top-k on Turbo's fused routing kernel, in the place of Megatron's
``topk_routing_with_score_function`` (the function its ``TopKRouter`` calls)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from primus_turbo.pytorch.ops import fused_group_topk_routing_with_aux_score

__all__ = ["turbo_topk_routing"]


def turbo_topk_routing(original: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron's ``topk_routing_with_score_function`` answered by one fused Turbo kernel each way.

    Same results as Megatron's: softmax or sigmoid scores, group-limited top-k, the expert bias for the
    selection only, probs normalised over the routed experts where Megatron normalises them (sigmoid
    with top-k > 1; softmax after the top-k unless ``use_pre_softmax``), times ``scaling_factor``.
    Calls it cannot answer the same way go to ``original``: router replay, Megatron 0.19's dense output
    and precomputed indices, and softmax after a group-limited top-k (Megatron then scores groups by
    their logits, the kernel by their probabilities).
    """

    def topk_routing_with_score_function(
        logits: torch.Tensor,
        topk: int,
        use_pre_softmax: bool = False,
        num_groups: int | None = None,
        group_topk: int | None = None,
        scaling_factor: float | None = None,
        score_function: str = "softmax",
        expert_bias: torch.Tensor | None = None,
        fused: bool = False,
        router_replay: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        post_softmax = score_function == "softmax" and not use_pre_softmax
        if (
            router_replay is not None
            or any(v not in (None, False) for v in kwargs.values())
            or (post_softmax and group_topk)
            or score_function not in ("softmax", "sigmoid")
            or (score_function == "softmax" and expert_bias is not None)
        ):
            return original(
                logits, topk, use_pre_softmax, num_groups, group_topk, scaling_factor, score_function,
                expert_bias, fused, router_replay, **kwargs,
            )  # fmt: skip
        groups, selected = (num_groups, group_topk) if group_topk else (1, 1)
        scale = 1.0 if post_softmax else float(scaling_factor or 1.0)
        probs, routing_map, _ = fused_group_topk_routing_with_aux_score(
            logits, topk, groups, selected, score_function, scale, expert_bias
        )
        if post_softmax:  # softmax over the routed logits = the full softmax renormalised over them
            probs = probs / probs.sum(dim=-1, keepdim=True)
            if scaling_factor:
                probs = probs * scaling_factor
        return probs.type_as(logits), routing_map

    return topk_routing_with_score_function
