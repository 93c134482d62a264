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

from primus_turbo.triton.quantization.fp8_quant_kernel import _group_scale, _saturate
from primus_turbo.triton.utils.device_info import fp8_cast_saturates, max_shared_memory, num_sms

__all__ = [
    "QUANT_BLOCKS",
    "QUANT_NONE",
    "QUANT_ROW",
    "QUANT_TENSOR_AMAX",
    "rmsnorm_bwd_triton",
    "rmsnorm_fwd_triton",
]

_ELEMENTS_PER_PROGRAM = 8192
# The backward's programs (one per SM) walk row blocks of about 8K elements and stream the next blocks'
# dy and s through shared memory while one computes: on H200 (CUDA graphs, 4096-16384 tokens, hidden
# 4096-8192) 0.81-0.97 of a copy of the same size, against 0.54-0.78 unpipelined; dgamma partials stay
# small.
_BWD_ELEMENTS_PER_BLOCK = 8192
_BWD_PROGRAMS_PER_SM = 1
_BWD_STAGES = 3
_BWD_SMEM_RESERVE = 16 * 1024  # the row reductions' scratch


def _launch_shape(rows: int, hidden: int) -> tuple[int, int, int]:
    """(BLOCK_H, ROWS per program, warps): about 8K elements per program."""
    block_h = triton.next_power_of_2(hidden)
    rows_per_program = max(1, min(16, _ELEMENTS_PER_PROGRAM // block_h))
    warps = max(4, min(16, block_h * rows_per_program // 1024))
    return block_h, rows_per_program, warps


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
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    CAST_SATURATES: tl.constexpr,
    GROUP: tl.constexpr,
    N_GROUPS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """QUANT: 0 none; 1 FP8 per row; 2 FP8 per 1 x GROUP block; 3 per-row amax of y for a tensorwise
    scale (the cast needs the global amax, so it runs after). Quantization reads y as stored (rounded
    to y's dtype), so it equals quantizing the unfused output bit for bit."""
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
    y = (s * rstd[:, None] * w[None, :]).to(y_ptr.dtype.element_ty)
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
            tl.store(qs_ptr + rows, stored, mask=row_ok)
        elif QUANT == 2:
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
            tl.store(qs_ptr + rows[:, None] * n_scales + groups[None, :], stored, mask=s_mask)
        else:
            bad = tl.sum(nonfinite.to(tl.int32), axis=1)
            amax = tl.where(bad > 0, float("nan"), tl.max(mag, axis=1))
            tl.store(qs_ptr + rows, amax, mask=row_ok)


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


QUANT_NONE, QUANT_ROW, QUANT_BLOCKS, QUANT_TENSOR_AMAX = 0, 1, 2, 3


def rmsnorm_fwd_triton(
    x: torch.Tensor,
    gamma: torch.Tensor,
    eps: float,
    zero_centered: bool,
    residual: torch.Tensor | None = None,
    quant: int = QUANT_NONE,
    fp8_dtype: torch.dtype | None = None,
    group: int = 0,
) -> tuple[torch.Tensor, ...]:
    """``(y, s, rstd)`` for 2-D ``x`` (rows, H) with unit column stride; ``s = x + residual`` (``x``
    itself without a residual), ``rstd`` fp32 per row. With ``quant`` it also returns ``(q, scales)``:
    FP8 ``q`` (rows, H) with fp32 ``scale_inv`` per row or per 1 x ``group`` block, or (QUANT_TENSOR_AMAX)
    an empty ``q`` and the per-row amax of y (NaN for rows holding NaN/inf)."""
    n_rows, hidden = x.shape
    y = torch.empty((n_rows, hidden), dtype=x.dtype, device=x.device)
    s = torch.empty_like(y) if residual is not None else x
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    block_h, rows_per_program, warps = _launch_shape(
        n_rows, max(hidden, group if quant == QUANT_BLOCKS else 0)
    )
    q = torch.empty(
        (n_rows, hidden) if quant in (QUANT_ROW, QUANT_BLOCKS) else (0,),
        dtype=fp8_dtype or torch.uint8,
        device=x.device,
    )
    n_scales = triton.cdiv(hidden, group) if quant == QUANT_BLOCKS else 1
    scales = torch.empty(
        (n_rows, n_scales) if quant != QUANT_NONE else (0,), dtype=torch.float32, device=x.device
    )
    extra = (q, scales) if quant != QUANT_NONE else ()
    if n_rows == 0 or hidden == 0:
        return (y, s, rstd, *extra)
    group = group if quant == QUANT_BLOCKS else block_h
    r = residual if residual is not None else x
    _rmsnorm_fwd_kernel[(triton.cdiv(n_rows, rows_per_program),)](
        x,
        r,
        gamma,
        y,
        s,
        rstd,
        q,
        scales,
        n_rows,
        hidden,
        x.stride(0),
        r.stride(0),
        y.stride(0),
        s.stride(0),
        eps,
        HAS_RESIDUAL=residual is not None,
        ZERO_CENTERED=zero_centered,
        QUANT=quant,
        FP8_MAX=torch.finfo(fp8_dtype).max if fp8_dtype is not None else 0.0,
        CAST_SATURATES=fp8_dtype is not None and fp8_cast_saturates(x.device, fp8_dtype),
        GROUP=group,
        N_GROUPS=max(1, block_h // group),
        ROWS=rows_per_program,
        BLOCK_H=block_h,
        num_warps=warps,
    )
    return (y, s, rstd, *extra)


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
    when given; ``dgamma`` in fp32, summed in a fixed order. ``launch`` overrides (rows per block, warps,
    programs per SM, pipeline stages), for tuning."""
    n_rows, hidden = s.shape
    dx = torch.empty((n_rows, hidden), dtype=s.dtype, device=s.device)
    if n_rows == 0 or hidden == 0:
        if ds is not None:
            dx.copy_(ds)
        return dx, torch.zeros(hidden, dtype=torch.float32, device=s.device)
    block_h = triton.next_power_of_2(hidden)
    rows_per_program = max(1, min(16, _BWD_ELEMENTS_PER_BLOCK // block_h))
    warps = 8 if block_h * rows_per_program <= _BWD_ELEMENTS_PER_BLOCK else 16
    # the pipeline keeps stages - 1 blocks of dy, s (and ds) in shared memory, less for wide fp32 rows
    block_bytes = rows_per_program * block_h * sum(t.element_size() for t in (dy, s, ds) if t is not None)
    buffers = min(_BWD_STAGES - 1, (max_shared_memory(s.device) - _BWD_SMEM_RESERVE) // block_bytes)
    per_sm, stages = _BWD_PROGRAMS_PER_SM, 1 + max(0, buffers)
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
    return dx, partial[:, :hidden].sum(dim=0)
