"""The MoE router's top-k on Turbo's fused routing kernel, in the place of Megatron's
``topk_routing_with_score_function`` (the function its ``TopKRouter`` calls), and the router's auxiliary
losses attached in a way ``torch.compile`` traces."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from primus_turbo.pytorch.ops import fused_group_topk_routing_with_aux_score

__all__ = ["TurboAuxLossScaler", "track_aux_loss_scale", "turbo_topk_routing"]


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


class _LossScale:
    """The tensor Megatron scales auxiliary-loss gradients by, kept where Dynamo can read it (a class
    attribute of an ``autograd.Function``, where Megatron keeps it, breaks the graph)."""

    tensor: torch.Tensor | None = None


_LOSS_SCALE = _LossScale()


def _scaled_ones(aux_loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if scale.numel() != 1:
        raise ValueError(f"the aux-loss scale must have one element, got shape {tuple(scale.shape)}")
    return torch.ones_like(aux_loss) * scale


@torch.library.custom_op("primus_turbo::megatron_aux_loss_grad", mutates_args=())
def _aux_loss_grad(grad_output: torch.Tensor, aux_loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The auxiliary loss's gradient, ``ones_like(aux_loss) * scale``, as Megatron's backward computes it.

    An opaque op that takes ``grad_output`` (unused) so that it runs in the backward: AOTAutograd moves
    backward nodes that do not depend on an incoming gradient into the forward, and the decompositions
    drop the dependency of ``grad_output.new_ones``; the scale would then be read before Megatron sets it.
    """
    return _scaled_ones(aux_loss, scale)


@_aux_loss_grad.register_fake
def _(grad_output: torch.Tensor, aux_loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return _scaled_ones(aux_loss, scale)


class _ScaledAuxLoss(torch.autograd.Function):
    """Megatron's ``MoEAuxLossAutoScaler`` with the scale tensor passed in instead of read in backward.

    The scale is kept by reference, not saved: ``set_loss_scale`` rewrites it in place after the forward,
    and the backward uses the value set by then, as Megatron's does.
    """

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux_loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (aux_loss,) = ctx.saved_tensors
        return grad_output, _aux_loss_grad(grad_output, aux_loss, ctx.scale), None


class TurboAuxLossScaler:
    """Stands in for ``MoEAuxLossAutoScaler`` in Megatron's router module.

    Under ``torch.compile`` it attaches the load-balancing and z losses with ``_ScaledAuxLoss``, so a
    compiled MoE layer is one graph; in eager mode, and before any loss scale is set, it is Megatron's.
    """

    @staticmethod
    def apply(output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        scale = _LOSS_SCALE.tensor
        if scale is None or not torch.compiler.is_compiling():
            return MoEAuxLossAutoScaler.apply(output, aux_loss)
        return _ScaledAuxLoss.apply(output, aux_loss, scale)

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        """Megatron's (code that imports the name from the router module after the patch calls it)."""
        MoEAuxLossAutoScaler.set_loss_scale(scale)


def track_aux_loss_scale() -> Callable[[], None]:
    """Make ``MoEAuxLossAutoScaler.set_loss_scale`` also record its tensor for ``TurboAuxLossScaler``;
    returns the undo.

    Megatron's copies a new scale into the tensor it holds, so a [1] scale (its schedule's) after a 0-dim
    one (the default its backward creates) fails; a one-element scale is reshaped to the held tensor's
    shape, which also keeps that tensor, the one captured CUDA graphs read."""
    original = MoEAuxLossAutoScaler.__dict__["set_loss_scale"]

    def set_loss_scale(scale: torch.Tensor) -> None:
        held = MoEAuxLossAutoScaler.main_loss_backward_scale
        if held is not None and held.shape != scale.shape and held.numel() == scale.numel() == 1:
            scale = scale.reshape(held.shape)
        original.__func__(scale)
        _LOSS_SCALE.tensor = MoEAuxLossAutoScaler.main_loss_backward_scale

    MoEAuxLossAutoScaler.set_loss_scale = staticmethod(set_loss_scale)
    _LOSS_SCALE.tensor = MoEAuxLossAutoScaler.main_loss_backward_scale

    def undo() -> None:
        MoEAuxLossAutoScaler.set_loss_scale = original
        _LOSS_SCALE.tensor = None

    return undo
