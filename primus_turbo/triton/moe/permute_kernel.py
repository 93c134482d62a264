"""MoE token permutation kernels over a [T, E] map of destination rows (``row_id_map``, -1 = no route).

The layout is expert-major: expert ``e``'s rows start at ``start[e]`` and hold its tokens in token order,
then padding. Building it:

- ``expert_layout_triton``: the routing map's per-block counts, one program's scan of them (each expert's
  first row, its kept count, every token block's first row per expert) and the map itself, three small
  kernels without a host round trip.

Moving rows, one program per token (or per token and ``BLOCK_H`` slice of the hidden dimension), so each
token row is read once whatever its top-k:

- ``scatter_rows_triton``: ``out[map[t, e]] = x[t]`` (times ``w[t, e]``) for every route, and zeros on the
  rows no route names (padding, and rows past the last expert of a fixed-size output): permute, and the
  backward of unpermute. Also writes each row's route weight.
- ``merge_rows_triton``: ``out[t] = sum_e w[t, e] * y[map[t, e]]``: unpermute, and the backward of permute.
- ``route_dots_triton``: ``d[t, e] = <g[t], y[map[t, e]]>`` for routed pairs, else 0: the merge weights'
  gradient.

A token program takes its routes from its map row in expert order (a prefix count picks the i-th route),
so sums run in fp32 in expert order and results are deterministic.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from primus_turbo.triton.utils.launch import cached_launch

__all__ = [
    "ScatterLaunch",
    "expert_bounds_triton",
    "expert_layout_triton",
    "merge_rows_triton",
    "route_dots_triton",
    "scatter_launch",
    "scatter_rows_triton",
]

_BLOCK_H = 1024
_BLOCK_T = 64
_BLOCK_E = 64
_CHECK_ROWS = 32
_NO_CAP = 2**31 - 1


@cached_launch
@triton.jit
def _block_counts_kernel(map_ptr, counts_ptr, T, E, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    ok = (tokens < T)[:, None] & (experts < E)[None, :]
    routed = tl.load(map_ptr + tokens.to(tl.int64)[:, None] * E + experts[None, :], mask=ok, other=0) != 0
    counts = tl.sum(routed.to(tl.int32), axis=0)
    tl.store(counts_ptr + tl.program_id(0) * E + experts, counts, mask=experts < E)


@cached_launch
@triton.jit
def _expert_starts_kernel(
    counts_ptr,
    base_ptr,
    start_ptr,
    kept_ptr,
    total_ptr,
    NB,
    E,
    pad,
    cap,
    BLOCK_B: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    carry = tl.sum(tl.zeros([BLOCK_E], dtype=tl.int32), axis=0)
    for e0 in range(0, E, BLOCK_E):
        experts = e0 + tl.arange(0, BLOCK_E)
        e_ok = experts < E
        total = tl.zeros([BLOCK_E], dtype=tl.int32)
        for b0 in range(0, NB, BLOCK_B):
            blocks = b0 + tl.arange(0, BLOCK_B)
            ok = (blocks < NB)[:, None] & e_ok[None, :]
            total += tl.sum(
                tl.load(counts_ptr + blocks[:, None] * E + experts[None, :], mask=ok, other=0), axis=0
            )
        padded = (total + pad - 1) // pad * pad
        start = carry + tl.cumsum(padded, axis=0) - padded
        carry += tl.sum(padded, axis=0)
        kept = tl.minimum(tl.maximum(cap - start, 0), total)
        tl.store(start_ptr + experts, start, mask=e_ok)
        tl.store(kept_ptr + experts, kept.to(tl.int64), mask=e_ok)
        running = start
        for b0 in range(0, NB, BLOCK_B):
            blocks = b0 + tl.arange(0, BLOCK_B)
            ok = (blocks < NB)[:, None] & e_ok[None, :]
            counts = tl.load(counts_ptr + blocks[:, None] * E + experts[None, :], mask=ok, other=0)
            base = running[None, :] + tl.cumsum(counts, axis=0) - counts
            tl.store(base_ptr + blocks[:, None] * E + experts[None, :], base, mask=ok)
            running += tl.sum(counts, axis=0)
    tl.store(total_ptr, carry)


@cached_launch
@triton.jit
def _route_rows_kernel(map_ptr, base_ptr, rows_ptr, T, E, cap, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = experts < E
    ok = (tokens < T)[:, None] & e_ok[None, :]
    offsets = tokens.to(tl.int64)[:, None] * E + experts[None, :]
    routed = (tl.load(map_ptr + offsets, mask=ok, other=0) != 0).to(tl.int32)
    base = tl.load(base_ptr + tl.program_id(0) * E + experts, mask=e_ok, other=0)
    dest = base[None, :] + tl.cumsum(routed, axis=0) - routed
    tl.store(rows_ptr + offsets, tl.where((routed != 0) & (dest < cap), dest, -1), mask=ok)


@cached_launch
@triton.jit
def _expert_bounds_kernel(map_ptr, start_ptr, count_ptr, T, E, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    ok = (tokens < T)[:, None] & (experts < E)[None, :]
    dest = tl.load(map_ptr + tokens.to(tl.int64)[:, None] * E + experts[None, :], mask=ok, other=-1)
    routed = dest >= 0
    count = tl.sum(routed.to(tl.int32), axis=0)
    first = tl.min(tl.where(routed, dest, 2147483647), axis=0)
    seen = (experts < E) & (count > 0)
    tl.atomic_add(count_ptr + experts, count, mask=seen)
    tl.atomic_min(start_ptr + experts, first, mask=seen)


@triton.jit
def _routes(map_ptr, token, E, E_P2: tl.constexpr):
    """A token's map row: (rows, routed, position among the token's routes, route count)."""
    experts = tl.arange(0, E_P2)
    dest = tl.load(map_ptr + token.to(tl.int64) * E + experts, mask=experts < E, other=-1)
    routed = dest >= 0
    flags = routed.to(tl.int32)
    return dest, routed, tl.cumsum(flags, axis=0) - 1, tl.sum(flags, axis=0)


@triton.jit
def _store_route(out_ptr, row, stride_out, cols, col_ok, vals, weight, SCALE_ROWS: tl.constexpr):
    if SCALE_ROWS:
        vals = (vals.to(tl.float32) * weight).to(vals.dtype)
    tl.store(out_ptr + row * stride_out + cols, vals, mask=col_ok)


@triton.jit
def _scatter_token(
    x_ptr, map_ptr, w_ptr, out_ptr, rw_ptr, token, col_block, E, H, stride_x, stride_out,
    HAS_W: tl.constexpr, SCALE_ROWS: tl.constexpr, E_P2: tl.constexpr, BLOCK_H: tl.constexpr,
    ALL_COLS: tl.constexpr,
):  # fmt: skip
    """One token's row (one ``BLOCK_H`` slice of it, or all of it with ``ALL_COLS``) to its routes' rows."""
    dest, routed, position, n = _routes(map_ptr, token, E, E_P2)
    if HAS_W:
        w = tl.load(w_ptr + token.to(tl.int64) * E + tl.arange(0, E_P2), mask=routed, other=0.0)
        w = w.to(tl.float32)
    x_row = x_ptr + token.to(tl.int64) * stride_x
    if not ALL_COLS:
        cols = col_block * BLOCK_H + tl.arange(0, BLOCK_H)
        vals = tl.load(x_row + cols, mask=cols < H, other=0.0)
    for i in range(n):
        pick = routed & (position == i)
        row = tl.sum(tl.where(pick, dest, 0), axis=0).to(tl.int64)
        if HAS_W:
            weight = tl.sum(tl.where(pick, w, 0.0), axis=0)
            if col_block == 0:
                tl.store(rw_ptr + row, weight)
        else:
            weight = 1.0
        if ALL_COLS:
            for start in range(0, H, BLOCK_H):
                cols = start + tl.arange(0, BLOCK_H)
                vals = tl.load(x_row + cols, mask=cols < H, other=0.0)
                _store_route(out_ptr, row, stride_out, cols, cols < H, vals, weight, SCALE_ROWS)
        else:
            _store_route(out_ptr, row, stride_out, cols, cols < H, vals, weight, SCALE_ROWS)


@triton.jit
def _fill_gaps(
    start_ptr, count_ptr, out_ptr, rw_ptr, block, col_block, E, H, num_rows, stride_out,
    HAS_W: tl.constexpr, E_P2: tl.constexpr, BLOCK_H: tl.constexpr, CHECK_ROWS: tl.constexpr,
    ALL_COLS: tl.constexpr,
):  # fmt: skip
    """Zeros on the rows of one ``CHECK_ROWS`` block that no route names: padding, and rows past the last
    expert's."""
    experts = tl.arange(0, E_P2)
    rows = block * CHECK_ROWS + tl.arange(0, CHECK_ROWS)
    starts = tl.load(start_ptr + experts, mask=experts < E, other=0)
    ends = starts + tl.load(count_ptr + experts, mask=experts < E, other=0).to(tl.int32)
    inside = (rows[:, None] >= starts[None, :]) & (rows[:, None] < ends[None, :])
    empty = (rows < num_rows) & (tl.sum(inside.to(tl.int32), axis=1) == 0)
    if tl.sum(empty.to(tl.int32), axis=0) > 0:
        zeros = tl.zeros([CHECK_ROWS, BLOCK_H], dtype=out_ptr.dtype.element_ty)
        first = 0 if ALL_COLS else col_block * BLOCK_H
        last = H if ALL_COLS else first + BLOCK_H
        for start in range(first, last, BLOCK_H):
            cols = start + tl.arange(0, BLOCK_H)
            offsets = rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
            tl.store(out_ptr + offsets, zeros, mask=empty[:, None] & (cols < H)[None, :])
        if HAS_W:
            if col_block == 0:
                tl.store(rw_ptr + rows, tl.zeros([CHECK_ROWS], dtype=tl.float32), mask=empty)


@cached_launch
@triton.jit
def _scatter_rows_kernel(
    x_ptr, map_ptr, w_ptr, start_ptr, count_ptr, out_ptr, rw_ptr, T, E, H, num_rows, stride_x, stride_out,
    HAS_W: tl.constexpr, SCALE_ROWS: tl.constexpr, E_P2: tl.constexpr, BLOCK_H: tl.constexpr,
    CHECK_ROWS: tl.constexpr, ALL_COLS: tl.constexpr, TOKENS: tl.constexpr, GAPS: tl.constexpr,
):  # fmt: skip
    """Token programs (``TOKENS``) then gap programs (``GAPS``) along the first grid axis."""
    pid = tl.program_id(0)
    col_block = tl.program_id(1)
    if TOKENS and GAPS:
        if pid < T:
            _scatter_token(x_ptr, map_ptr, w_ptr, out_ptr, rw_ptr, pid, col_block, E, H, stride_x, stride_out,
                           HAS_W, SCALE_ROWS, E_P2, BLOCK_H, ALL_COLS)  # fmt: skip
        else:
            _fill_gaps(start_ptr, count_ptr, out_ptr, rw_ptr, pid - T, col_block, E, H, num_rows, stride_out,
                       HAS_W, E_P2, BLOCK_H, CHECK_ROWS, ALL_COLS)  # fmt: skip
    elif TOKENS:
        _scatter_token(x_ptr, map_ptr, w_ptr, out_ptr, rw_ptr, pid, col_block, E, H, stride_x, stride_out,
                       HAS_W, SCALE_ROWS, E_P2, BLOCK_H, ALL_COLS)  # fmt: skip
    else:
        _fill_gaps(start_ptr, count_ptr, out_ptr, rw_ptr, pid, col_block, E, H, num_rows, stride_out,
                   HAS_W, E_P2, BLOCK_H, CHECK_ROWS, ALL_COLS)  # fmt: skip


@cached_launch
@triton.jit
def _merge_rows_kernel(
    y_ptr,
    map_ptr,
    w_ptr,
    out_ptr,
    E,
    H,
    stride_y,
    stride_out,
    HAS_W: tl.constexpr,
    E_P2: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    dest, routed, position, n = _routes(map_ptr, token, E, E_P2)
    if HAS_W:
        w = tl.load(w_ptr + token.to(tl.int64) * E + tl.arange(0, E_P2), mask=routed, other=0.0).to(
            tl.float32
        )
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for i in range(n):
        pick = routed & (position == i)
        row = tl.sum(tl.where(pick, dest, 0), axis=0).to(tl.int64)
        vals = tl.load(y_ptr + row * stride_y + cols, mask=col_ok, other=0.0).to(tl.float32)
        if HAS_W:
            vals = vals * tl.sum(tl.where(pick, w, 0.0), axis=0)
        acc += vals
    tl.store(out_ptr + token.to(tl.int64) * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


@cached_launch
@triton.jit
def _route_dots_kernel(
    g_ptr, y_ptr, map_ptr, out_ptr, E, H, stride_g, stride_y, E_P2: tl.constexpr, BLOCK_H: tl.constexpr
):
    token = tl.program_id(0)
    dest, routed, position, n = _routes(map_ptr, token, E, E_P2)
    dots = tl.zeros([E_P2], dtype=tl.float32)
    for i in range(n):
        pick = routed & (position == i)
        row = tl.sum(tl.where(pick, dest, 0), axis=0).to(tl.int64)
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for start in range(0, H, BLOCK_H):
            cols = start + tl.arange(0, BLOCK_H)
            col_ok = cols < H
            g = tl.load(g_ptr + token.to(tl.int64) * stride_g + cols, mask=col_ok, other=0.0)
            y = tl.load(y_ptr + row * stride_y + cols, mask=col_ok, other=0.0)
            acc += g.to(tl.float32) * y.to(tl.float32)
        dots = tl.where(pick, tl.sum(acc, axis=0), dots)
    experts = tl.arange(0, E_P2)
    tl.store(out_ptr + token.to(tl.int64) * E + experts, dots, mask=experts < E)


def _block(hidden: int) -> int:
    return min(_BLOCK_H, triton.next_power_of_2(max(hidden, 16)))


def _experts_p2(experts: int) -> int:
    return triton.next_power_of_2(max(experts, 16))


def _bits(x: torch.Tensor) -> torch.Tensor:
    """FP8 rows move as bytes (a copy needs no arithmetic)."""
    return x.view(torch.uint8) if x.element_size() == 1 and x.is_floating_point() else x


def expert_layout_triton(
    routing_map: torch.Tensor, pad_multiple: int, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row_id_map int32 [T, E], kept tokens per expert int64 [E], int32 [E + 1] each expert's first row
    and the padded row total) for a bool ``routing_map`` [T, E]; ``num_rows > 0`` drops routes past that
    row."""
    tokens, experts = routing_map.shape
    device = routing_map.device
    blocks = triton.cdiv(tokens, _BLOCK_T)
    routed = routing_map.contiguous().view(torch.uint8)
    work = torch.empty(2 * blocks * experts, dtype=torch.int32, device=device)  # block counts, first rows
    counts, base = work[: blocks * experts], work[blocks * experts :]
    expert_rows = torch.empty(experts + 1, dtype=torch.int32, device=device)
    kept = torch.empty(experts, dtype=torch.int64, device=device)
    row_id_map = torch.empty((tokens, experts), dtype=torch.int32, device=device)
    cap = num_rows if num_rows > 0 else _NO_CAP
    grid = (blocks, triton.cdiv(experts, _BLOCK_E))
    if tokens:
        _block_counts_kernel[grid](routed, counts, tokens, experts, BLOCK_T=_BLOCK_T, BLOCK_E=_BLOCK_E)
    _expert_starts_kernel[(1,)](
        counts, base, expert_rows, kept, expert_rows[experts:], blocks, experts, max(pad_multiple, 1), cap,
        BLOCK_B=64, BLOCK_E=_BLOCK_E,
    )  # fmt: skip
    if tokens:
        _route_rows_kernel[grid](
            routed, base, row_id_map, tokens, experts, cap, BLOCK_T=_BLOCK_T, BLOCK_E=_BLOCK_E
        )
    return row_id_map, kept, expert_rows


def expert_bounds_triton(row_id_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first row int32 [E], route count int32 [E]) per expert of a ``row_id_map`` (first row is
    meaningless where the count is 0)."""
    tokens, experts = row_id_map.shape
    start = torch.full((experts,), _NO_CAP, dtype=torch.int32, device=row_id_map.device)
    count = torch.zeros(experts, dtype=torch.int32, device=row_id_map.device)
    if tokens:
        grid = (triton.cdiv(tokens, _BLOCK_T), triton.cdiv(experts, _BLOCK_E))
        _expert_bounds_kernel[grid](
            row_id_map, start, count, tokens, experts, BLOCK_T=_BLOCK_T, BLOCK_E=_BLOCK_E
        )
    return start, count


class ScatterLaunch(NamedTuple):
    """How ``scatter_rows_triton`` launches: hidden slice per program, warps, gap programs in their own
    launch (``split``) or after the token programs, one program per whole token row (``all_cols``)."""

    block_h: int
    warps: int
    split: bool
    all_cols: bool


def scatter_launch(hidden: int) -> ScatterLaunch:
    """The default launch for rows of ``hidden`` elements: one program per whole token row, which takes its
    routes from the map once and keeps a row's stores in flight (DeepSeek-V3, 4096 tokens, H200: 152 us
    against 225 us for one program per 1024-element slice; ``bench_moe_permute_configs.py``)."""
    return ScatterLaunch(min(2048, triton.next_power_of_2(max(hidden, 16))), 4, False, True)


def scatter_rows_triton(
    x: torch.Tensor,
    row_id_map: torch.Tensor,
    start: torch.Tensor,
    count: torch.Tensor,
    weights: torch.Tensor | None,
    num_rows: int,
    scale_rows: bool,
    launch: ScatterLaunch | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """([num_rows, H], fp32 route weight per row or [0]): each token row of ``x`` [T, H] (unit column
    stride) at its routes' rows, times ``weights`` [T, E] where ``scale_rows``; zeros on rows outside every
    expert's ``[start, start + count)``."""
    tokens, experts = row_id_map.shape
    hidden = x.shape[1]
    out = torch.empty((num_rows, hidden), dtype=x.dtype, device=x.device)
    row_weights = torch.empty(num_rows if weights is not None else 0, dtype=torch.float32, device=x.device)
    if not (num_rows and hidden):
        return out, row_weights
    launch = launch or scatter_launch(hidden)
    col_blocks = 1 if launch.all_cols else triton.cdiv(hidden, launch.block_h)
    gaps = triton.cdiv(num_rows, _CHECK_ROWS)
    args = (
        x if scale_rows else _bits(x), row_id_map, weights if weights is not None else row_id_map, start,
        count, out if scale_rows else _bits(out), row_weights, tokens, experts, hidden, num_rows,
        x.stride(0), out.stride(0),
    )  # fmt: skip
    flags = dict(
        HAS_W=weights is not None, SCALE_ROWS=scale_rows, E_P2=_experts_p2(experts), BLOCK_H=launch.block_h,
        CHECK_ROWS=_CHECK_ROWS, ALL_COLS=launch.all_cols, num_warps=launch.warps,
    )  # fmt: skip
    if launch.split:
        _scatter_rows_kernel[(gaps, col_blocks)](*args, TOKENS=False, GAPS=True, **flags)
        if tokens:
            _scatter_rows_kernel[(tokens, col_blocks)](*args, TOKENS=True, GAPS=False, **flags)
    else:
        _scatter_rows_kernel[(tokens + gaps, col_blocks)](*args, TOKENS=True, GAPS=True, **flags)
    return out, row_weights


def merge_rows_triton(
    y: torch.Tensor, row_id_map: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """[T, H] in y's dtype: per token, the (weighted) sum of the rows of ``y`` that ``row_id_map`` names."""
    tokens, experts = row_id_map.shape
    hidden = y.shape[1]
    out = torch.empty((tokens, hidden), dtype=y.dtype, device=y.device)
    if tokens and hidden:
        block = _block(hidden)
        _merge_rows_kernel[(tokens, triton.cdiv(hidden, block))](
            y, row_id_map, weights if weights is not None else y, out, experts, hidden,
            y.stride(0), out.stride(0), HAS_W=weights is not None, E_P2=_experts_p2(experts), BLOCK_H=block,
        )  # fmt: skip
    return out


def route_dots_triton(g: torch.Tensor, y: torch.Tensor, row_id_map: torch.Tensor) -> torch.Tensor:
    """fp32 [T, E]: ``<g[t], y[row_id_map[t, e]]>`` where routed, 0 elsewhere."""
    tokens, experts = row_id_map.shape
    out = torch.empty((tokens, experts), dtype=torch.float32, device=g.device)
    if tokens:
        _route_dots_kernel[(tokens,)](
            g, y, row_id_map, out, experts, g.shape[1], g.stride(0), y.stride(0),
            E_P2=_experts_p2(experts), BLOCK_H=_block(g.shape[1]),
        )  # fmt: skip
    return out
