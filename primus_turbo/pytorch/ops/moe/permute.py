"""MoE token permutation with autograd: ``moe_permute``, ``moe_unpermute``, ``tokens_per_expert_to_mask``.

Tokens routed to several experts are copied once per route into an expert-major layout that a grouped
GEMM consumes (see ``primus_turbo/pytorch/kernels/moe/permute_impl.py``); ``moe_unpermute`` sums each
token's rows back, weighted by its routing probabilities. Nothing syncs with the host when the row count
is fixed by ``num_permuted_tokens``.
"""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.custom_op import call_op, direct_call_allowed
from primus_turbo.pytorch.core.validation import check_same_device, check_tensor
from primus_turbo.pytorch.kernels.moe.permute_impl import (
    merge_rows_torch,
    moe_expert_bounds_impl,
    moe_expert_layout_impl,
    moe_merge_rows_impl,
    moe_route_dots_impl,
    moe_scatter_rows_impl,
    padded_counts,
    permute_torch,
    permute_uses_triton,
)

__all__ = ["moe_permute", "moe_unpermute", "tokens_per_expert_to_mask"]


def _scatter_tokens(tokens, probs_map, row_id_map, start, kept, rows):
    """(permuted rows, each row's route probability or None without ``probs_map``)."""
    permuted, permuted_probs = call_op(
        moe_scatter_rows_impl, tokens, row_id_map, start, kept, probs_map, rows, False
    )
    return permuted, permuted_probs if probs_map is not None else None


class _PermuteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, probs_map, row_id_map, start, kept, rows):
        ctx.save_for_backward(row_id_map)
        ctx.probs_dtype = probs_map.dtype if probs_map is not None else None
        return _scatter_tokens(tokens, probs_map, row_id_map, start, kept, rows)

    @staticmethod
    def backward(ctx, grad_permuted, grad_probs):
        (row_id_map,) = ctx.saved_tensors
        grad_tokens = None
        if ctx.needs_input_grad[0] and grad_permuted is not None:
            grad_tokens = call_op(moe_merge_rows_impl, grad_permuted.contiguous(), row_id_map, None)
        grad_probs_map = None
        if ctx.needs_input_grad[1] and grad_probs is not None:
            spare = torch.cat([grad_probs.float(), grad_probs.new_zeros(1, dtype=torch.float32)])
            rows = torch.where(row_id_map >= 0, row_id_map.long(), spare.shape[0] - 1)
            grad_probs_map = spare[rows].to(ctx.probs_dtype)
        return grad_tokens, grad_probs_map, None, None, None, None


class _UnpermuteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, permuted, probs_map, row_id_map):
        out = call_op(moe_merge_rows_impl, permuted, row_id_map, probs_map)
        ctx.save_for_backward(permuted, probs_map, row_id_map)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        permuted, probs_map, row_id_map = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        start, count = call_op(moe_expert_bounds_impl, row_id_map)
        grad_permuted, _ = call_op(
            moe_scatter_rows_impl, grad_out, row_id_map, start, count, probs_map, permuted.shape[0], True
        )
        grad_probs = None
        if probs_map is not None and ctx.needs_input_grad[1]:
            grad_probs = call_op(moe_route_dots_impl, grad_out, permuted, row_id_map).to(probs_map.dtype)
        return grad_permuted, grad_probs, None


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd must record the call (an ``autograd.Function`` costs host time per call)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _routing_map(expert_map: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(bool routing map [T, E], int64 top-k indices with -1 mapped to a spare column E, or None)."""
    if expert_map.dtype == torch.bool:
        if expert_map.shape[1] != experts:
            raise ValueError(f"routing_map has {expert_map.shape[1]} columns, num_local_experts is {experts}")
        return expert_map, None
    if expert_map.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"expert_map must be a bool routing map or int32/int64 top-k indices, got {expert_map.dtype}"
        )
    if expert_map.device.type == "cpu" and bool(((expert_map < -1) | (expert_map >= experts)).any()):
        raise ValueError(
            f"top-k indices must lie in [-1, {experts}), got {expert_map.min()}..{expert_map.max()}"
        )
    index = _spare_column(expert_map, experts)
    routing = torch.zeros(expert_map.shape[0], experts + 1, dtype=torch.bool, device=expert_map.device)
    return routing.scatter_(1, index, True)[:, :experts], index


def _spare_column(indices: torch.Tensor, experts: int) -> torch.Tensor:
    """int64 top-k indices with dropped routes (-1) sent to a spare column ``experts``."""
    return torch.where(indices < 0, experts, indices).long()


def _probs_map(probs: torch.Tensor, index: torch.Tensor | None, experts: int) -> torch.Tensor:
    """[T, E] probabilities from routing-map layout (as is) or top-k layout (scattered, differentiably)."""
    if index is None:
        return probs
    spare = probs.new_zeros(probs.shape[0], experts + 1)
    return spare.scatter(1, index, probs)[:, :experts]


def moe_permute(
    tokens: torch.Tensor,
    expert_map: torch.Tensor,
    probs: torch.Tensor | None = None,
    *,
    num_local_experts: int,
    pad_multiple: int = 0,
    num_permuted_tokens: int = -1,
    scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Group ``tokens`` [T, H] by expert: ``(permuted, row_id_map, tokens_per_expert, permuted_probs,
    permuted_scales)``.

    ``expert_map`` is a bool routing map [T, E] or top-k expert indices [T, K] (int32/int64, -1 = no route;
    no expert twice per token), E = ``num_local_experts``. ``permuted`` [N, H] holds expert 0's tokens in
    token order, then expert 1's, ..., each expert's rows padded with zeros to a multiple of
    ``pad_multiple``; N is their total, read on the host, unless ``num_permuted_tokens > 0`` fixes it
    (routes past it are dropped: their ``row_id_map`` entry is -1). ``row_id_map`` int32 [T, E] names each
    route's row; ``tokens_per_expert`` is the int64 [E] count of kept routes per expert (unpadded, on
    the device).
    ``probs`` ([T, E] or [T, K], like ``expert_map``) come out per row as fp32 ``permuted_probs`` [N];
    ``scales`` [T, S] (FP8 per-token scales) as ``permuted_scales`` [N, S]. Differentiable in ``tokens`` and
    ``probs``.
    """
    check_tensor("tokens", tokens, dim=2)
    check_tensor("expert_map", expert_map, dim=2)
    if (
        not isinstance(num_local_experts, int)
        or isinstance(num_local_experts, bool)
        or num_local_experts <= 0
    ):
        raise ValueError(f"num_local_experts must be a positive int, got {num_local_experts!r}")
    for name, value in (("pad_multiple", pad_multiple), ("num_permuted_tokens", num_permuted_tokens)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if pad_multiple < 0:
        raise ValueError(f"pad_multiple must be >= 0, got {pad_multiple}")
    if expert_map.shape[0] != tokens.shape[0]:
        raise ValueError(f"expert_map has {expert_map.shape[0]} rows for {tokens.shape[0]} tokens")
    extra = {name: t for name, t in (("probs", probs), ("scales", scales)) if t is not None}
    check_same_device(tokens=tokens, expert_map=expert_map, **extra)
    if probs is not None and tuple(probs.shape) != tuple(expert_map.shape):
        raise ValueError(
            f"probs must match expert_map's shape {tuple(expert_map.shape)}, got {tuple(probs.shape)}"
        )
    if scales is not None and (scales.dim() != 2 or scales.shape[0] != tokens.shape[0]):
        raise ValueError(f"scales must be [{tokens.shape[0]}, S], got {tuple(scales.shape)}")
    routing, index = _routing_map(expert_map, num_local_experts)
    probs_map = _probs_map(probs, index, num_local_experts) if probs is not None else None
    if not permute_uses_triton(tokens) and direct_call_allowed(tokens, routing, probs_map, scales):
        # the CPU in eager mode: PyTorch's autograd of one expression costs less host time than the custom
        # ops and a Python Function
        return permute_torch(tokens, routing, probs_map, scales, pad_multiple, num_permuted_tokens)
    row_id_map, tokens_per_expert, start = call_op(
        moe_expert_layout_impl, routing, pad_multiple, num_permuted_tokens
    )
    rows = num_permuted_tokens if num_permuted_tokens > 0 else int(start[-1].item())
    scatter = _PermuteFunction.apply if _needs_grad(tokens, probs_map) else _scatter_tokens
    permuted, permuted_probs = scatter(tokens, probs_map, row_id_map, start, tokens_per_expert, rows)
    permuted_scales = None
    if scales is not None:
        permuted_scales, _ = call_op(
            moe_scatter_rows_impl, scales, row_id_map, start, tokens_per_expert, None, rows, False
        )
    return permuted, row_id_map, tokens_per_expert, permuted_probs, permuted_scales


def moe_unpermute(
    permuted: torch.Tensor,
    row_id_map: torch.Tensor,
    probs: torch.Tensor | None = None,
    topk_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """[T, H]: each token's rows of ``permuted`` [N, H] summed back (fp32 accumulation), weighted by
    ``probs`` when given: [T, E] routing-map layout, or [T, K] with the ``topk_indices`` that
    ``moe_permute`` took. Differentiable in ``permuted`` and ``probs``."""
    check_tensor("permuted", permuted, dim=2)
    check_tensor("row_id_map", row_id_map, dim=2)
    if row_id_map.dtype != torch.int32:
        raise TypeError(f"row_id_map must be the int32 map moe_permute returns, got {row_id_map.dtype}")
    check_same_device(
        permuted=permuted, row_id_map=row_id_map, **({"probs": probs} if probs is not None else {})
    )
    experts = row_id_map.shape[1]
    probs_map = None
    if probs is not None:
        if topk_indices is not None:
            if tuple(probs.shape) != tuple(topk_indices.shape):
                raise ValueError(
                    f"probs {tuple(probs.shape)} must match topk_indices {tuple(topk_indices.shape)}"
                )
            probs_map = _probs_map(probs, _spare_column(topk_indices, experts), experts)
        elif tuple(probs.shape) != tuple(row_id_map.shape):
            raise ValueError(f"probs must be [T, E] = {tuple(row_id_map.shape)} (or pass topk_indices)")
        else:
            probs_map = probs
    if not permute_uses_triton(permuted) and direct_call_allowed(permuted, row_id_map, probs_map):
        return merge_rows_torch(permuted, row_id_map, probs_map)  # the CPU in eager mode, as moe_permute
    if _needs_grad(permuted, probs_map):
        return _UnpermuteFunction.apply(permuted.contiguous(), probs_map, row_id_map)
    return call_op(moe_merge_rows_impl, permuted.contiguous(), row_id_map, probs_map)


def tokens_per_expert_to_mask(
    tokens_per_expert: torch.Tensor, num_rows: int, pad_multiple: int = 0
) -> torch.Tensor:
    """bool [num_rows]: which rows of ``moe_permute``'s layout hold a token (False for padding and for rows
    past the last expert), from the unpadded ``tokens_per_expert`` it returned."""
    counts = tokens_per_expert.long()
    padded = padded_counts(counts, pad_multiple)
    ends = padded.cumsum(0)
    rows = torch.arange(num_rows, device=counts.device)
    expert = torch.searchsorted(ends, rows, right=True)
    inside = expert < counts.numel()
    expert = expert.clamp(max=counts.numel() - 1)
    return inside & (rows - (ends - padded)[expert] < counts[expert])
