"""RMSNorm over the last dimension in Triton, fp32 math, optionally fused with a residual add.

Forward: ``s = x (+ residual)``, ``rstd = 1 / sqrt(mean(s^2) + eps)``, ``y = s * rstd * w`` with
``w = gamma`` (or ``1 + gamma`` when zero-centred). Backward: ``dx = rstd * (w * dy - s_hat *
mean(s_hat * w * dy))`` with ``s_hat = s * rstd``, and ``dgamma = sum over rows of dy * s_hat``, which
each program accumulates for its rows and writes once, so the final sum over programs is a fixed-order
(deterministic) reduction.

A program handles ``ROWS`` rows of ``BLOCK_H >= H`` columns (masked), so any hidden size, power of two
or not, is a single pass over memory; rows may be strided.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from primus_turbo.triton.quantization.fp8_emit import (
    EMIT_BLOCK,
    EMIT_ROW,
    EMIT_TENSOR,
    amax_bits,
    emit_fp8_tile,
    emit_grid,
    emit_launch,
    emit_tile,
    scale_strides,
)
from primus_turbo.triton.quantization.fp8_quant_kernel import _group_scale, _nan_max, _saturate
from primus_turbo.triton.utils.device_info import fp8_cast_saturates, max_shared_memory, num_sms
from primus_turbo.triton.utils.launch import cached_launch

__all__ = ["rmsnorm_bwd_triton", "rmsnorm_fp8_triton", "rmsnorm_fwd_triton", "rmsnorm_rstd_triton"]

_ELEMENTS_PER_PROGRAM = 8192
# The backward's programs (one per SM) walk row blocks of about 8K elements and stream the next blocks'
# dy and s through shared memory while one computes: on H200 (CUDA graphs, 4096-16384 tokens, hidden
# 4096-8192) 0.81-0.97 of a copy of the same size, against 0.54-0.78 unpipelined; dgamma partials stay
# small.
_BWD_ELEMENTS_PER_BLOCK = 8192
_BWD_PROGRAMS_PER_SM = 1
_BWD_STAGES = 3
_BWD_SMEM_RESERVE = 16 * 1024  # the row reductions' scratch
_FINISH_ELEMENTS = 16384  # partials each program of the dgamma sum loads at once
# The FP8 producer's first pass reads x once, pipelined like the backward; the second runs tiles. Two
# programs per SM ran the first pass 10-15% faster on H200, except with column amaxes: their atomics
# then double, and at 4096 tokens one program per SM was 20% faster.
_STATS_PROGRAMS_PER_SM = {EMIT_TENSOR: 2, EMIT_ROW: 1, EMIT_BLOCK: 2}


def _pipeline_stages(device: torch.device, block_bytes: int) -> int:
    """Stages of a row-block pipeline: up to _BWD_STAGES, as many blocks of ``block_bytes`` as shared
    memory holds besides the reductions' scratch, plus the one being computed."""
    buffers = min(_BWD_STAGES - 1, (max_shared_memory(device) - _BWD_SMEM_RESERVE) // block_bytes)
    return 1 + max(0, buffers)


def _launch_shape(rows: int, hidden: int) -> tuple[int, int, int]:
    """(BLOCK_H, ROWS per program, warps): about 8K elements per program."""
    block_h = triton.next_power_of_2(hidden)
    rows_per_program = max(1, min(16, _ELEMENTS_PER_PROGRAM // block_h))
    warps = max(4, min(16, block_h * rows_per_program // 1024))
    return block_h, rows_per_program, warps


@cached_launch
@triton.jit
def _rmsnorm_fwd_kernel(
    x_ptr,
    r_ptr,
    gamma_ptr,
    y_ptr,
    s_ptr,
    rstd_ptr,
    q_ptr,
    qs_ptr,
    n_rows,
    H,
    stride_x,
    stride_r,
    stride_y,
    stride_s,
    stride_qs_row,
    stride_qs_group,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    WRITE_Y: tl.constexpr,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    CAST_SATURATES: tl.constexpr,
    GROUP: tl.constexpr,
    N_GROUPS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """QUANT: 0 none; 1 FP8 per row; 2 FP8 per 1 x GROUP block. Quantization reads y as stored (rounded
    to y's dtype), so it equals quantizing the unfused output bit for bit; WRITE_Y False stores only
    the FP8 copy."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < H)[None, :]
    s = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        s += tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(s_ptr + rows[:, None] * stride_s + cols[None, :], s.to(s_ptr.dtype.element_ty), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=1) / H + eps)
    w = tl.load(gamma_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w += 1.0
    y = (s * rstd[:, None] * w[None, :]).to(x_ptr.dtype.element_ty)
    if WRITE_Y:
        tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y, mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)
    if QUANT != 0:
        yq = tl.where(mask, y.to(tl.float32), 0.0)
        mag = tl.abs(yq)
        nonfinite = (mag != mag) | (mag == float("inf"))
        mag = tl.where(nonfinite, 0.0, mag)
        q_ptrs = q_ptr + rows[:, None] * H + cols[None, :]
        if QUANT == 1:
            bad = tl.sum(nonfinite.to(tl.int32), axis=1)
            multiplier, stored = _group_scale(tl.max(mag, axis=1), bad, FP8_MAX, False, 0)
            q = _saturate(yq * multiplier[:, None], FP8_MAX, CAST_SATURATES)
            tl.store(q_ptrs, q.to(q_ptr.dtype.element_ty), mask=mask)
            tl.store(qs_ptr + rows * stride_qs_row, stored, mask=row_ok)
        else:
            amax = tl.max(tl.reshape(mag, (ROWS, N_GROUPS, GROUP)), axis=2)
            bad = tl.sum(tl.reshape(nonfinite.to(tl.int32), (ROWS, N_GROUPS, GROUP)), axis=2)
            multiplier, stored = _group_scale(amax, bad, FP8_MAX, False, 0)
            scaled = tl.reshape(
                tl.reshape(yq, (ROWS, N_GROUPS, GROUP)) * multiplier[:, :, None], (ROWS, BLOCK_H)
            )
            tl.store(q_ptrs, _saturate(scaled, FP8_MAX, CAST_SATURATES).to(q_ptr.dtype.element_ty), mask=mask)
            groups = tl.arange(0, N_GROUPS)
            n_scales = tl.cdiv(H, GROUP)
            s_mask = row_ok[:, None] & (groups < n_scales)[None, :]
            s_offs = rows[:, None] * stride_qs_row + groups[None, :] * stride_qs_group
            tl.store(qs_ptr + s_offs, stored, mask=s_mask)


@cached_launch
@triton.jit
def _rmsnorm_bwd_kernel(
    dy_ptr,
    s_ptr,
    ds_ptr,
    gamma_ptr,
    rstd_ptr,
    dx_ptr,
    dgamma_partial_ptr,
    n_rows,
    H,
    stride_dy,
    stride_s,
    stride_ds,
    stride_dx,
    HAS_DS: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Each program walks row blocks pid, pid + programs, ... and writes one dgamma partial. With
    NUM_STAGES > 1 the next row blocks' dy and s stream into shared memory while this one computes.
    HAS_DS adds the gradient arriving at s (the residual sum) to dx in fp32, in the same pass."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < H
    w = tl.load(gamma_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w += 1.0
    dgamma = tl.zeros([BLOCK_H], dtype=tl.float32)
    for first in tl.range(pid * ROWS, n_rows, programs * ROWS, num_stages=NUM_STAGES):
        rows = (first + tl.arange(0, ROWS)).to(tl.int64)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + rows[:, None] * stride_s + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        s_hat = s * rstd[:, None]
        wdy = w[None, :] * dy
        mean = tl.sum(s_hat * wdy, axis=1) / H
        dx = rstd[:, None] * (wdy - s_hat * mean[:, None])
        if HAS_DS:
            dx += tl.load(ds_ptr + rows[:, None] * stride_ds + cols[None, :], mask=mask, other=0.0).to(
                tl.float32
            )
        tl.store(
            dx_ptr + rows[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask
        )
        dgamma += tl.sum(dy * s_hat, axis=0)
    tl.store(dgamma_partial_ptr + pid * BLOCK_H + cols, dgamma, mask=col_ok)


@cached_launch
@triton.jit
def _dgamma_finish_kernel(
    partial_ptr, dgamma_ptr, programs, H, stride, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr
):
    """dgamma = the sum of the backward's per-program partials (one load of all of them per column block,
    a fixed reduction order), written in gamma's dtype: one small kernel instead of a sum and a cast."""
    cols = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    rows = tl.arange(0, BLOCK_P)
    mask = (rows < programs)[:, None] & (cols < H)[None, :]
    partial = tl.load(partial_ptr + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0)
    tl.store(dgamma_ptr + cols, tl.sum(partial, axis=0).to(dgamma_ptr.dtype.element_ty), mask=cols < H)


@cached_launch
@triton.jit
def _rmsnorm_stats_kernel(
    x_ptr,
    gamma_ptr,
    rstd_ptr,
    amax_ptr,
    row_amax_ptr,
    col_amax_ptr,
    n_rows,
    H,
    stride_x,
    eps,
    ZERO_CENTERED: tl.constexpr,
    MODE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """First pass of the FP8 producer: each program walks row blocks pid, pid + programs, ... and stores
    rstd (the forward kernel's sums, same layout, so the same bits), and for the scales the output
    needs (MODE as ``emit_fp8_tile``: 0 tensor, 1 row, 2 block), the amax of y as stored: per row
    (written directly), per column and per tensor (kept in registers, one atomic per program at the
    end)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < H
    w = tl.load(gamma_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w += 1.0
    col_max = tl.zeros([BLOCK_H], dtype=tl.float32)
    row_max = tl.zeros([ROWS], dtype=tl.float32)
    for first in tl.range(pid * ROWS, n_rows, programs * ROWS, num_stages=NUM_STAGES):
        rows = (first + tl.arange(0, ROWS)).to(tl.int64)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        s = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=1) / H + eps)
        tl.store(rstd_ptr + rows, rstd, mask=row_ok)
        if MODE != 2:
            mag = tl.abs((s * rstd[:, None] * w[None, :]).to(x_ptr.dtype.element_ty).to(tl.float32))
            if MODE == 1:
                tl.store(row_amax_ptr + rows, amax_bits(mag, 1), mask=row_ok)
                col_max = _nan_max(col_max, tl.reduce(mag, 0, _nan_max))
            else:
                row_max = _nan_max(row_max, tl.reduce(mag, 1, _nan_max))
    if MODE == 1:
        tl.atomic_max(col_amax_ptr + cols, col_max.to(tl.int32, bitcast=True), mask=col_ok)
    elif MODE == 0:
        tl.atomic_max(amax_ptr, amax_bits(row_max, 0))


@cached_launch
@triton.jit
def _rmsnorm_emit_kernel(
    x_ptr,
    gamma_ptr,
    rstd_ptr,
    q_ptr,
    qs_ptr,
    qt_ptr,
    qts_ptr,
    amax_ptr,
    row_amax_ptr,
    col_amax_ptr,
    n_rows,
    H,
    stride_x,
    stride_qs_row,
    stride_qs_group,
    stride_qts_row,
    stride_qts_group,
    ZERO_CENTERED: tl.constexpr,
    MODE: tl.constexpr,
    DUAL: tl.constexpr,
    FP8_MAX: tl.constexpr,
    GROUP: tl.constexpr,
    N_GROUPS: tl.constexpr,
    TILE: tl.constexpr,
    CAST_SATURATES: tl.constexpr,
):
    """Second pass: one TILE x TILE tile of y from x and the stored rstd, quantized by ``emit_fp8_tile``,
    last rows first (the stats pass ends on them). Addresses are 32-bit offsets from the tile's corner."""
    pid_m, pid_k = emit_tile(H, TILE, True)
    r = tl.arange(0, TILE)
    rows = pid_m.to(tl.int64) * TILE + r
    cols = pid_k * TILE + r
    row_ok = rows < n_rows
    col_ok = cols < H
    mask = row_ok[:, None] & col_ok[None, :]
    x_tile = x_ptr + pid_m.to(tl.int64) * TILE * stride_x + pid_k * TILE
    s = tl.load(x_tile + r[:, None] * stride_x + r[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
    w = tl.load(gamma_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w += 1.0
    y = (s * rstd[:, None] * w[None, :]).to(x_ptr.dtype.element_ty)
    emit_fp8_tile(
        y,
        pid_m,
        pid_k,
        n_rows,
        H,
        q_ptr,
        qs_ptr,
        qt_ptr,
        qts_ptr,
        amax_ptr,
        row_amax_ptr,
        col_amax_ptr,
        stride_qs_row,
        stride_qs_group,
        stride_qts_row,
        stride_qts_group,
        MODE,
        DUAL,
        FP8_MAX,
        GROUP,
        N_GROUPS,
        TILE,
        CAST_SATURATES,
    )


def rmsnorm_fwd_triton(
    x: torch.Tensor,
    gamma: torch.Tensor,
    eps: float,
    zero_centered: bool,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, s, rstd)`` for 2-D ``x`` (rows, H) with unit column stride; ``s = x + residual`` (``x``
    itself without a residual), ``rstd`` fp32 per row."""
    n_rows, hidden = x.shape
    y = torch.empty((n_rows, hidden), dtype=x.dtype, device=x.device)
    s = torch.empty_like(y) if residual is not None else x
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows == 0 or hidden == 0:
        return y, s, rstd
    _fwd_launch(x, gamma, eps, zero_centered, rstd, residual=residual, y=y, s=s)
    return y, s, rstd


def _fwd_launch(
    x, gamma, eps, zero_centered, rstd, *, residual=None, y=None, s=None, quant=0, q=None, scale=None, group=0
):
    """One launch of the forward kernel over whole rows: ``y`` (and ``s = x + residual``) when ``y`` is
    given; else only the FP8 copy ``q`` with ``scale``, per row (``quant`` 1) or per 1 x ``group`` block
    (``quant`` 2). rstd is stored either way."""
    n_rows, hidden = x.shape
    block_h, rows_per_program, warps = _launch_shape(n_rows, max(hidden, group if quant == 2 else 0))
    group = group if quant == 2 else block_h
    r = residual if residual is not None else x
    write_y = y is not None
    _rmsnorm_fwd_kernel[(triton.cdiv(n_rows, rows_per_program),)](
        x,
        r,
        gamma,
        y if write_y else x,
        s if write_y else x,
        rstd,
        q if quant else y,
        scale if quant else rstd,
        n_rows,
        hidden,
        x.stride(0),
        r.stride(0),
        y.stride(0) if write_y else 0,
        s.stride(0) if write_y else 0,
        *(scale_strides(scale) if quant else (0, 0)),
        eps,
        HAS_RESIDUAL=residual is not None,
        ZERO_CENTERED=zero_centered,
        WRITE_Y=write_y,
        QUANT=quant,
        FP8_MAX=torch.finfo(q.dtype).max if quant else 0.0,
        CAST_SATURATES=bool(quant) and fp8_cast_saturates(x.device, q.dtype),
        GROUP=group,
        N_GROUPS=max(1, block_h // group),
        ROWS=rows_per_program,
        BLOCK_H=block_h,
        num_warps=warps,
    )


def _stats_pass(x, gamma, eps, zero_centered, mode, rstd, amax, row_amax, col_amax) -> None:
    """The FP8 producer's first pass: rstd, and the amaxes ``mode`` needs (none for EMIT_BLOCK)."""
    n_rows, hidden = x.shape
    block_h, rows_per_program, warps = _launch_shape(n_rows, hidden)
    stages = _pipeline_stages(x.device, rows_per_program * block_h * x.element_size())
    programs = min(triton.cdiv(n_rows, rows_per_program), _STATS_PROGRAMS_PER_SM[mode] * num_sms(x.device))
    _rmsnorm_stats_kernel[(programs,)](
        x,
        gamma,
        rstd,
        amax,
        row_amax,
        col_amax,
        n_rows,
        hidden,
        x.stride(0),
        eps,
        ZERO_CENTERED=zero_centered,
        MODE=mode,
        ROWS=rows_per_program,
        BLOCK_H=block_h,
        NUM_STAGES=stages,
        num_warps=warps,
    )


def rmsnorm_rstd_triton(
    x: torch.Tensor, gamma: torch.Tensor, eps: float, zero_centered: bool
) -> torch.Tensor:
    """rstd (fp32 per row) of 2-D ``x`` from the same sums as the forward, so the same bits: the first pass of
    a producer whose tiles are quantized elsewhere."""
    n_rows = x.shape[0]
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows and x.shape[1]:
        none = torch.zeros(0, dtype=torch.int32, device=x.device)
        _stats_pass(x, gamma, eps, zero_centered, EMIT_BLOCK, rstd, none, none, none)
    return rstd


def rmsnorm_fp8_triton(
    x: torch.Tensor,
    gamma: torch.Tensor,
    eps: float,
    zero_centered: bool,
    mode: int,
    q: torch.Tensor,
    scale: torch.Tensor,
    q_t: torch.Tensor | None = None,
    scale_t: torch.Tensor | None = None,
    group: int = 0,
) -> torch.Tensor:
    """RMSNorm of 2-D ``x`` (rows, H) written only as FP8: ``q`` (rows, H) quantized along H and, when
    ``q_t`` is given, ``q_t`` (H, rows) quantized along the rows; ``mode`` is EMIT_TENSOR, EMIT_ROW or
    EMIT_BLOCK (1 x ``group``), the scale buffers laid out as ``quantize_fp8_with_trans`` returns them.
    Returns rstd (fp32 per row). Row and block scaling of ``q`` alone take one pass over ``x``; otherwise
    a first pass stores rstd and the amaxes, and a second, tiled, pass writes the copies."""
    n_rows, hidden = x.shape
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows == 0 or hidden == 0:
        return rstd
    if q_t is None and mode != EMIT_TENSOR:
        # row or 1 x group scaling of the forward copy alone: the forward kernel has whole rows, so it
        # quantizes in the same pass and writes no y
        quant = 1 if mode == EMIT_ROW else 2
        _fwd_launch(x, gamma, eps, zero_centered, rstd, quant=quant, q=q, scale=scale, group=group)
        return rstd
    amax = torch.zeros(1, dtype=torch.int32, device=x.device)
    row_amax = torch.empty(n_rows if mode == EMIT_ROW else 0, dtype=torch.int32, device=x.device)
    col_amax = torch.zeros(hidden if mode == EMIT_ROW else 0, dtype=torch.int32, device=x.device)
    _stats_pass(x, gamma, eps, zero_centered, mode, rstd, amax, row_amax, col_amax)
    tile, emit_warps = emit_launch(group if mode == EMIT_BLOCK else 0)
    dual = q_t is not None
    _rmsnorm_emit_kernel[emit_grid(n_rows, hidden, tile)](
        x,
        gamma,
        rstd,
        q,
        scale,
        q_t if dual else q,
        scale_t if dual else scale,
        amax,
        row_amax,
        col_amax,
        n_rows,
        hidden,
        x.stride(0),
        *scale_strides(scale),
        *scale_strides(scale_t if dual else scale),
        ZERO_CENTERED=zero_centered,
        MODE=mode,
        DUAL=dual,
        FP8_MAX=torch.finfo(q.dtype).max,
        GROUP=group if mode == EMIT_BLOCK else tile,
        N_GROUPS=tile // group if mode == EMIT_BLOCK else 1,
        TILE=tile,
        CAST_SATURATES=fp8_cast_saturates(x.device, q.dtype),
        num_warps=emit_warps,
    )
    return rstd


def rmsnorm_bwd_triton(
    dy: torch.Tensor,
    s: torch.Tensor,
    gamma: torch.Tensor,
    rstd: torch.Tensor,
    zero_centered: bool,
    ds: torch.Tensor | None = None,
    launch: tuple[int, int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dgamma)`` of 2-D ``dy``/``s`` (rows, H), plus ``ds`` (the gradient of s itself, rows x H)
    when given; ``dgamma`` summed in fp32 in a fixed order and returned in gamma's dtype. ``launch``
    overrides (rows per block, warps, programs per SM, pipeline stages), for tuning."""
    n_rows, hidden = s.shape
    dx = torch.empty((n_rows, hidden), dtype=s.dtype, device=s.device)
    if n_rows == 0 or hidden == 0:
        if ds is not None:
            dx.copy_(ds)
        return dx, torch.zeros(hidden, dtype=gamma.dtype, device=s.device)
    block_h = triton.next_power_of_2(hidden)
    rows_per_program = max(1, min(16, _BWD_ELEMENTS_PER_BLOCK // block_h))
    warps = 8 if block_h * rows_per_program <= _BWD_ELEMENTS_PER_BLOCK else 16
    # the pipeline keeps stages - 1 blocks of dy, s (and ds) in shared memory, less for wide fp32 rows
    block_bytes = rows_per_program * block_h * sum(t.element_size() for t in (dy, s, ds) if t is not None)
    per_sm, stages = _BWD_PROGRAMS_PER_SM, _pipeline_stages(s.device, block_bytes)
    if launch is not None:
        rows_per_program, warps, per_sm, stages = launch
    programs = min(triton.cdiv(n_rows, rows_per_program), per_sm * num_sms(s.device))
    partial = torch.empty((programs, block_h), dtype=torch.float32, device=s.device)
    _rmsnorm_bwd_kernel[(programs,)](
        dy,
        s,
        ds if ds is not None else dy,
        gamma,
        rstd,
        dx,
        partial,
        n_rows,
        hidden,
        dy.stride(0),
        s.stride(0),
        ds.stride(0) if ds is not None else 0,
        dx.stride(0),
        HAS_DS=ds is not None,
        ZERO_CENTERED=zero_centered,
        ROWS=rows_per_program,
        BLOCK_H=block_h,
        NUM_STAGES=stages,
        num_warps=warps,
    )
    dgamma = torch.empty(hidden, dtype=gamma.dtype, device=s.device)
    block_p = triton.next_power_of_2(programs)
    finish_h = max(16, _FINISH_ELEMENTS // block_p)
    _dgamma_finish_kernel[(triton.cdiv(hidden, finish_h),)](
        partial, dgamma, programs, hidden, partial.stride(0), BLOCK_P=block_p, BLOCK_H=finish_h, num_warps=8
    )
    return dx, dgamma
