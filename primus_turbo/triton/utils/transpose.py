"""Materialized transpose of the last two dimensions in Triton, for the K-major copies FP8 GEMMs read.

``torch``'s strided copy moves 1-byte FP8 elements at a fraction of the memory bandwidth (about 0.6 TB/s
for a 470 MB weight on an H200); reading and writing whole 128 x 128 byte tiles keeps both sides
coalesced. Elements are moved as same-sized integers, so every dtype of 1, 2 or 4 bytes works, and a
leading batch dimension (the experts of a grouped weight) is one more grid axis.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from primus_turbo.triton.utils.launch import cached_launch

__all__ = ["transpose_triton"]

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_TILE = 128


@cached_launch
@triton.jit
def _transpose_kernel(x_ptr, y_ptr, rows, cols, stride_xb, stride_x, stride_yb, TILE: tl.constexpr):
    r = (tl.program_id(0) * TILE + tl.arange(0, TILE)).to(tl.int64)
    c = (tl.program_id(1) * TILE + tl.arange(0, TILE)).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    mask = (r < rows)[:, None] & (c < cols)[None, :]
    tile = tl.load(x_ptr + batch * stride_xb + r[:, None] * stride_x + c[None, :], mask=mask)
    y_tile = y_ptr + batch * stride_yb + c[:, None] * rows + r[None, :]
    tl.store(y_tile, tl.trans(tile), mask=tl.trans(mask))


def transpose_triton(x: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor equal to ``x.transpose(-2, -1)``, for a 2-D or 3-D ``x`` whose last
    dimension has unit stride."""
    if x.dim() not in (2, 3) or (x.stride(-1) != 1 and x.shape[-1] > 1):
        raise ValueError(f"transpose_triton needs a 2-D or 3-D tensor with unit last stride, got {x.shape}")
    if x.element_size() not in _BITS:
        raise ValueError(f"transpose_triton moves 1-, 2- or 4-byte elements, not {x.dtype}")
    batched = x if x.dim() == 3 else x.unsqueeze(0)
    batch, rows, cols = batched.shape
    out = torch.empty((batch, cols, rows), dtype=x.dtype, device=x.device)
    if x.numel() > 0:
        bits = _BITS[x.element_size()]
        grid = (triton.cdiv(rows, _TILE), triton.cdiv(cols, _TILE), batch)
        _transpose_kernel[grid](
            batched.view(bits),
            out.view(bits),
            rows,
            cols,
            batched.stride(0),
            batched.stride(1),
            rows * cols,
            TILE=_TILE,
            num_warps=8,
        )
    return out if x.dim() == 3 else out[0]
