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
    "emit_grid",
    "emit_launch",
    "emit_tile",
    "record_tile_amax",
    "scale_strides",
]

EMIT_TENSOR, EMIT_ROW, EMIT_BLOCK = 0, 1, 2
# On H200 (CUDA graphs, SwiGLU 16384 x 2048 and 4096 x 3584, RMSNorm 16384 x 7168 and 4096 x 4096),
# 64 x 64 tiles beat 128 x 128 ones by 10-45% with tensor and row scales, both copies written; 128 x 128
# tiles (the 1 x 128 blocks) run best at 8 warps, 64 x 64 at 4-8.
_FREE_TILE = 64
_WARPS_PER_TILE = {64: 4, 128: 8}


@triton.jit
def amax_bits(mag, AXIS: tl.constexpr):
    """NaN-propagating maximum of non-negative ``mag`` along AXIS, as int32 bits for atomic max."""
    return tl.reduce(mag, AXIS, _nan_max).to(tl.int32, bitcast=True)


@triton.jit
def emit_tile(H, TILE: tl.constexpr, REVERSE: tl.constexpr):
    """(pid_m, pid_k) of this program in a 1-D grid (``emit_grid``) over the TILE x TILE tiles in row-major
    order. A second pass over the same input sets REVERSE and starts on the rows the first pass read
    last: on H200 (60 MB of L2) a 4096-token input is still largely in L2 then."""
    tiles_k = tl.cdiv(H, TILE)
    pid = tl.program_id(0)
    if REVERSE:
        pid = tl.num_programs(0) - 1 - pid
    return pid // tiles_k, pid % tiles_k


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
def _scale_from_bits(bits, FP8_MAX: tl.constexpr):
    """(multiplier, stored scale_inv) of an amax kept as int32 bits (NaN or inf: a NaN scale)."""
    amax = bits.to(tl.float32, bitcast=True)
    bad = ((amax != amax) | (amax == float("inf"))).to(tl.int32)
    return _group_scale(amax, bad, FP8_MAX, False, 0)


@triton.jit
def emit_fp8_tile(
    out,
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
    """Store tile (pid_m, pid_k) of the output ``out`` (TILE x TILE in its stored dtype, zero outside
    M x K) quantized along K into ``q`` (contiguous M x K) with scales ``s``, and with DUAL along M into
    ``q_t`` (contiguous K x M) with scales ``st``. Row and tensor scales are stored by the programs of
    the first tile column (row) only. Each copy is cast to FP8 before it is transposed, so the
    transpose moves one byte per element through shared memory."""
    y = out.to(tl.float32)
    r = tl.arange(0, TILE)
    rows = pid_m.to(tl.int64) * TILE + r
    cols = pid_k.to(tl.int64) * TILE + r
    rows_ok = rows < M
    cols_ok = cols < K
    # the forward copy is stored before the other one is computed, so both never occupy registers
    if MODE == 2:
        mag = tl.abs(y)
        amax_t = _group_amax(mag, 0, N_GROUPS, GROUP, TILE)
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
    elif MODE == 1:
        multiplier, stored = _scale_from_bits(tl.load(row_amax_ptr + rows, mask=rows_ok, other=0), FP8_MAX)
        q = _saturate(y * multiplier[:, None], FP8_MAX, CAST_SATURATES)
        if pid_k == 0:
            tl.store(s_ptr + rows * stride_sm, stored, mask=rows_ok)
    else:
        multiplier, stored = _scale_from_bits(tl.load(amax_ptr), FP8_MAX)
        q = _saturate(y * multiplier, FP8_MAX, CAST_SATURATES)
        if (pid_m == 0) & (pid_k == 0):
            tl.store(s_ptr, stored)
            if DUAL:
                tl.store(st_ptr, stored)
    # 32-bit offsets from the tile's corner keep the address math small
    mask = rows_ok[:, None] & cols_ok[None, :]
    q_tile = q_ptr + pid_m.to(tl.int64) * TILE * K + pid_k * TILE
    tl.store(q_tile + r[:, None] * K + r[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    if DUAL:
        if MODE == 2:
            q_t = _quantize_along(
                y,
                amax_t,
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
            col_amax = tl.load(col_amax_ptr + cols, mask=cols_ok, other=0)
            multiplier_t, stored_t = _scale_from_bits(col_amax, FP8_MAX)
            q_t = _saturate(y * multiplier_t[None, :], FP8_MAX, CAST_SATURATES)
            if pid_m == 0:
                tl.store(st_ptr + cols * stride_stk, stored_t, mask=cols_ok)
        else:
            # computed again from a second load of the amax rather than transposing q: with fp32
            # outputs, one value feeding both a direct and a transposed FP8 store (or the transposed
            # output itself) came out wrong in the transposed copy (Triton 3.6, sm_90)
            multiplier_t, _ = _scale_from_bits(tl.load(amax_ptr), FP8_MAX)
            q_t = _saturate(y * multiplier_t, FP8_MAX, CAST_SATURATES)
        qt_tile = qt_ptr + pid_k.to(tl.int64) * TILE * M + pid_m * TILE
        q_t_rows = tl.trans(q_t.to(qt_ptr.dtype.element_ty))
        tl.store(qt_tile + r[:, None] * M + r[None, :], q_t_rows, mask=tl.trans(mask))


def scale_strides(scale) -> tuple[int, int]:
    """(per-row, per-group) strides of a scale tensor: () tensorwise, (rows, 1) or (rows, groups)."""
    strides = tuple(scale.stride()) + (0, 0)
    return strides[0], strides[1]


def emit_grid(rows: int, hidden: int, tile: int) -> tuple[int]:
    """The 1-D grid of a kernel that places its programs with ``emit_tile``."""
    return (triton.cdiv(rows, tile) * triton.cdiv(hidden, tile),)


def emit_launch(group: int) -> tuple[int, int]:
    """(TILE, warps) of a kernel around ``emit_fp8_tile``: a whole 1 x ``group`` block along both
    dimensions (at least 64), ``_FREE_TILE`` for tensor and row scales (``group`` 0)."""
    tile = max(group, 64) if group else _FREE_TILE
    return tile, _WARPS_PER_TILE.get(tile, 8)
