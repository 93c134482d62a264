"""Fused MoE router: scores, DeepSeek-style group-limited top-k, routing probabilities and the scores
for the auxiliary loss, forward and backward, one program per block of tokens.

Per token (row of logits [T, E], E experts in G groups of E / G):
- ``s = softmax(logits)`` (SOFTMAX) or ``s = sigmoid(logits)``; selection uses ``s + bias``;
- each group scores the sum of its ``topk / selected_groups`` best selection values, the
  ``selected_groups`` best groups stay eligible, and the ``topk`` best eligible experts are routed;
- probs: softmax: ``s`` of the routed experts; sigmoid: ``s`` of the routed experts over their sum
  (when topk > 1); both times ``scaling_factor``, zero elsewhere;
- aux scores: softmax: ``s``; sigmoid: ``s / sum(s)`` over all experts.
Ties go to the lower expert or group index.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from primus_turbo.triton.utils.launch import cached_launch

__all__ = ["router_bwd_triton", "router_fwd_triton"]

_EPS = tl.constexpr(1e-20)


@triton.jit
def _scores(logits, col_ok, SOFTMAX: tl.constexpr):
    """Row-wise softmax or sigmoid of [ROWS, BLOCK_E] fp32 logits (padding columns score 0)."""
    if SOFTMAX:
        x = tl.where(col_ok[None, :], logits, float("-inf"))
        e = tl.exp(x - tl.max(x, axis=1)[:, None])
        return e / tl.sum(e, axis=1)[:, None]
    return tl.where(col_ok[None, :], tl.sigmoid(logits), 0.0)


@triton.jit
def _route(sel, col_ok, TOPK: tl.constexpr, GROUPS: tl.constexpr, SELECTED_GROUPS: tl.constexpr,
           ROWS: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
    """[ROWS, BLOCK_E] bool: the routed experts of each row under group-limited top-k."""
    cols = tl.arange(0, BLOCK_E)
    sel = tl.where(col_ok[None, :], sel, float("-inf"))
    if GROUPS > 1:
        per_group: tl.constexpr = BLOCK_E // GROUPS
        grouped = tl.reshape(sel, (ROWS, GROUPS, per_group))
        in_group = tl.arange(0, per_group)
        group_score = tl.zeros((ROWS, GROUPS), dtype=tl.float32)
        for _ in tl.static_range(TOPK // SELECTED_GROUPS):
            best = tl.argmax(grouped, axis=2)
            group_score += tl.max(grouped, axis=2)
            grouped = tl.where(in_group[None, None, :] == best[:, :, None], float("-inf"), grouped)
        group_ids = tl.arange(0, GROUPS)
        keep = tl.zeros((ROWS, GROUPS), dtype=tl.int1)
        for _ in tl.static_range(SELECTED_GROUPS):
            best = tl.argmax(group_score, axis=1)
            keep = keep | (group_ids[None, :] == best[:, None])
            group_score = tl.where(group_ids[None, :] == best[:, None], float("-inf"), group_score)
        expert_keep = tl.reshape(
            tl.broadcast_to(keep[:, :, None], (ROWS, GROUPS, per_group)), (ROWS, BLOCK_E)
        )
        sel = tl.where(expert_keep, sel, float("-inf"))
    routed = tl.zeros((ROWS, BLOCK_E), dtype=tl.int1)
    for _ in tl.static_range(TOPK):
        best = tl.argmax(sel, axis=1)
        hit = cols[None, :] == best[:, None]
        routed = routed | hit
        sel = tl.where(hit, float("-inf"), sel)
    return routed


@triton.jit
def _tile(T, E, ROWS: tl.constexpr, BLOCK_E: tl.constexpr):
    """(offsets, mask, column mask) of this program's [ROWS, BLOCK_E] block of a contiguous [T, E]."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    offs = rows[:, None].to(tl.int64) * E + cols[None, :]
    return offs, (rows < T)[:, None] & col_ok[None, :], col_ok


@cached_launch
@triton.jit
def _router_fwd_kernel(
    logits_ptr,
    bias_ptr,
    probs_ptr,
    map_ptr,
    aux_ptr,
    T,
    E,
    scaling_factor,
    SOFTMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    TOPK: tl.constexpr,
    GROUPS: tl.constexpr,
    SELECTED_GROUPS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    offs, mask, col_ok = _tile(T, E, ROWS, BLOCK_E)
    logits = tl.load(logits_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = _scores(logits, col_ok, SOFTMAX)
    sel = s
    if HAS_BIAS:
        bias = tl.load(bias_ptr + tl.arange(0, BLOCK_E), mask=col_ok, other=0.0).to(tl.float32)
        sel = s + bias[None, :]
    routed = _route(sel, col_ok, TOPK, GROUPS, SELECTED_GROUPS, ROWS, BLOCK_E)
    picked = tl.where(routed, s, 0.0)
    if SOFTMAX:
        probs = picked
        aux = s
    else:
        if TOPK > 1:
            probs = picked / (tl.sum(picked, axis=1)[:, None] + _EPS)
        else:
            probs = picked
        aux = s / (tl.sum(s, axis=1)[:, None] + _EPS)
    tl.store(probs_ptr + offs, probs * scaling_factor, mask=mask)
    tl.store(map_ptr + offs, routed.to(tl.int8), mask=mask)
    tl.store(aux_ptr + offs, aux, mask=mask)


@cached_launch
@triton.jit
def _router_bwd_kernel(
    logits_ptr,
    map_ptr,
    dprobs_ptr,
    daux_ptr,
    dlogits_ptr,
    T,
    E,
    scaling_factor,
    SOFTMAX: tl.constexpr,
    TOPK: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    HAS_DPROBS: tl.constexpr,
    HAS_DAUX: tl.constexpr,
):
    offs, mask, col_ok = _tile(T, E, ROWS, BLOCK_E)
    logits = tl.load(logits_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    routed = tl.load(map_ptr + offs, mask=mask, other=0) != 0
    # a gradient autograd did not produce (its output unused) is zero: not read, not materialised
    dprobs = tl.zeros_like(logits)
    if HAS_DPROBS:
        dprobs = tl.load(dprobs_ptr + offs, mask=mask, other=0.0).to(tl.float32) * scaling_factor
    daux = tl.zeros_like(logits)
    if HAS_DAUX:
        daux = tl.load(daux_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = _scores(logits, col_ok, SOFTMAX)
    if SOFTMAX:
        # probs and aux both read s directly: d s = routed * dprobs + daux, then through the softmax
        ds = tl.where(routed, dprobs, 0.0) + daux
        dlogits = s * (ds - tl.sum(ds * s, axis=1)[:, None])
    else:
        picked = tl.where(routed, s, 0.0)
        if TOPK > 1:
            total = tl.sum(picked, axis=1)[:, None] + _EPS
            ds = tl.where(routed, (dprobs - tl.sum(dprobs * picked, axis=1)[:, None] / total) / total, 0.0)
        else:
            ds = tl.where(routed, dprobs, 0.0)
        everything = tl.sum(s, axis=1)[:, None] + _EPS
        ds += (daux - tl.sum(daux * s, axis=1)[:, None] / everything) / everything
        dlogits = ds * s * (1.0 - s)
    tl.store(dlogits_ptr + offs, dlogits.to(dlogits_ptr.dtype.element_ty), mask=mask)


def _launch_shape(experts: int) -> tuple[int, int, int]:
    """(ROWS per program, BLOCK_E, warps): about 2K scores per program."""
    block_e = triton.next_power_of_2(experts)
    rows = max(1, min(16, 2048 // block_e))
    return rows, block_e, 4 if block_e * rows <= 2048 else 8


def router_fwd_triton(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    topk: int,
    groups: int,
    selected_groups: int,
    softmax: bool,
    scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probs fp32 [T, E], routing map bool [T, E], aux scores fp32 [T, E]) of contiguous ``logits``."""
    tokens, experts = logits.shape
    probs = torch.empty((tokens, experts), dtype=torch.float32, device=logits.device)
    routing = torch.empty((tokens, experts), dtype=torch.bool, device=logits.device)
    aux = torch.empty_like(probs)
    if tokens == 0:
        return probs, routing, aux
    rows, block_e, warps = _launch_shape(experts)
    _router_fwd_kernel[(triton.cdiv(tokens, rows),)](
        logits,
        bias if bias is not None else logits,
        probs,
        routing.view(torch.int8),
        aux,
        tokens,
        experts,
        scaling_factor,
        SOFTMAX=softmax,
        HAS_BIAS=bias is not None,
        TOPK=topk,
        GROUPS=groups,
        SELECTED_GROUPS=selected_groups,
        ROWS=rows,
        BLOCK_E=block_e,
        num_warps=warps,
    )
    return probs, routing, aux


def router_bwd_triton(
    logits: torch.Tensor,
    routing: torch.Tensor,
    dprobs: torch.Tensor | None,
    daux: torch.Tensor | None,
    topk: int,
    softmax: bool,
    scaling_factor: float,
) -> torch.Tensor:
    """d logits (logits' dtype) from the gradients of probs and of the aux scores (contiguous [T, E];
    None for a zero gradient)."""
    tokens, experts = logits.shape
    dlogits = torch.empty_like(logits)
    if tokens == 0:
        return dlogits
    rows, block_e, warps = _launch_shape(experts)
    _router_bwd_kernel[(triton.cdiv(tokens, rows),)](
        logits,
        routing.view(torch.int8),
        dprobs if dprobs is not None else logits,
        daux if daux is not None else logits,
        dlogits,
        tokens,
        experts,
        scaling_factor,
        SOFTMAX=softmax,
        TOPK=topk,
        ROWS=rows,
        BLOCK_E=block_e,
        HAS_DPROBS=dprobs is not None,
        HAS_DAUX=daux is not None,
        num_warps=warps,
    )
    return dlogits
