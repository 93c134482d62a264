"""FP8 quantization of a grouped GEMM's weight-gradient operands, written token-major.

The variable-K (wgrad) GEMM reduces over each group's tokens, and Hopper's FP8 tensor cores read both
operands with the reduction dimension contiguous, so the quantized copy of ``x`` [T, C] is stored as
[C, T] (returned as its [T, C] transposed view; rows padded to 16 bytes). Scales follow
``quantize_fp8``'s rules (``_group_scale``): zeros give 1, a group holding NaN or inf gets a NaN
scale, casts saturate.

- ``quantize_fp8_group_columns_triton``: one scale per (group, column) over the group's tokens (the
  row-wise recipe). One program per (group, column block) reads the group's rows twice: amax, then cast.
- ``group_block_layout_triton``: where each group's scale blocks start and end, in one program (the
  same arithmetic in PyTorch is nine small kernels).
- ``quantize_fp8_group_blocks_triton``: one scale per (block, column) (the block recipe), the blocks
  being the stretches of B tokens aligned to multiples of B that a group's tokens touch. One program per
  (scale row, column block) reads its block once.

Both walk the tokens in tiles aligned in the token dimension, and only a group's partial first and last
tiles mask rows: whole tiles store 16-byte pieces of the token-major copy, which a mask varying along
the tokens would break into single bytes (the wgrad kernel reads it the same way).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from primus_turbo.triton.quantization.fp8_quant_kernel import _group_scale, _saturate
from primus_turbo.triton.utils.device_info import fp8_cast_saturates
from primus_turbo.triton.utils.launch import cached_launch

__all__ = [
    "group_block_layout_triton",
    "quantize_fp8_group_blocks_triton",
    "quantize_fp8_group_columns_triton",
    "token_major_empty",
]

# Launches measured fastest on an H200 (bench_group_quant_configs.py, 2026-12-01, every candidate at the
# DeepSeek-V3 and Qwen3-30B-A3B shapes): narrow column blocks give more programs, hence more loads in
# flight, than the 128-column, 8-warp launch they replace (group columns 2.0x-2.2x, group blocks
# 1.7x-2.0x faster).
_COLUMN_LAUNCH = (32, 128, 4)  # (columns per program, rows per step of the walk over a group, warps)
_BLOCK_LAUNCH = (32, 4)  # (columns per program, warps)


@triton.jit
def _tile_amax(x, mask):
    """Column amax of a tile ignoring NaN/inf, and the count of NaN/inf per column."""
    mag = tl.abs(x)
    nonfinite = ((mag != mag) | (mag == float("inf"))) & mask
    amax = tl.max(tl.where(nonfinite | ~mask, 0.0, mag), axis=0)
    return amax, tl.sum(nonfinite.to(tl.int32), axis=0)


@triton.jit
def _load_rows(x_ptr, t0, start, end, cols, col_ok, stride_x, BLOCK_T: tl.constexpr):
    """``(rows, mask, x)``: rows t0 .. t0 + BLOCK_T of x's columns ``cols`` in fp32, those outside
    [start, end) (and the columns past C) read as 0."""
    rows = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
    mask = ((rows >= start) & (rows < end))[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return rows, mask, x


@triton.jit
def _store_token_major(q_ptr, q, rows, cols, col_ok, start, end, stride_q, PARTIAL: tl.constexpr):
    """Store the [rows, cols] tile ``q`` into the [C, T] memory (row stride ``stride_q``) of a token-major
    copy. Only a PARTIAL tile masks rows outside [start, end): a mask varying along the contiguous
    dimension breaks the stores into single bytes. Its rows are also clamped into [start, end), which
    changes nothing stored but keeps the compiler from merging a partial and a whole tile's stores
    into one (single-byte) store where a caller branches between the two."""
    if PARTIAL:
        in_group = (rows >= start) & (rows < end)
        rows = tl.minimum(tl.maximum(rows, start), end - 1)
        mask = in_group[:, None] & col_ok[None, :]
    else:
        mask = col_ok[None, :]
    ptrs = q_ptr + cols[None, :].to(tl.int64) * stride_q + rows[:, None]
    tl.store(ptrs, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _cast_rows(
    x_ptr,
    q_ptr,
    t0,
    start,
    end,
    cols,
    col_ok,
    multiplier,
    stride_q,
    stride_x,
    PARTIAL: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BLOCK_T: tl.constexpr,
    CAST_SATURATES: tl.constexpr,
):
    """Quantize rows t0 .. t0 + BLOCK_T (those in [start, end)) into the token-major copy."""
    rows, _, x = _load_rows(x_ptr, t0, start, end, cols, col_ok, stride_x, BLOCK_T)
    q = _saturate(x * multiplier[None, :], FP8_MAX, CAST_SATURATES)
    _store_token_major(q_ptr, q, rows, cols, col_ok, start, end, stride_q, PARTIAL)


@cached_launch
@triton.jit
def _group_columns_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    offs_ptr,
    stride_q,
    C,
    stride_x,
    FP8_MAX: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    CAST_SATURATES: tl.constexpr,
):
    g = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    start = tl.load(offs_ptr + g)
    end = tl.load(offs_ptr + g + 1)
    first = (start // BLOCK_T) * BLOCK_T
    amax = tl.zeros([BLOCK_C], dtype=tl.float32)
    bad = tl.zeros([BLOCK_C], dtype=tl.int32)
    for t0 in range(first, end, BLOCK_T):
        rows, mask, x = _load_rows(x_ptr, t0, start, end, cols, col_ok, stride_x, BLOCK_T)
        tile_amax, tile_bad = _tile_amax(x, mask)
        amax = tl.maximum(amax, tile_amax)
        bad += tile_bad
    multiplier, stored = _group_scale(amax, bad, FP8_MAX, False, 0)
    tl.store(scale_ptr + g.to(tl.int64) * C + cols, stored, mask=col_ok)
    # the cast: a partial first and last tile around whole ones
    lo = ((start + BLOCK_T - 1) // BLOCK_T) * BLOCK_T
    hi = (end // BLOCK_T) * BLOCK_T
    if end > start:
        if start < lo:  # the partial first tile (the only one when the group lies inside a tile)
            _cast_rows(
                x_ptr, q_ptr, lo - BLOCK_T, start, end, cols, col_ok, multiplier, stride_q, stride_x,
                True, FP8_MAX, BLOCK_T, CAST_SATURATES,
            )  # fmt: skip
        for t0 in range(lo, hi, BLOCK_T):
            _cast_rows(
                x_ptr, q_ptr, t0, start, end, cols, col_ok, multiplier, stride_q, stride_x,
                False, FP8_MAX, BLOCK_T, CAST_SATURATES,
            )  # fmt: skip
        if (hi < end) & (hi >= lo):  # the partial last tile, unless the first one was it
            _cast_rows(
                x_ptr, q_ptr, hi, start, end, cols, col_ok, multiplier, stride_q, stride_x,
                True, FP8_MAX, BLOCK_T, CAST_SATURATES,
            )  # fmt: skip


@cached_launch
@triton.jit
def _group_blocks_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    offs_ptr,
    block_ends_ptr,
    G,
    stride_q,
    C,
    stride_x,
    FP8_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_C: tl.constexpr,
    CAST_SATURATES: tl.constexpr,
):
    """Scale row r is block r - base(g) of group g, where base(g) is the number of blocks of the groups
    before it (``block_ends`` is their running total); rows past the last block hold 1."""
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    groups = tl.arange(0, BLOCK_G)
    ends = tl.load(block_ends_ptr + groups, mask=groups < G, other=2**62)
    g = tl.sum((ends <= r).to(tl.int32), axis=0)
    scale_row = scale_ptr + r.to(tl.int64) * C + cols
    if g < G:
        base = tl.load(block_ends_ptr + g - 1, mask=g > 0, other=0)
        start = tl.load(offs_ptr + g)
        end = tl.load(offs_ptr + g + 1)
        lo = (start // BLOCK + r - base) * BLOCK
        rows, mask, x = _load_rows(x_ptr, lo, start, end, cols, col_ok, stride_x, BLOCK)
        amax, bad = _tile_amax(x, mask)
        multiplier, stored = _group_scale(amax, bad, FP8_MAX, False, 0)
        tl.store(scale_row, stored, mask=col_ok)
        q = _saturate(x * multiplier[None, :], FP8_MAX, CAST_SATURATES)
        if (lo >= start) & (lo + BLOCK <= end):
            _store_token_major(q_ptr, q, rows, cols, col_ok, start, end, stride_q, False)
        else:
            _store_token_major(q_ptr, q, rows, cols, col_ok, start, end, stride_q, True)
    else:
        tl.store(scale_row, tl.full([BLOCK_C], 1.0, tl.float32), mask=col_ok)


def token_major_empty(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """An empty FP8 [T, C] like ``x`` whose memory is [C, T] with rows padded to 16 bytes (TMA
    describes only 16-byte aligned rows): the layout of both quantizations' q."""
    tokens, cols = x.shape
    padded = -(-tokens // 16) * 16
    return torch.empty((cols, padded), dtype=fp8_dtype, device=x.device)[:, :tokens].t()


def quantize_fp8_group_columns_triton(
    x: torch.Tensor,
    group_offs: torch.Tensor,
    fp8_dtype: torch.dtype,
    launch: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [T, C] token-major, scale_inv [G, C])`` of ``x`` [T, C] (unit column stride), one scale per
    (group, column) of the groups ``group_offs`` (int64 [G + 1], on the device) delimits. ``launch``
    overrides (columns per program, rows per step, warps) for tuning sweeps."""
    block_c, block_t, warps = launch or _COLUMN_LAUNCH
    tokens, cols = x.shape
    groups = group_offs.numel() - 1
    q = token_major_empty(x, fp8_dtype)
    scale = torch.empty((groups, cols), dtype=torch.float32, device=x.device)
    if groups == 0 or cols == 0:
        return q, scale
    _group_columns_kernel[(groups, triton.cdiv(cols, block_c))](
        x,
        q,
        scale,
        group_offs,
        q.stride(1),
        cols,
        x.stride(0),
        FP8_MAX=torch.finfo(fp8_dtype).max,
        BLOCK_T=block_t,
        BLOCK_C=block_c,
        CAST_SATURATES=fp8_cast_saturates(x.device, fp8_dtype),
        num_warps=warps,
    )
    return q, scale


def quantize_fp8_group_blocks_triton(
    x: torch.Tensor,
    group_offs: torch.Tensor,
    block_ends: torch.Tensor,
    fp8_dtype: torch.dtype,
    block: int,
    scale_rows: int,
    launch: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [T, C] token-major, scale_inv [scale_rows, C])`` of ``x`` [T, C] (unit column stride), one
    scale per (block, column): group g's blocks are the stretches of ``block`` tokens aligned to
    multiples of ``block`` that its tokens touch, ``block_ends`` (int64 [G]) the running total of the
    blocks per group. ``scale_rows`` bounds the blocks of any group sizes (``ceil(T / block) + G``); the
    rows past the last block hold 1. ``launch`` overrides (columns per program, warps) for tuning
    sweeps."""
    block_c, warps = launch or _BLOCK_LAUNCH
    tokens, cols = x.shape
    groups = group_offs.numel() - 1
    q = token_major_empty(x, fp8_dtype)
    scale = torch.empty((scale_rows, cols), dtype=torch.float32, device=x.device)
    if cols == 0 or scale_rows == 0:
        return q, scale
    _group_blocks_kernel[(scale_rows, triton.cdiv(cols, block_c))](
        x,
        q,
        scale,
        group_offs,
        block_ends,
        groups,
        q.stride(1),
        cols,
        x.stride(0),
        FP8_MAX=torch.finfo(fp8_dtype).max,
        BLOCK=block,
        BLOCK_G=triton.next_power_of_2(max(groups, 1)),
        BLOCK_C=block_c,
        CAST_SATURATES=fp8_cast_saturates(x.device, fp8_dtype),
        num_warps=warps,
    )
    return q, scale


@cached_launch
@triton.jit
def _group_block_layout_kernel(
    offs_ptr, ends_ptr, base_ptr, groups, BLOCK: tl.constexpr, BLOCK_G: tl.constexpr
):
    g = tl.arange(0, BLOCK_G)
    ok = g < groups
    start = tl.load(offs_ptr + g, mask=ok, other=0)
    end = tl.load(offs_ptr + g + 1, mask=ok, other=0)
    blocks = tl.where(end > start, (end + BLOCK - 1) // BLOCK - start // BLOCK, 0)
    ends = tl.cumsum(blocks, axis=0)
    tl.store(ends_ptr + g, ends, mask=ok)
    tl.store(base_ptr + g, ends - blocks, mask=ok)


def group_block_layout_triton(group_offs: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ends, base)`` int64 [G]: the running total of each group's scale blocks (the stretches of
    ``block`` tokens, aligned to multiples of ``block``, that its tokens touch; none for an empty group)
    and its first scale row, from the int64 offsets [G + 1]."""
    groups = group_offs.numel() - 1
    ends = torch.empty(groups, dtype=torch.int64, device=group_offs.device)
    base = torch.empty_like(ends)
    if groups > 0:
        block_g = max(triton.next_power_of_2(groups), 16)
        _group_block_layout_kernel[(1,)](group_offs, ends, base, groups, BLOCK=block, BLOCK_G=block_g)
    return ends, base
