"""Gated activations ``out = act(x[:, :H]) * x[:, H:] (* probs[:, None])`` in Triton, fp32 math.

``act`` is SiLU (SwiGLU) or tanh-approximated GELU (GeGLU, as Megatron's fused GeGLU). The MoE
variants scale each row by its routing probability, and a row mask marks padding rows: they are
neither read nor computed, and get zero output and zero gradients. A program owns ``ROWS`` rows and
walks H in ``BLOCK_H`` chunks, so the per-row probability gradient is summed inside one program, in a
fixed order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from primus_turbo.triton.quantization.fp8_quant_kernel import _group_scale, _saturate
from primus_turbo.triton.utils.device_info import fp8_cast_saturates

__all__ = [
    "GELU_TANH",
    "QUANT_BLOCKS",
    "QUANT_NONE",
    "QUANT_ROW",
    "QUANT_TENSOR_AMAX",
    "SILU",
    "gated_act_bwd_triton",
    "gated_act_fwd_triton",
]

SILU, GELU_TANH = 0, 1
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_GELU_COEF = tl.constexpr(0.044715)


@triton.jit
def _act_and_grad(a, ACT: tl.constexpr):
    """(act(a), act'(a)) in fp32."""
    if ACT == 0:
        sig = tl.sigmoid(a)
        return a * sig, sig * (1.0 + a * (1.0 - sig))
    inner = _SQRT_2_OVER_PI * (a + _GELU_COEF * a * a * a)
    t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
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
def _gated_out(x_ptr, rows, cols, live, p, H, stride_x, ACT: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """One chunk of the output, rounded to the output dtype (what quantization must read)."""
    load = live[:, None] & (cols < H)[None, :]
    base = x_ptr + rows[:, None] * stride_x + cols[None, :]
    a = tl.load(base, mask=load, other=0.0).to(tl.float32)
    b = tl.load(base + H, mask=load, other=0.0).to(tl.float32)
    act, _ = _act_and_grad(a, ACT)
    return (act * b * p[:, None]).to(OUT_DTYPE)


@triton.jit
def _nonfinite_amax(v, AXIS: tl.constexpr):
    """(amax of the finite magnitudes, count of NaN/inf) of fp32 ``v`` along ``AXIS``."""
    mag = tl.abs(v)
    nonfinite = (mag != mag) | (mag == float("inf"))
    return tl.max(tl.where(nonfinite, 0.0, mag), axis=AXIS), tl.sum(nonfinite.to(tl.int32), axis=AXIS)


@triton.jit
def _gated_fwd_kernel(
    x_ptr,
    probs_ptr,
    mask_ptr,
    out_ptr,
    q_ptr,
    qs_ptr,
    n_rows,
    H,
    stride_x,
    stride_out,
    ACT: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    CAST_SATURATES: tl.constexpr,
    GROUP: tl.constexpr,
    N_GROUPS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """QUANT: 0 none; 1 FP8 per row (a first sweep finds the row amax); 2 FP8 per 1 x GROUP block;
    3 per-row amax for a tensorwise scale applied afterwards. Quantization reads the output as stored."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    live, p = _row_state(probs_ptr, mask_ptr, rows, n_rows, HAS_PROBS, HAS_MASK)
    in_range = rows < n_rows
    row_multiplier = tl.zeros([ROWS], dtype=tl.float32)
    if QUANT == 1:
        amax = tl.zeros([ROWS], dtype=tl.float32)
        bad = tl.zeros([ROWS], dtype=tl.int32)
        for c0 in range(0, H, BLOCK_H):
            cols = c0 + tl.arange(0, BLOCK_H)
            chunk_amax, chunk_bad = _nonfinite_amax(
                _gated_out(x_ptr, rows, cols, live, p, H, stride_x, ACT, out_ptr.dtype.element_ty).to(
                    tl.float32
                ),
                1,
            )
            amax = tl.maximum(amax, chunk_amax)
            bad += chunk_bad
        row_multiplier, stored = _group_scale(amax, bad, FP8_MAX, False, 0)
        tl.store(qs_ptr + rows, stored, mask=in_range)
    tensor_amax = tl.zeros([ROWS], dtype=tl.float32)
    tensor_bad = tl.zeros([ROWS], dtype=tl.int32)
    for c0 in range(0, H, BLOCK_H):
        cols = c0 + tl.arange(0, BLOCK_H)
        store = in_range[:, None] & (cols < H)[None, :]
        out = _gated_out(x_ptr, rows, cols, live, p, H, stride_x, ACT, out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], out, mask=store)
        q_ptrs = q_ptr + rows[:, None] * H + cols[None, :]
        if QUANT == 1:
            q = _saturate(out.to(tl.float32) * row_multiplier[:, None], FP8_MAX, CAST_SATURATES)
            tl.store(q_ptrs, q.to(q_ptr.dtype.element_ty), mask=store)
        elif QUANT == 2:
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
            tl.store(qs_ptr + rows[:, None] * n_scales + g[None, :], stored, mask=s_mask)
        elif QUANT == 3:
            chunk_amax, chunk_bad = _nonfinite_amax(out.to(tl.float32), 1)
            tensor_amax = tl.maximum(tensor_amax, chunk_amax)
            tensor_bad += chunk_bad
    if QUANT == 3:
        tl.store(qs_ptr + rows, tl.where(tensor_bad > 0, float("nan"), tensor_amax), mask=in_range)


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


QUANT_NONE, QUANT_ROW, QUANT_BLOCKS, QUANT_TENSOR_AMAX = 0, 1, 2, 3


def gated_act_fwd_triton(
    x: torch.Tensor,
    probs: torch.Tensor | None,
    row_mask: torch.Tensor | None,
    act: int,
    quant: int = QUANT_NONE,
    fp8_dtype: torch.dtype | None = None,
    group: int = 0,
    launch: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, q, scales)``: ``act(x[:, :H]) * x[:, H:] (* probs)`` for 2-D ``x`` (rows, 2H) with a unit
    column stride, and with ``quant`` its FP8 copy ``q`` (rows, H) with fp32 scale_inv per row or per
    1 x ``group`` block, or (QUANT_TENSOR_AMAX) an empty ``q`` and the per-row amax (NaN for rows
    holding NaN/inf). Without ``quant``, ``q`` and ``scales`` are empty. ``launch`` overrides (ROWS,
    BLOCK_H, warps), for tuning."""
    n_rows, width = x.shape
    hidden = width // 2
    out = torch.empty((n_rows, hidden), dtype=x.dtype, device=x.device)
    q_shape = (n_rows, hidden) if quant in (QUANT_ROW, QUANT_BLOCKS) else (0,)
    q = torch.empty(q_shape, dtype=fp8_dtype or torch.uint8, device=x.device)
    n_scales = triton.cdiv(hidden, group) if quant == QUANT_BLOCKS else 1
    scales = torch.empty((n_rows, n_scales) if quant else (0,), dtype=torch.float32, device=x.device)
    if n_rows == 0 or hidden == 0:
        return out, q, scales
    rows, block_h, warps = launch or _launch_shape(max(hidden, group), _FWD_ELEMENTS)
    group = group if quant == QUANT_BLOCKS else block_h
    _gated_fwd_kernel[(triton.cdiv(n_rows, rows),)](
        x,
        probs if probs is not None else x,
        row_mask if row_mask is not None else x,
        out,
        q,
        scales,
        n_rows,
        hidden,
        x.stride(0),
        out.stride(0),
        ACT=act,
        HAS_PROBS=probs is not None,
        HAS_MASK=row_mask is not None,
        QUANT=quant,
        FP8_MAX=torch.finfo(fp8_dtype).max if fp8_dtype is not None else 0.0,
        CAST_SATURATES=fp8_dtype is not None and fp8_cast_saturates(x.device, fp8_dtype),
        GROUP=group,
        N_GROUPS=max(1, block_h // group),
        ROWS=rows,
        BLOCK_H=block_h,
        num_warps=warps,
    )
    return out, q, scales


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
    rows, block_h, warps = launch or _launch_shape(hidden, _BWD_ELEMENTS)
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
