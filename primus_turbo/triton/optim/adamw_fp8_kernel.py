"""AdamW step of a weight that writes the weight's FP8 copies in the same pass, in Triton.

A weight [B, R, C] (one matrix, or a stack of expert matrices) is updated tile by tile: the AdamW update
in fp32 (from the fp32 master copy when there is one), the weight stored in its own dtype, and then the
*stored* values quantized, so the FP8 copies equal the quantization of the weight a forward would read.
Both FP8 layouts are written, ``q`` [B, R, C] for the forward and ``q_t`` [B, C, R] for the input
gradient, with the scale rules of ``quantization/fp8_quant_kernel.py``:

- 2-D blocks: each TILE x TILE tile is one scale group, quantized by the program that updated it;
- tensorwise (one scale per slice b): the update kernel folds each tile's amax into ``amax[b]`` (+inf
  for a tile holding NaN or inf, which gives the NaN scale_inv as the amax reduction would), then the
  one-read quantizer writes both layouts from the stored weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from primus_turbo.triton.quantization.fp8_quant_kernel import (
    _group_scale,
    finite_tile_amax,
    quantize_fp8_with_trans_tiles_triton,
    store_tile_with_trans,
)
from primus_turbo.triton.utils.device_info import fp8_cast_saturates
from primus_turbo.triton.utils.launch import cached_launch

__all__ = ["adamw_fp8_step_triton"]

_CHUNK = 32  # rows of a tile updated at a time: five fp32 streams of a whole tile would spill


@cached_launch
@triton.jit
def _adamw_fp8_tiles_kernel(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    master_ptr,
    q_ptr,
    q_t_ptr,
    s_ptr,
    s_t_ptr,
    amax_ptr,
    rows,
    cols,
    decay,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    step_size,
    bc2_sqrt,
    stride_sb,
    stride_sr,
    stride_stb,
    stride_str,
    HAS_MASTER: tl.constexpr,
    BLOCK_2D: tl.constexpr,
    FP8_MAX: tl.constexpr,
    TILE: tl.constexpr,
    CHUNK: tl.constexpr,
    CAST_SATURATES: tl.constexpr,
):
    """One TILE x TILE tile of slice b: AdamW on every element (``CHUNK`` rows at a time), then the tile's
    amax of the stored weight; BLOCK_2D: the tile quantized into ``q``/``q_t`` with its scale_inv at
    (b, tile row, tile column) of ``s`` and transposed of ``s_t``; otherwise the amax folded into
    ``amax[b]``. All tensors but the scales are contiguous [B, R, C] (``q_t``: [B, C, R], as bytes)."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    base = b * rows.to(tl.int64) * cols
    c = (pid_c * TILE + tl.arange(0, TILE)).to(tl.int64)
    amax = 0.0  # the loop below unrolls: these become the tile's scalars
    bad = 0
    for start in tl.static_range(0, TILE, CHUNK):
        r = (pid_r * TILE + start + tl.arange(0, CHUNK)).to(tl.int64)
        mask = (r < rows)[:, None] & (c < cols)[None, :]
        offs = base + r[:, None] * cols + c[None, :]
        src = master_ptr if HAS_MASTER else p_ptr
        p = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        p = p * decay
        m = m + one_minus_beta1 * (g - m)
        v = v * beta2 + one_minus_beta2 * (g * g)
        denom = tl.sqrt_rn(v) / bc2_sqrt + eps
        p = p - step_size * (m / denom)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        if HAS_MASTER:
            tl.store(master_ptr + offs, p, mask=mask)
        stored = p.to(p_ptr.dtype.element_ty)
        tl.store(p_ptr + offs, stored, mask=mask)
        chunk_amax, chunk_bad = finite_tile_amax(stored.to(tl.float32))
        amax = tl.maximum(amax, chunk_amax)
        bad += chunk_bad
    if BLOCK_2D:
        multiplier, scale_inv = _group_scale(amax, bad, FP8_MAX, False, 0)
        tl.store(s_ptr + b * stride_sb + pid_r * stride_sr + pid_c, scale_inv)
        tl.store(s_t_ptr + b * stride_stb + pid_c * stride_str + pid_r, scale_inv)
        # this program's own stores, read back whole: the barrier makes every thread's writes visible
        tl.debug_barrier()
        r = (pid_r * TILE + tl.arange(0, TILE)).to(tl.int64)
        mask = (r < rows)[:, None] & (c < cols)[None, :]
        x = tl.load(p_ptr + base + r[:, None] * cols + c[None, :], mask=mask, other=0.0).to(tl.float32)
        store_tile_with_trans(
            x, multiplier, q_ptr + base, q_t_ptr + base, r, c, rows, cols, mask, FP8_MAX, CAST_SATURATES
        )
    else:
        tl.atomic_max(amax_ptr + b, tl.where(bad > 0, float("inf"), amax))


def adamw_fp8_step_triton(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    master: torch.Tensor | None,
    q: torch.Tensor,
    q_t: torch.Tensor,
    scale: torch.Tensor,
    scale_t: torch.Tensor | None,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    block: int,
) -> None:
    """AdamW step ``step`` (1-based) of ``param`` [B, R, C] with its fp32 ``exp_avg``/``exp_avg_sq`` (and
    fp32 ``master``, from which ``param`` is then rounded), writing ``q`` [B, R, C] and ``q_t`` [B, C, R].
    ``block``: 2-D blocks of that size, ``scale``/``scale_t`` [B, R / block, C / block] and its transpose
    (unit last strides); 0: tensorwise, ``scale`` [B]. All but the scales contiguous and non-empty."""
    batch, rows, cols = param.shape
    tile = block or 128
    block_2d = block > 0
    amax = None if block_2d else torch.zeros(batch, dtype=torch.float32, device=param.device)
    s_strides = (scale.stride(0), scale.stride(1)) if block_2d else (0, 0)
    st_strides = (scale_t.stride(0), scale_t.stride(1)) if block_2d else (0, 0)
    _adamw_fp8_tiles_kernel[(triton.cdiv(rows, tile), triton.cdiv(cols, tile), batch)](
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        param if master is None else master,
        q,
        q_t.view(torch.uint8),
        scale,
        scale if scale_t is None else scale_t,
        scale if amax is None else amax,
        rows,
        cols,
        1.0 - lr * weight_decay,
        1.0 - beta1,
        beta2,
        1.0 - beta2,
        eps,
        lr / (1.0 - beta1**step),
        (1.0 - beta2**step) ** 0.5,
        *s_strides,
        *st_strides,
        HAS_MASTER=master is not None,
        BLOCK_2D=block_2d,
        FP8_MAX=torch.finfo(q.dtype).max,
        TILE=tile,
        CHUNK=min(_CHUNK, tile),
        CAST_SATURATES=fp8_cast_saturates(param.device, q.dtype),
        num_warps=8,
    )
    if not block_2d:
        tile = 128 if param.element_size() <= 2 else 64
        quantize_fp8_with_trans_tiles_triton(param, q, q_t, scale, amax=amax, tile=tile)
