"""Block quantization of attention inputs for the FP8 forward.

One program per (batch, head, ``FP8_BLOCK`` tokens) reads the block once, takes its amax and writes the
E4M3 values and the fp32 ``scale_inv = amax / fp8_max`` (1 for an all-zero block). The output is
head-major ([B, H, S, D] storage) or, for v, sequence-contiguous ([B, H, D, S] storage): the operand
layout FP8 tensor cores take for P V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from primus_turbo.triton.attention.flash_attn_kernel import FP8_BLOCK
from primus_turbo.triton.utils.launch import cached_launch

__all__ = ["quantize_attention_blocks_triton"]


@cached_launch
@triton.jit
def _quantize_blocks_kernel(
    x_ptr,
    y_ptr,
    scale_ptr,
    stride_xb,
    stride_xs,
    stride_xh,
    stride_yb,
    stride_ys,
    stride_yh,
    stride_yd,
    H,
    S,
    D,
    FP8_MAX: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    bh = tl.program_id(0)
    block = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = block * BLOCK_S + tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    mask = (rows < S)[:, None] & (d < D)[None, :]
    x_ptrs = x_ptr + b * stride_xb + h * stride_xh + rows[:, None].to(tl.int64) * stride_xs + d[None, :]
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    scale_inv = tl.where(amax > 0, amax / FP8_MAX, 1.0)
    y_ptrs = y_ptr + b * stride_yb + h * stride_yh + rows[:, None].to(tl.int64) * stride_ys
    tl.store(y_ptrs + d[None, :] * stride_yd, (x / scale_inv).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + bh.to(tl.int64) * tl.num_programs(1) + block, scale_inv)


def quantize_attention_blocks_triton(
    x: torch.Tensor, dtype: torch.dtype, seq_contiguous: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 ``x`` as a logical [B, S, H, D] view, fp32 scale_inv [B, H, ceil(S / FP8_BLOCK)]) for a logical
    [B, S, H, D] ``x`` with unit stride along D. The values are stored head-major, or with
    ``seq_contiguous`` as [B, H, D, S'] with S' the sequence rounded up to 16 elements (aligned rows)."""
    b, s, h, d = x.shape
    blocks = triton.cdiv(s, FP8_BLOCK)
    scale_inv = torch.empty((b, h, blocks), dtype=torch.float32, device=x.device)
    if seq_contiguous:
        stored = torch.empty((b, h, d, triton.cdiv(s, 16) * 16), dtype=dtype, device=x.device)
        y = stored.permute(0, 3, 1, 2)[:, :s]
    else:
        y = torch.empty((b, h, s, d), dtype=dtype, device=x.device).permute(0, 2, 1, 3)
    if x.numel() == 0:
        return y, scale_inv.fill_(1.0)
    _quantize_blocks_kernel[(b * h, blocks)](
        x,
        y,
        scale_inv,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        y.stride(0),
        y.stride(1),
        y.stride(2),
        y.stride(3),
        h,
        s,
        d,
        FP8_MAX=torch.finfo(dtype).max,
        BLOCK_S=FP8_BLOCK,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        num_warps=8,
    )
    return y, scale_inv
