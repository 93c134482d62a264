"""MXFP4 custom ops ``primus_turbo::quantize_fp4`` / ``quantize_fp4_with_trans`` / ``dequantize_fp4``:
the Triton kernel on GPUs (and under the interpreter) and the TORCH reference that defines the
numerics (see ``primus_turbo/triton/quantization/fp4_quant_kernel.py``).

Values are quantized along the last dimension in groups of 32: ``q`` is (..., C / 2) of
``torch.float4_e2m1fn_x2`` (two E2M1 codes per byte, element ``2i`` in the low nibble) and
``scale_inv`` is (..., C / 32) of ``torch.float8_e8m0fnu``.
"""

from __future__ import annotations

import math

import torch

from primus_turbo.pytorch.core.custom_op import custom_op
from primus_turbo.pytorch.kernels.quantization.quantization_impl import e8m0_scales_from_amax
from primus_turbo.triton.quantization import quantize_fp4_rows_triton
from primus_turbo.triton.utils.device_info import triton_runs_on

__all__ = [
    "FP4_DTYPE",
    "dequantize_fp4_impl",
    "dequantize_fp4_reference",
    "quantize_fp4_impl",
    "quantize_fp4_reference",
    "quantize_fp4_with_trans_impl",
]

FP4_DTYPE = getattr(torch, "float4_e2m1fn_x2", torch.uint8)
_GROUP = 32
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_EMAX = 2  # 6 = 1.5 * 2**2


def _codes(v: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (sign bit 8) of fp32 values already divided by their scale, rounded to nearest even."""
    mag = torch.nan_to_num(v.abs(), nan=0.0)
    code = (
        (mag > 0.25).int()
        + (mag >= 0.75).int()
        + (mag > 1.25).int()
        + (mag >= 1.75).int()
        + (mag > 2.5).int()
        + (mag >= 3.5).int()
        + (mag > 5.0).int()
    )
    return torch.where(v < 0, code + 8, code)


def _quantize_2d_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    groups = x.float().reshape(rows, cols // _GROUP, _GROUP)
    multiplier, stored = e8m0_scales_from_amax(groups.abs().amax(dim=-1), _E2M1_EMAX)
    codes = _codes(groups * multiplier[..., None]).reshape(rows, cols)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed, stored


def _quantize_2d(x: torch.Tensor, triton_path: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    if not triton_path:
        packed, scale = _quantize_2d_reference(x)
        return packed.view(FP4_DTYPE), scale
    packed = torch.empty((rows, cols // 2), dtype=torch.uint8, device=x.device)
    scale = torch.empty((rows, cols // _GROUP), dtype=torch.uint8, device=x.device)
    quantize_fp4_rows_triton(x, packed, scale)
    return packed.view(FP4_DTYPE), scale.view(torch.float8_e8m0fnu)


def _use_triton(x: torch.Tensor) -> bool:
    return triton_runs_on(x.device)


def _quantize(x: torch.Tensor, triton_path: bool) -> tuple[torch.Tensor, torch.Tensor]:
    cols = x.shape[-1]
    packed, scale = _quantize_2d(x.reshape(math.prod(x.shape[:-1]), cols), triton_path)
    return packed.view(*x.shape[:-1], cols // 2), scale.view(*x.shape[:-1], cols // _GROUP)


def quantize_fp4_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The TORCH path of ``quantize_fp4`` (the numerics the kernel reproduces bit for bit)."""
    return _quantize(x, triton_path=False)


@custom_op("primus_turbo::quantize_fp4", mutates_args=())
def quantize_fp4_impl(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale_inv)`` of ``x`` along its last dimension."""
    return _quantize(x, _use_triton(x))


@quantize_fp4_impl.register_fake
def _quantize_fp4_fake(x):
    cols = x.shape[-1]
    return (
        x.new_empty((*x.shape[:-1], cols // 2), dtype=FP4_DTYPE),
        x.new_empty((*x.shape[:-1], cols // _GROUP), dtype=torch.float8_e8m0fnu),
    )


@custom_op("primus_turbo::quantize_fp4_with_trans", mutates_args=())
def quantize_fp4_with_trans_impl(
    x: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row-wise ``(q, scale_inv)`` of ``x`` (M, K) and the ones of ``x`` along M, stored as (K, M / 2)."""
    triton_path = _use_triton(x)
    q, scale = _quantize_2d(x, triton_path)
    q_t, scale_t = _quantize_2d(x.t(), triton_path)
    return q, scale, q_t, scale_t


@quantize_fp4_with_trans_impl.register_fake
def _quantize_fp4_with_trans_fake(x):
    m, k = x.shape
    return (
        x.new_empty((m, k // 2), dtype=FP4_DTYPE),
        x.new_empty((m, k // _GROUP), dtype=torch.float8_e8m0fnu),
        x.new_empty((k, m // 2), dtype=FP4_DTYPE),
        x.new_empty((k, m // _GROUP), dtype=torch.float8_e8m0fnu),
    )


def dequantize_fp4_reference(
    q: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """Unpack the E2M1 pairs and multiply by the group scales; exact in bf16 and fp32."""
    codes = q.view(torch.uint8)
    nibbles = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2).long()
    table = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=q.device)
    values = table[nibbles & 7] * torch.where(nibbles >= 8, -1.0, 1.0)
    scale = scale_inv.float().repeat_interleave(_GROUP, dim=-1)
    return (values * scale).to(out_dtype)


@custom_op("primus_turbo::dequantize_fp4", mutates_args=())
def dequantize_fp4_impl(q: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``q * scale_inv`` with (..., 2 * q.shape[-1]) elements in ``out_dtype``."""
    return dequantize_fp4_reference(q, scale_inv, out_dtype)


@dequantize_fp4_impl.register_fake
def _dequantize_fp4_fake(q, scale_inv, out_dtype):
    return q.new_empty((*q.shape[:-1], 2 * q.shape[-1]), dtype=out_dtype)
