"""MoE router with autograd: ``fused_group_topk_routing_with_aux_score``."""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.custom_op import call_op
from primus_turbo.pytorch.core.validation import check_dtype, check_same_device, check_tensor
from primus_turbo.pytorch.kernels.moe.router_impl import moe_router_bwd_impl, moe_router_fwd_impl

__all__ = ["fused_group_topk_routing_with_aux_score"]

_SCORE_FUNCTIONS = ("softmax", "sigmoid")
_MAX_EXPERTS = 4096


class _RouterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, bias, topk, groups, selected_groups, softmax, scaling_factor):
        args = (logits, bias, topk, groups, selected_groups, softmax, scaling_factor)
        probs, routing, aux = call_op(moe_router_fwd_impl, *args)
        ctx.save_for_backward(logits, routing)
        ctx.topk, ctx.softmax, ctx.scaling_factor = topk, softmax, scaling_factor
        ctx.mark_non_differentiable(routing)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: the kernel skips it
        return probs, routing, aux

    @staticmethod
    def backward(ctx, dprobs, _drouting, daux):
        logits, routing = ctx.saved_tensors
        options = (ctx.topk, ctx.softmax, ctx.scaling_factor)
        dlogits = call_op(moe_router_bwd_impl, logits, routing, dprobs, daux, *options)
        return dlogits, None, None, None, None, None, None


def _check_args(logits, topk, groups, selected_groups, score_function, scaling_factor, expert_bias) -> None:
    check_tensor("logits", logits, dim=2)
    check_dtype("logits.dtype", logits.dtype, (torch.float32, torch.bfloat16, torch.float16))
    experts = logits.shape[1]
    if not 0 < experts <= _MAX_EXPERTS:
        raise ValueError(f"logits must have 1 to {_MAX_EXPERTS} experts (columns), got {experts}")
    for name, value in (("topk", topk), ("groups", groups), ("selected_groups", selected_groups)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if score_function not in _SCORE_FUNCTIONS:
        raise ValueError(f"score_function must be one of {_SCORE_FUNCTIONS}, got {score_function!r}")
    if not isinstance(scaling_factor, (int, float)) or isinstance(scaling_factor, bool):
        raise TypeError(f"scaling_factor must be a float, got {scaling_factor!r}")
    if groups > 1:
        if groups & (groups - 1) or experts % groups or (experts // groups) & (experts // groups - 1):
            raise ValueError(
                f"groups must be a power of two dividing the {experts} experts into power-of-two groups, "
                f"got {groups}"
            )
        if selected_groups > groups or topk % selected_groups:
            raise ValueError(
                f"selected_groups ({selected_groups}) must be at most groups ({groups}) "
                f"and divide topk ({topk})"
            )
        if topk > selected_groups * (experts // groups):
            raise ValueError(
                f"topk {topk} exceeds the {selected_groups * (experts // groups)} eligible experts"
            )
    elif selected_groups != 1:
        raise ValueError(f"selected_groups must be 1 without groups, got {selected_groups}")
    if topk > experts:
        raise ValueError(f"topk {topk} exceeds the {experts} experts")
    if expert_bias is not None:
        check_tensor("expert_bias", expert_bias, dim=1)
        check_same_device(logits=logits, expert_bias=expert_bias)
        if expert_bias.shape[0] != experts or not expert_bias.is_floating_point():
            raise ValueError(f"expert_bias must be a float [{experts}] tensor, got {expert_bias.dtype} "
                             f"{tuple(expert_bias.shape)}")  # fmt: skip


def fused_group_topk_routing_with_aux_score(
    logits: torch.Tensor,
    topk: int,
    groups: int = 1,
    selected_groups: int = 1,
    score_function: str = "softmax",
    scaling_factor: float = 1.0,
    expert_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k MoE routing of ``logits`` [T, E] in one kernel each way: ``(probs, routing_map,
    scores_for_aux_loss)``, all [T, E] (probs and scores fp32, the map bool).

    Scores are ``softmax(logits)`` or ``sigmoid(logits)``. With ``groups > 1`` the experts form
    ``groups`` equal groups, each scored by the sum of its ``topk / selected_groups`` best scores, and
    only the best ``selected_groups`` groups are eligible (DeepSeek's group-limited routing). The
    ``topk`` best eligible experts are routed. ``expert_bias`` (aux-loss-free balancing) shifts the
    scores for the selection only. probs: softmax scores of the routed experts, or sigmoid scores
    normalized over them (topk > 1), times ``scaling_factor``, zero elsewhere. scores_for_aux_loss:
    the softmax scores, or the sigmoid scores normalized over all experts. Gradients reach ``logits``
    from probs and from the aux scores.
    """
    _check_args(logits, topk, groups, selected_groups, score_function, scaling_factor, expert_bias)
    args = (
        logits,
        expert_bias,
        topk,
        groups,
        selected_groups,
        score_function == "softmax",
        float(scaling_factor),
    )
    if torch.is_grad_enabled() and logits.requires_grad:
        return _RouterFunction.apply(*args)
    return call_op(moe_router_fwd_impl, *args)
