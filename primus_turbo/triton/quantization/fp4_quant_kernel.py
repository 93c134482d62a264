"""MXFP4 quantization in Triton: E2M1 values, two per byte, one E8M0 scale per 32 along a row.

Rules (shared with the TORCH reference in ``kernels/quantization/quantization_fp4_impl.py``):

- scale ``2 ** (floor(log2(amax)) - 2)`` per group of 32 (2 is E2M1's largest exponent), clamped to
  [2**-127, 2**127]; an all-zero group has scale 1;
- ``x / scale`` is rounded to nearest even on the E2M1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} and
  saturates at +-6;
- a group holding NaN or +-inf stores the E8M0 NaN code 0xFF; its elements are coded with scale 1
  (NaN as 0, +-inf as +-6);
- element ``2i`` of a row is the low nibble of byte ``i``, element ``2i + 1`` the high nibble.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from primus_turbo.triton.quantization.fp8_quant_kernel import e8m0_scale
from primus_turbo.triton.utils.launch import cached_launch

__all__ = ["quantize_fp4_rows_triton"]

MX_GROUP = 32


@triton.jit
def _e2m1_code(v):
    """E2M1 code (sign bit 8) of fp32 ``v`` already divided by its scale: round to nearest even."""
    mag = tl.abs(v)
    mag = tl.where(mag != mag, 0.0, mag)
    code = (
        (mag > 0.25).to(tl.int32)
        + (mag >= 0.75).to(tl.int32)
        + (mag > 1.25).to(tl.int32)
        + (mag >= 1.75).to(tl.int32)
        + (mag > 2.5).to(tl.int32)
        + (mag >= 3.5).to(tl.int32)
        + (mag > 5.0).to(tl.int32)
    )
    return tl.where(v < 0, code + 8, code)


@cached_launch
@triton.jit
def _quantize_fp4_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    R,
    C,
    stride_xr,
    stride_xc,
    stride_qr,
    stride_sr,
    BLOCK_R: tl.constexpr,
    GROUPS: tl.constexpr,
):
    """One program: BLOCK_R rows x GROUPS groups of 32 columns."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = (pid_c * GROUPS * 32 + tl.arange(0, GROUPS * 32)).to(tl.int64)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0)
    x = tl.reshape(x.to(tl.float32), (BLOCK_R, GROUPS, 32))
    mag = tl.abs(x)
    nonfinite = (mag != mag) | (mag == float("inf"))
    bad = tl.sum(nonfinite.to(tl.int32), axis=2)
    amax = tl.max(tl.where(nonfinite, 0.0, mag), axis=2)
    multiplier, stored = e8m0_scale(amax, bad, 2)
    codes = _e2m1_code(x * multiplier[:, :, None])
    pairs = tl.reshape(codes, (BLOCK_R, GROUPS * 16, 2))
    low, high = tl.split(pairs)
    packed = (low | (high << 4)).to(tl.uint8)
    pcols = (pid_c * GROUPS * 16 + tl.arange(0, GROUPS * 16)).to(tl.int64)
    pmask = (rows < R)[:, None] & (pcols < C // 2)[None, :]
    tl.store(q_ptr + rows[:, None] * stride_qr + pcols[None, :], packed, mask=pmask)
    gcols = pid_c * GROUPS + tl.arange(0, GROUPS)
    smask = (rows < R)[:, None] & (gcols < C // 32)[None, :]
    tl.store(s_ptr + rows[:, None] * stride_sr + gcols[None, :], stored, mask=smask)


def quantize_fp4_rows_triton(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """Quantize the 2-D view ``x`` (R, C) along its rows: ``q`` (R, C / 2) uint8 with row-major rows,
    ``scale`` (R, C / 32) uint8 E8M0 codes. C must be a multiple of 32."""
    rows, cols = x.shape
    if rows == 0 or cols == 0:
        return
    groups = min(8, triton.next_power_of_2(cols // MX_GROUP))
    block_r = max(1, min(64, 4096 // (groups * MX_GROUP)))
    grid = (triton.cdiv(rows, block_r), triton.cdiv(cols, groups * MX_GROUP))
    _quantize_fp4_kernel[grid](
        x, q, scale, rows, cols, *x.stride(), q.stride(0), scale.stride(0), BLOCK_R=block_r, GROUPS=groups
    )
