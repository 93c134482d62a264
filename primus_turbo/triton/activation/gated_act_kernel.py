"""Gated activations ``out = act(x[:, :H]) * x[:, H:] (* probs[:, None])`` in Triton, fp32 math.

``act`` is SiLU (SwiGLU) or tanh-approximated GELU (GeGLU, as Megatron's fused GeGLU). The MoE
variants scale each row by its routing probability, and a row mask marks padding rows: they are
neither read nor computed, and get zero output and zero gradients. The plain forward walks the
flattened output (one compiled kernel per H); the FP8 forward and the backward give a program ``ROWS``
rows and walk H in ``BLOCK_H`` chunks, so a row's scale and its probability gradient come from one
program, in a fixed order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from primus_turbo.triton.quantization.fp8_emit import (
    EMIT_BLOCK,
    EMIT_ROW,
    EMIT_TENSOR,
    emit_fp8_tile,
    emit_grid,
    emit_launch,
    emit_tile,
    record_tile_amax,
    scale_strides,
)
from primus_turbo.triton.quantization.fp8_quant_kernel import _group_scale, _saturate
from primus_turbo.triton.utils.device_info import fp8_cast_saturates, interpreter_active
from primus_turbo.triton.utils.launch import cached_launch

__all__ = ["GELU_TANH", "SILU", "gated_act_bwd_triton", "gated_act_fp8_triton", "gated_act_fwd_triton"]

SILU, GELU_TANH = 0, 1
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_GELU_COEF = tl.constexpr(0.044715)


# On NVIDIA GPUs the sigmoid is four PTX instructions: exp(-a) as ex2.approx.ftz of a * -log2 e, then
# rcp.approx.ftz of 1 + that (within an ulp or two of fp32), instead of the denormal-range checks of
# tl.exp and div.full; a flushed subnormal exp changes nothing, as 1 + it rounds to 1. The C++
# dual-block kernel runs the same PTX, so its copies stay bit-identical to these kernels'. ROCm and the
# interpreter take tl.sigmoid.
_PTX_SIGMOID = tl.constexpr(torch.version.hip is None and not interpreter_active())
_SIGMOID_PTX = tl.constexpr(
    "{ .reg .f32 t; mul.f32 t, $1, 0fBFB8AA3B; ex2.approx.ftz.f32 t, t; "
    "add.f32 t, t, 0f3F800000; rcp.approx.ftz.f32 $0, t; }"
)


@triton.jit
def _sigmoid(a):
    """1 / (1 + exp(-a)) in fp32."""
    if _PTX_SIGMOID:
        return tl.inline_asm_elementwise(_SIGMOID_PTX, "=r,r", [a], dtype=tl.float32, is_pure=True, pack=1)
    return tl.sigmoid(a)


@triton.jit
def _act_and_grad(a, ACT: tl.constexpr):
    """(act(a), act'(a)) in fp32."""
    if ACT == 0:
        sig = _sigmoid(a)
        return a * sig, sig * (1.0 + a * (1.0 - sig))
    inner = _SQRT_2_OVER_PI * (a + _GELU_COEF * a * a * a)
    t = 2.0 * _sigmoid(2.0 * inner) - 1.0
    grad = 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_COEF * a * a)
    return 0.5 * a * (1.0 + t), grad


@triton.jit
def _row_state(probs_ptr, mask_ptr, rows, n_rows, HAS_PROBS: tl.constexpr, HAS_MASK: tl.constexpr):
    """(rows that hold data, their probabilities)."""
    live = rows < n_rows
    if HAS_MASK:
        live = live & (tl.load(mask_ptr + rows, mask=live, other=0) != 0)
    p = tl.full(rows.shape, 1.0, tl.float32)
    if HAS_PROBS:
        p = tl.load(probs_ptr + rows, mask=live, other=0.0).to(tl.float32)
    return live, p


@triton.jit
def _gated_out(a_ptrs, load, p, H, ACT: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """One chunk of the output from the pointers to its gate half (the linear half is H further),
    rounded to the output dtype (what quantization must read)."""
    a = tl.load(a_ptrs, mask=load, other=0.0).to(tl.float32)
    b = tl.load(a_ptrs + H, mask=load, other=0.0).to(tl.float32)
    act, _ = _act_and_grad(a, ACT)
    return (act * b * p[:, None]).to(OUT_DTYPE)


@triton.jit
def _nonfinite_amax(v, AXIS: tl.constexpr):
    """(amax of the finite magnitudes, count of NaN/inf) of fp32 ``v`` along ``AXIS``."""
    mag = tl.abs(v)
    nonfinite = (mag != mag) | (mag == float("inf"))
    return tl.max(tl.where(nonfinite, 0.0, mag), axis=AXIS), tl.sum(nonfinite.to(tl.int32), axis=AXIS)


@cached_launch
@triton.jit
def _gated_fwd_kernel(
    x_ptr,
    probs_ptr,
    mask_ptr,
    q_ptr,
    qs_ptr,
    n_rows,
    H,
    stride_x,
    stride_qs_row,
    stride_qs_group,
    ACT: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    QUANT: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    FP8_MAX: tl.constexpr,
    CAST_SATURATES: tl.constexpr,
    GROUP: tl.constexpr,
    N_GROUPS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """The output written only as FP8 along H, QUANT 1 per row (a first sweep finds the row amax, kept in
    registers when the row is ONE_CHUNK) or 2 per 1 x GROUP block; quantization reads the output rounded
    to the input dtype."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    live, p = _row_state(probs_ptr, mask_ptr, rows, n_rows, HAS_PROBS, HAS_MASK)
    in_range = rows < n_rows
    row_multiplier = tl.zeros([ROWS], dtype=tl.float32)
    if QUANT == 1:
        amax = tl.zeros([ROWS], dtype=tl.float32)
        bad = tl.zeros([ROWS], dtype=tl.int32)
        if ONE_CHUNK:
            cols = tl.arange(0, BLOCK_H)
            a_ptrs = x_ptr + rows[:, None] * stride_x + cols[None, :]
            whole_row = _gated_out(
                a_ptrs, live[:, None] & (cols < H)[None, :], p, H, ACT, x_ptr.dtype.element_ty
            )
            amax, bad = _nonfinite_amax(whole_row.to(tl.float32), 1)
        for c0 in range(0, H if not ONE_CHUNK else 0, BLOCK_H):
            cols = c0 + tl.arange(0, BLOCK_H)
            load = live[:, None] & (cols < H)[None, :]
            a_ptrs = x_ptr + rows[:, None] * stride_x + cols[None, :]
            chunk = _gated_out(a_ptrs, load, p, H, ACT, x_ptr.dtype.element_ty)
            chunk_amax, chunk_bad = _nonfinite_amax(chunk.to(tl.float32), 1)
            amax = tl.maximum(amax, chunk_amax)
            bad += chunk_bad
        row_multiplier, stored = _group_scale(amax, bad, FP8_MAX, False, 0)
        tl.store(qs_ptr + rows * stride_qs_row, stored, mask=in_range)
    for c0 in range(0, H, BLOCK_H):
        cols = c0 + tl.arange(0, BLOCK_H)
        store = in_range[:, None] & (cols < H)[None, :]
        if QUANT == 1 and ONE_CHUNK:
            out = whole_row
        else:
            a_ptrs = x_ptr + rows[:, None] * stride_x + cols[None, :]
            out = _gated_out(a_ptrs, live[:, None] & (cols < H)[None, :], p, H, ACT, x_ptr.dtype.element_ty)
        q_ptrs = q_ptr + rows[:, None] * H + cols[None, :]
        if QUANT == 1:
            q = _saturate(out.to(tl.float32) * row_multiplier[:, None], FP8_MAX, CAST_SATURATES)
            tl.store(q_ptrs, q.to(q_ptr.dtype.element_ty), mask=store)
        if QUANT == 2:
            groups = tl.reshape(out.to(tl.float32), (ROWS, N_GROUPS, GROUP))
            amax, bad = _nonfinite_amax(groups, 2)
            multiplier, stored = _group_scale(amax, bad, FP8_MAX, False, 0)
            q = _saturate(
                tl.reshape(groups * multiplier[:, :, None], (ROWS, BLOCK_H)), FP8_MAX, CAST_SATURATES
            )
            tl.store(q_ptrs, q.to(q_ptr.dtype.element_ty), mask=store)
            g = c0 // GROUP + tl.arange(0, N_GROUPS)
            n_scales = tl.cdiv(H, GROUP)
            s_mask = in_range[:, None] & (g < n_scales)[None, :]
            s_offs = rows[:, None] * stride_qs_row + g[None, :] * stride_qs_group
            tl.store(qs_ptr + s_offs, stored, mask=s_mask)


@cached_launch
@triton.jit
def _gated_fwd_flat_kernel(
    x_ptr,
    probs_ptr,
    mask_ptr,
    out_ptr,
    n_rows,
    stride_x,
    H: tl.constexpr,
    ACT: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The plain forward over the flattened output: a program owns ``BLOCK`` consecutive elements, so
    no lane idles on a padded chunk whatever H is. H is a compile-time constant: the row and column of an
    element are a multiply and a shift, and runs of columns stay contiguous for vector loads."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    rows = idx // H
    cols = idx - rows * H
    live, p = _row_state(probs_ptr, mask_ptr, rows, n_rows, HAS_PROBS, HAS_MASK)
    a_ptrs = x_ptr + rows * stride_x + cols
    a = tl.load(a_ptrs, mask=live, other=0.0).to(tl.float32)
    b = tl.load(a_ptrs + H, mask=live, other=0.0).to(tl.float32)
    act, _ = _act_and_grad(a, ACT)
    tl.store(out_ptr + idx, (act * b * p).to(out_ptr.dtype.element_ty), mask=rows < n_rows)


_FLAT_BLOCK, _FLAT_WARPS = 1024, 4


def gated_act_fwd_triton(
    x: torch.Tensor,
    probs: torch.Tensor | None,
    row_mask: torch.Tensor | None,
    act: int,
    launch: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``act(x[:, :H]) * x[:, H:] (* probs)`` for 2-D ``x`` (rows, 2H) with a unit column stride, from the
    flat kernel; ``launch`` overrides (BLOCK, warps), for tuning.

    On H200 (CUDA graphs, 4096-16384 tokens, H 1536-3584) 1024 elements at 4 warps ran at 1.03-1.06 of a
    same-size copy, against 0.98-1.04 for the former row-chunk kernel (2048-column chunks, the last one
    padded: 3584 idled an eighth of its lanes) and 0.94-1.03 for 8192 elements."""
    n_rows, width = x.shape
    out = torch.empty((n_rows, width // 2), dtype=x.dtype, device=x.device)
    block, warps = launch or (_FLAT_BLOCK, _FLAT_WARPS)
    if out.numel():
        _gated_fwd_flat_kernel[(triton.cdiv(out.numel(), block),)](
            x,
            probs if probs is not None else x,
            row_mask if row_mask is not None else x,
            out,
            n_rows,
            x.stride(0),
            H=width // 2,
            ACT=act,
            HAS_PROBS=probs is not None,
            HAS_MASK=row_mask is not None,
            BLOCK=block,
            num_warps=warps,
        )
    return out


@cached_launch
@triton.jit
def _gated_emit_kernel(
    x_ptr,
    probs_ptr,
    mask_ptr,
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
    ACT: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    STATS: tl.constexpr,
    REVERSE: tl.constexpr,
    MODE: tl.constexpr,
    DUAL: tl.constexpr,
    FP8_MAX: tl.constexpr,
    GROUP: tl.constexpr,
    N_GROUPS: tl.constexpr,
    TILE: tl.constexpr,
    CAST_SATURATES: tl.constexpr,
):
    """One TILE x TILE tile of the output, as stored: with STATS folded into the tensor or row and
    column amaxes (``record_tile_amax``), else quantized by ``emit_fp8_tile``; REVERSE after a STATS
    pass. Addresses are 32-bit offsets from the tile's corner."""
    pid_m, pid_k = emit_tile(H, TILE, REVERSE)
    r = tl.arange(0, TILE)
    rows = pid_m.to(tl.int64) * TILE + r
    cols = pid_k * TILE + r
    live, p = _row_state(probs_ptr, mask_ptr, rows, n_rows, HAS_PROBS, HAS_MASK)
    a_tile = x_ptr + pid_m.to(tl.int64) * TILE * stride_x + pid_k * TILE
    load = live[:, None] & (cols < H)[None, :]
    y = _gated_out(a_tile + r[:, None] * stride_x + r[None, :], load, p, H, ACT, x_ptr.dtype.element_ty)
    if STATS:
        record_tile_amax(
            y.to(tl.float32), rows, cols, rows < n_rows, cols < H, amax_ptr, row_amax_ptr, col_amax_ptr, MODE
        )
    else:
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


@cached_launch
@triton.jit
def _gated_bwd_kernel(
    dy_ptr,
    x_ptr,
    probs_ptr,
    mask_ptr,
    dx_ptr,
    dprobs_ptr,
    n_rows,
    H,
    stride_dy,
    stride_x,
    stride_dx,
    ACT: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    live, p = _row_state(probs_ptr, mask_ptr, rows, n_rows, HAS_PROBS, HAS_MASK)
    in_range = rows < n_rows
    dprobs = tl.zeros([ROWS], dtype=tl.float32)
    for c0 in range(0, H, BLOCK_H):
        cols = c0 + tl.arange(0, BLOCK_H)
        col_ok = (cols < H)[None, :]
        load = live[:, None] & col_ok
        base = x_ptr + rows[:, None] * stride_x + cols[None, :]
        a = tl.load(base, mask=load, other=0.0).to(tl.float32)
        b = tl.load(base + H, mask=load, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=load, other=0.0).to(tl.float32)
        act, dact = _act_and_grad(a, ACT)
        dyp = dy * p[:, None]
        store = in_range[:, None] & col_ok
        dx_base = dx_ptr + rows[:, None] * stride_dx + cols[None, :]
        tl.store(dx_base, (dyp * b * dact).to(dx_ptr.dtype.element_ty), mask=store)
        tl.store(dx_base + H, (dyp * act).to(dx_ptr.dtype.element_ty), mask=store)
        if HAS_PROBS:
            dprobs += tl.sum(dy * act * b, axis=1)
    if HAS_PROBS:
        tl.store(dprobs_ptr + rows, dprobs, mask=in_range)


def _launch_shape(hidden: int, elements: int) -> tuple[int, int, int]:
    """(ROWS, BLOCK_H, warps): chunks of up to 2048 columns, about ``elements`` per chunk, 8 warps.

    On H200 (CUDA graphs, 4096-16384 tokens) 8 warps beat 4 by 0-6%, and chunks that divide H exactly
    (3584 as 7 x 512) lost 2-40% against padding the last 2048-wide chunk. The forward takes 4K elements;
    the backward 2K: its per-row probability gradient keeps the products live through a cross-warp
    reduction, and at 4K (93 registers) two programs fit an SM, so swiglu_with_probs' backward ran at
    0.73-0.82 of a same-size copy against 0.90-1.00 at 2K (40 registers), the plain backward unchanged."""
    block_h = min(2048, triton.next_power_of_2(max(hidden, 1)))
    return max(1, min(32, elements // block_h)), block_h, 8


_FWD_ELEMENTS, _BWD_ELEMENTS = 4096, 2048


def _bwd_launch_shape(hidden: int, has_probs: bool) -> tuple[int, int, int]:
    """(ROWS, BLOCK_H, warps) of the backward: ``_launch_shape``'s, except that with probs a width padded
    by a quarter or more to whole power-of-two chunks walks exact 512-wide chunks, two rows at 4 warps.
    On H200 (CUDA graphs) swiglu_with_probs' backward at width 1536 went from 0.88-0.90 to 0.99-1.02 of a
    same-size copy (4096 and 16384 tokens); at 2048 and 3584 (no or an eighth of padding) the default
    was as fast or faster, and without probs 512-wide chunks lost 2-6%."""
    rows, block_h, warps = _launch_shape(hidden, _BWD_ELEMENTS)
    padded = triton.cdiv(hidden, block_h) * block_h
    if has_probs and hidden % 512 == 0 and 4 * (padded - hidden) >= padded:
        return 2, 512, 4
    return rows, block_h, warps


_WHOLE_ROW_MAX = 4096


def _fp8_launch_shape(hidden: int, quant: int, group: int) -> tuple[int, int, int]:
    """(ROWS, BLOCK_H, warps) of the single pass that writes only the FP8 copy along H.

    On H200 (CUDA graphs, 4096-16384 tokens, H 1536-3584): per-row scales keep one whole row in registers
    up to 4096 columns (3584: 0.71-0.73 of a same-size copy against 0.46 in two 2048-wide sweeps; 4 warps
    up to 2048 columns, 0.65-0.85); 1 x 128 blocks take four rows of 512 columns at 4 warps (0.78-0.86
    against 0.70-0.87 with two rows of 2048)."""
    if quant == 1 and hidden <= _WHOLE_ROW_MAX:
        block_h = triton.next_power_of_2(max(hidden, 1))
        return 1, block_h, 4 if block_h <= 2048 else 8
    if quant == 2:
        return 4, max(512, group), 4
    return _launch_shape(hidden, _FWD_ELEMENTS)


def _fp8_rows_launch(x, probs, row_mask, q, scale, act, quant, group) -> None:
    n_rows, hidden = x.shape[0], x.shape[1] // 2
    rows, block_h, warps = _fp8_launch_shape(hidden, quant, group)
    group = group if quant == 2 else block_h
    _gated_fwd_kernel[(triton.cdiv(n_rows, rows),)](
        x,
        probs if probs is not None else x,
        row_mask if row_mask is not None else x,
        q,
        scale,
        n_rows,
        hidden,
        x.stride(0),
        *scale_strides(scale),
        ACT=act,
        HAS_PROBS=probs is not None,
        HAS_MASK=row_mask is not None,
        QUANT=quant,
        ONE_CHUNK=hidden <= block_h,
        FP8_MAX=torch.finfo(q.dtype).max,
        CAST_SATURATES=fp8_cast_saturates(x.device, q.dtype),
        GROUP=group,
        N_GROUPS=max(1, block_h // group),
        ROWS=rows,
        BLOCK_H=block_h,
        num_warps=warps,
    )


def gated_act_fp8_triton(
    x: torch.Tensor,
    probs: torch.Tensor | None,
    row_mask: torch.Tensor | None,
    act: int,
    mode: int,
    q: torch.Tensor,
    scale: torch.Tensor,
    q_t: torch.Tensor | None = None,
    scale_t: torch.Tensor | None = None,
    group: int = 0,
) -> None:
    """The gated activation of 2-D ``x`` (rows, 2H) written only as FP8: ``q`` (rows, H) quantized along H
    and, when ``q_t`` is given, ``q_t`` (H, rows) quantized along the rows; ``mode`` is EMIT_TENSOR,
    EMIT_ROW or EMIT_BLOCK (1 x ``group``), the scale buffers laid out as ``quantize_fp8_with_trans``
    returns them. Row and block scaling of ``q`` alone take one pass over ``x``; 1-D blocks take one
    tiled pass for both copies; tensor and row scales need a first tiled pass for the amaxes."""
    n_rows, hidden = x.shape[0], x.shape[1] // 2
    if n_rows == 0 or hidden == 0:
        return
    dual = q_t is not None
    if not dual and mode != EMIT_TENSOR:
        _fp8_rows_launch(x, probs, row_mask, q, scale, act, 1 if mode == EMIT_ROW else 2, group)
        return
    amax = torch.zeros(1, dtype=torch.int32, device=x.device)
    row_amax = torch.zeros(n_rows if mode == EMIT_ROW else 0, dtype=torch.int32, device=x.device)
    col_amax = torch.zeros(hidden if mode == EMIT_ROW else 0, dtype=torch.int32, device=x.device)
    tile, warps = emit_launch(group if mode == EMIT_BLOCK else 0)
    passes = (True, False) if mode != EMIT_BLOCK else (False,)
    for stats in passes:
        _gated_emit_kernel[emit_grid(n_rows, hidden, tile)](
            x,
            probs if probs is not None else x,
            row_mask if row_mask is not None else x,
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
            ACT=act,
            HAS_PROBS=probs is not None,
            HAS_MASK=row_mask is not None,
            STATS=stats,
            REVERSE=len(passes) == 2 and not stats,
            MODE=mode,
            DUAL=dual,
            FP8_MAX=torch.finfo(q.dtype).max,
            GROUP=group if mode == EMIT_BLOCK else tile,
            N_GROUPS=tile // group if mode == EMIT_BLOCK else 1,
            TILE=tile,
            CAST_SATURATES=fp8_cast_saturates(x.device, q.dtype),
            num_warps=warps,
        )


def gated_act_bwd_triton(
    dy: torch.Tensor,
    x: torch.Tensor,
    probs: torch.Tensor | None,
    row_mask: torch.Tensor | None,
    act: int,
    launch: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dprobs)``; ``dprobs`` is fp32 per row (empty without ``probs``). ``launch`` overrides
    (ROWS, BLOCK_H, warps), for tuning."""
    n_rows, width = x.shape
    hidden = width // 2
    dx = torch.empty((n_rows, width), dtype=x.dtype, device=x.device)
    dprobs = torch.empty(n_rows if probs is not None else 0, dtype=torch.float32, device=x.device)
    if n_rows == 0 or hidden == 0:
        return dx.zero_(), dprobs.zero_()
    rows, block_h, warps = launch or _bwd_launch_shape(hidden, probs is not None)
    _gated_bwd_kernel[(triton.cdiv(n_rows, rows),)](
        dy,
        x,
        probs if probs is not None else x,
        row_mask if row_mask is not None else x,
        dx,
        dprobs,
        n_rows,
        hidden,
        dy.stride(0),
        x.stride(0),
        dx.stride(0),
        ACT=act,
        HAS_PROBS=probs is not None,
        HAS_MASK=row_mask is not None,
        ROWS=rows,
        BLOCK_H=block_h,
        num_warps=warps,
    )
    return dx, dprobs
