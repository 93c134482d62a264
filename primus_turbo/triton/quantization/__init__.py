"""Quantization kernels (FP8 with per-group scales)."""

from primus_turbo.triton.quantization.fp8_quant_kernel import (
    quantize_fp8_groups_triton,
    scale_cast_fp8_triton,
)

__all__ = ["quantize_fp8_groups_triton", "scale_cast_fp8_triton"]
