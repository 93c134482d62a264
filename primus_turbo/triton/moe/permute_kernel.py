"""Row movement for MoE token permutation, in three kernels over a [T, E] map of destination rows.

- ``gather_rows``: ``out[r] = x[src[r]]`` (times ``row_scale[r]``), zeros where ``src[r] < 0`` (padding):
  permute, and the backward of unpermute.
- ``merge_rows``: ``out[t] = sum_e w[t, e] * y[map[t, e]]`` over the routed experts (``map >= 0``): unpermute,
  and the backward of permute (``w`` = 1).
- ``route_dots``: ``d[t, e] = <g[t], y[map[t, e]]>`` for routed pairs, else 0: the gradient of the merge
  weights.
Each program owns one row (or token) and a ``BLOCK_H`` slice of the hidden dimension; sums run in fp32 in
expert order, so results are deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["gather_rows_triton", "merge_rows_triton", "route_dots_triton"]

_BLOCK_H = 1024


@triton.jit
def _gather_rows_kernel(
    x_ptr,
    src_ptr,
    scale_ptr,
    out_ptr,
    H,
    stride_x,
    stride_out,
    HAS_SCALE: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    src = tl.load(src_ptr + row)
    # a vector mask: the interpreter rejects a scalar condition broadcast into one
    valid = col_ok & ((cols * 0 + src) >= 0)
    vals = tl.load(x_ptr + src.to(tl.int64) * stride_x + cols, mask=valid, other=0.0)
    if HAS_SCALE:
        vals = (vals.to(tl.float32) * tl.load(scale_ptr + row)).to(vals.dtype)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + cols, vals, mask=col_ok)


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
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for e in range(E):
        dest = tl.load(map_ptr + token.to(tl.int64) * E + e)
        if dest >= 0:
            row = tl.load(y_ptr + dest.to(tl.int64) * stride_y + cols, mask=col_ok, other=0.0).to(tl.float32)
            if HAS_WEIGHTS:
                row = row * tl.load(w_ptr + token.to(tl.int64) * E + e).to(tl.float32)
            acc += row
    tl.store(out_ptr + token.to(tl.int64) * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _route_dots_kernel(g_ptr, y_ptr, map_ptr, out_ptr, E, H, stride_g, stride_y, BLOCK_H: tl.constexpr):
    token = tl.program_id(0)
    for e in range(E):
        dest = tl.load(map_ptr + token.to(tl.int64) * E + e)
        if dest >= 0:
            acc = tl.zeros([BLOCK_H], dtype=tl.float32)
            for start in range(0, H, BLOCK_H):
                cols = start + tl.arange(0, BLOCK_H)
                col_ok = cols < H
                g = tl.load(g_ptr + token.to(tl.int64) * stride_g + cols, mask=col_ok, other=0.0)
                y = tl.load(y_ptr + dest.to(tl.int64) * stride_y + cols, mask=col_ok, other=0.0)
                acc += g.to(tl.float32) * y.to(tl.float32)
            tl.store(out_ptr + token.to(tl.int64) * E + e, tl.sum(acc, axis=0))
        else:
            tl.store(out_ptr + token.to(tl.int64) * E + e, 0.0)


def _block(hidden: int) -> int:
    return min(_BLOCK_H, triton.next_power_of_2(max(hidden, 16)))


def gather_rows_triton(
    x: torch.Tensor, src: torch.Tensor, row_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """[len(src), H]: rows of ``x`` [T, H] (unit column stride) by ``src`` (int, -1 = zeros)."""
    rows, hidden = src.shape[0], x.shape[1]
    out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    if rows and hidden:
        block = _block(hidden)
        _gather_rows_kernel[(rows, triton.cdiv(hidden, block))](
            x, src, row_scale if row_scale is not None else src, out, hidden, x.stride(0), out.stride(0),
            HAS_SCALE=row_scale is not None, BLOCK_H=block,
        )  # fmt: skip
    return out


def merge_rows_triton(
    y: torch.Tensor, row_map: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """[T, H] in y's dtype: per token the (weighted) sum of the rows of ``y`` its ``row_map`` [T, E] names."""
    tokens, experts = row_map.shape
    hidden = y.shape[1]
    out = torch.empty((tokens, hidden), dtype=y.dtype, device=y.device)
    if tokens and hidden:
        block = _block(hidden)
        _merge_rows_kernel[(tokens, triton.cdiv(hidden, block))](
            y, row_map, weights if weights is not None else y, out, experts, hidden,
            y.stride(0), out.stride(0), HAS_WEIGHTS=weights is not None, BLOCK_H=block,
        )  # fmt: skip
    return out


def route_dots_triton(g: torch.Tensor, y: torch.Tensor, row_map: torch.Tensor) -> torch.Tensor:
    """fp32 [T, E]: ``<g[t], y[row_map[t, e]]>`` where routed, 0 elsewhere."""
    tokens, experts = row_map.shape
    out = torch.empty((tokens, experts), dtype=torch.float32, device=g.device)
    if tokens:
        _route_dots_kernel[(tokens,)](
            g, y, row_map, out, experts, g.shape[1], g.stride(0), y.stride(0), BLOCK_H=_block(g.shape[1])
        )
    return out
