"""The FP8 output stage of producers that fuse their quantization (``rmsnorm_fp8``, ``swiglu_fp8``).

A producer computes its output one TILE x TILE tile at a time, rounded to its output dtype, and hands
the tile to ``emit_fp8_tile``. The tile is stored quantized along the last dimension (``q``, M x K) and,
with DUAL, also along the first, transposed (``q_t``, K x M): the two copies ``gemm_fp8`` reads in its
forward and weight-gradient GEMMs, so no high-precision output is written at all. Scaling modes:

- EMIT_TENSOR: one scale from the tensor amax, collected by an earlier pass (``record_tile_amax``);
- EMIT_ROW: along K one scale per row, along M one per column, both amaxes from the earlier pass;
- EMIT_BLOCK: 1 x GROUP groups along K and GROUP x 1 groups along M, both inside the tile.

Amaxes travel as int32 bit patterns combined with atomic max: non-negative floats order like their
bits, and a NaN magnitude orders above +inf, so a tensor, row or column holding NaN or inf ends with a
non-finite amax and gets ``quantize_fp8``'s NaN scale. A maximum does not depend on the order the
atomics land in, so the result is deterministic. The scale rules are ``_group_scale``'s, so the copies
equal ``quantize_fp8_with_trans`` of the stored output bit for bit.
"""

from __future__ import annotations

import triton
import triton.language as tl

from primus_turbo.triton.quantization.fp8_quant_kernel import (
    _group_amax,
    _group_scale,
    _nan_max,
    _quantize_along,
    _saturate,
)

__all__ = [
    "EMIT_BLOCK",
    "EMIT_ROW",
    "EMIT_TENSOR",
    "amax_bits",
    "emit_fp8_tile",
    "emit_tile",
    "record_tile_amax",
]

EMIT_TENSOR, EMIT_ROW, EMIT_BLOCK = 0, 1, 2


@triton.jit
def amax_bits(mag, AXIS: tl.constexpr):
    """NaN-propagating maximum of non-negative ``mag`` along AXIS, as int32 bits for atomic max."""
    return tl.reduce(mag, AXIS, _nan_max).to(tl.int32, bitcast=True)


@triton.jit
def record_tile_amax(
    y, rows, cols, rows_ok, cols_ok, amax_ptr, row_amax_ptr, col_amax_ptr, MODE: tl.constexpr
):
    """Fold a tile's magnitudes (y is zero outside the tensor) into the tensor amax (EMIT_TENSOR) or the
    per-row and per-column amaxes (EMIT_ROW), int32 bits zero-initialised by the caller."""
    mag = tl.abs(y)
    if MODE == 0:
        tl.atomic_max(amax_ptr, amax_bits(tl.reduce(mag, 1, _nan_max), 0))
    else:
        tl.atomic_max(row_amax_ptr + rows, amax_bits(mag, 1), mask=rows_ok)
        tl.atomic_max(col_amax_ptr + cols, amax_bits(mag, 0), mask=cols_ok)


@triton.jit
def _amax_from_bits(bits):
    """(amax, 1 where it is NaN or inf) of an amax kept as int32 bits."""
    amax = bits.to(tl.float32, bitcast=True)
    bad = ((amax != amax) | (amax == float("inf"))).to(tl.int32)
    return amax, bad


@triton.jit
def emit_fp8_tile(
    y,
    pid_m,
    pid_k,
    M,
    K,
    q_ptr,
    s_ptr,
    qt_ptr,
    st_ptr,
    amax_ptr,
    row_amax_ptr,
    col_amax_ptr,
    stride_sm,
    stride_sk,
    stride_stk,
    stride_stm,
    MODE: tl.constexpr,
    DUAL: tl.constexpr,
    FP8_MAX: tl.constexpr,
    GROUP: tl.constexpr,
    N_GROUPS: tl.constexpr,
    TILE: tl.constexpr,
    CAST_SATURATES: tl.constexpr,
):
    """Store tile (pid_m, pid_k) of the fp32 output ``y`` (TILE x TILE, zero outside M x K) quantized
    along K into ``q`` (contiguous M x K) with scales ``s``, and with DUAL along M into ``q_t``
    (contiguous K x M) with scales ``st``. Row and tensor scales are stored by the programs of the
    first tile column (row) only."""
    r = tl.arange(0, TILE)
    rows = pid_m.to(tl.int64) * TILE + r
    cols = pid_k.to(tl.int64) * TILE + r
    rows_ok = rows < M
    cols_ok = cols < K
    if MODE == 2:
        mag = tl.abs(y)
        q = _quantize_along(
            y,
            _group_amax(mag, 1, N_GROUPS, GROUP, TILE),
            rows,
            rows_ok,
            pid_k,
            K,
            s_ptr,
            stride_sm,
            stride_sk,
            1,
            FP8_MAX,
            False,
            0,
            GROUP,
            N_GROUPS,
            TILE,
            CAST_SATURATES,
        )
        q_t = q
        if DUAL:
            q_t = _quantize_along(
                y,
                _group_amax(mag, 0, N_GROUPS, GROUP, TILE),
                cols,
                cols_ok,
                pid_m,
                M,
                st_ptr,
                stride_stk,
                stride_stm,
                0,
                FP8_MAX,
                False,
                0,
                GROUP,
                N_GROUPS,
                TILE,
                CAST_SATURATES,
            )
    elif MODE == 1:
        amax, bad = _amax_from_bits(tl.load(row_amax_ptr + rows, mask=rows_ok, other=0))
        multiplier, stored = _group_scale(amax, bad, FP8_MAX, False, 0)
        q = _saturate(y * multiplier[:, None], FP8_MAX, CAST_SATURATES)
        if pid_k == 0:
            tl.store(s_ptr + rows * stride_sm, stored, mask=rows_ok)
        q_t = q
        if DUAL:
            amax_t, bad_t = _amax_from_bits(tl.load(col_amax_ptr + cols, mask=cols_ok, other=0))
            multiplier_t, stored_t = _group_scale(amax_t, bad_t, FP8_MAX, False, 0)
            q_t = _saturate(y * multiplier_t[None, :], FP8_MAX, CAST_SATURATES)
            if pid_m == 0:
                tl.store(st_ptr + cols * stride_stk, stored_t, mask=cols_ok)
    else:
        amax, bad = _amax_from_bits(tl.load(amax_ptr))
        multiplier, stored = _group_scale(amax, bad, FP8_MAX, False, 0)
        q = _saturate(y * multiplier, FP8_MAX, CAST_SATURATES)
        q_t = q
        if (pid_m == 0) & (pid_k == 0):
            tl.store(s_ptr, stored)
            if DUAL:
                tl.store(st_ptr, stored)
    # 32-bit offsets from the tile's corner keep the address math small
    mask = rows_ok[:, None] & cols_ok[None, :]
    q_tile = q_ptr + pid_m.to(tl.int64) * TILE * K + pid_k * TILE
    tl.store(q_tile + r[:, None] * K + r[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    if DUAL:
        qt_tile = qt_ptr + pid_k.to(tl.int64) * TILE * M + pid_m * TILE
        tl.store(
            qt_tile + r[:, None] * M + r[None, :],
            tl.trans(q_t).to(qt_ptr.dtype.element_ty),
            mask=tl.trans(mask),
        )


def emit_tile(group: int) -> int:
    """The square tile ``emit_fp8_tile`` works on: a whole block along both dimensions, at least 64."""
    return max(group, 64) if group else 128
