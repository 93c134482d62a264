"""MoE router custom ops ``primus_turbo::moe_router_fwd`` / ``moe_router_bwd``: the fused Triton kernels
(``primus_turbo/triton/moe/router_kernel.py``, which states the semantics) where Triton runs, and the
same computation in PyTorch elsewhere."""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.custom_op import custom_op
from primus_turbo.triton.moe import router_bwd_triton, router_fwd_triton
from primus_turbo.triton.utils.device_info import triton_runs_on

__all__ = ["moe_router_bwd_impl", "moe_router_fwd_impl", "router_bwd_reference", "router_fwd_reference"]

_EPS = 1e-20


def _scores(logits: torch.Tensor, softmax: bool) -> torch.Tensor:
    x = logits.float()
    return torch.softmax(x, dim=-1) if softmax else torch.sigmoid(x)


def _best(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest values per row, ties to the lower index (as the kernel's argmax)."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def router_fwd_reference(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    topk: int,
    groups: int,
    selected_groups: int,
    softmax: bool,
    scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probs, routing map, aux scores) in PyTorch, as the kernel module docstring defines them."""
    tokens, experts = logits.shape
    s = _scores(logits, softmax)
    sel = s + bias.float() if bias is not None else s
    if groups > 1:
        group_score = sel.view(tokens, groups, -1).topk(topk // selected_groups, dim=-1).values.sum(-1)
        keep = torch.zeros(tokens, groups, dtype=torch.bool, device=logits.device)
        keep.scatter_(1, _best(group_score, selected_groups), True)
        sel = sel.masked_fill(~keep.repeat_interleave(experts // groups, dim=1), float("-inf"))
    routing = torch.zeros(tokens, experts, dtype=torch.bool, device=logits.device)
    routing.scatter_(1, _best(sel, topk), True)
    picked = torch.where(routing, s, 0.0)
    if softmax:
        probs, aux = picked, s
    else:
        probs = picked / (picked.sum(-1, keepdim=True) + _EPS) if topk > 1 else picked
        aux = s / (s.sum(-1, keepdim=True) + _EPS)
    return probs * scaling_factor, routing, aux


def router_bwd_reference(
    logits: torch.Tensor,
    routing: torch.Tensor,
    dprobs: torch.Tensor | None,
    daux: torch.Tensor | None,
    topk: int,
    softmax: bool,
    scaling_factor: float,
) -> torch.Tensor:
    """d logits in PyTorch, the formulas of the backward kernel (a None gradient is zero)."""
    s = _scores(logits, softmax)
    dprobs = dprobs.float() * scaling_factor if dprobs is not None else torch.zeros_like(s)
    daux = daux.float() if daux is not None else torch.zeros_like(s)
    if softmax:
        ds = torch.where(routing, dprobs, 0.0) + daux
        return (s * (ds - (ds * s).sum(-1, keepdim=True))).to(logits.dtype)
    picked = torch.where(routing, s, 0.0)
    if topk > 1:
        total = picked.sum(-1, keepdim=True) + _EPS
        ds = torch.where(routing, (dprobs - (dprobs * picked).sum(-1, keepdim=True) / total) / total, 0.0)
    else:
        ds = torch.where(routing, dprobs, 0.0)
    everything = s.sum(-1, keepdim=True) + _EPS
    ds = ds + (daux - (daux * s).sum(-1, keepdim=True) / everything) / everything
    return (ds * s * (1.0 - s)).to(logits.dtype)


@custom_op("primus_turbo::moe_router_fwd", mutates_args=())
def moe_router_fwd_impl(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    topk: int,
    groups: int,
    selected_groups: int,
    softmax: bool,
    scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probs fp32 [T, E], routing map bool [T, E], aux-loss scores fp32 [T, E])."""
    args = (topk, groups, selected_groups, softmax, scaling_factor)
    if triton_runs_on(logits.device):
        return router_fwd_triton(logits.contiguous(), bias.contiguous() if bias is not None else None, *args)
    return router_fwd_reference(logits, bias, *args)


@moe_router_fwd_impl.register_fake
def _moe_router_fwd_fake(logits, bias, topk, groups, selected_groups, softmax, scaling_factor):
    probs = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    return probs, torch.empty(logits.shape, dtype=torch.bool, device=logits.device), torch.empty_like(probs)


@custom_op("primus_turbo::moe_router_bwd", mutates_args=())
def moe_router_bwd_impl(
    logits: torch.Tensor,
    routing: torch.Tensor,
    dprobs: torch.Tensor | None,
    daux: torch.Tensor | None,
    topk: int,
    softmax: bool,
    scaling_factor: float,
) -> torch.Tensor:
    """d logits [T, E] in the logits' dtype; a None gradient (its output unused) is zero."""
    if triton_runs_on(logits.device):
        grads = (t.contiguous() if t is not None else None for t in (logits, routing, dprobs, daux))
        return router_bwd_triton(*grads, topk, softmax, scaling_factor)
    return router_bwd_reference(logits, routing, dprobs, daux, topk, softmax, scaling_factor)


@moe_router_bwd_impl.register_fake
def _moe_router_bwd_fake(logits, routing, dprobs, daux, topk, softmax, scaling_factor):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)
