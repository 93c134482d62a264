"""Quantization kernels: FP8 with per-group scales, MXFP4."""

from primus_turbo.triton.quantization.fp4_quant_kernel import quantize_fp4_rows_triton
from primus_turbo.triton.quantization.fp8_quant_kernel import (
    quantize_fp8_dual_blocks_triton,
    quantize_fp8_groups_triton,
    tensorwise_cast_fp8_triton,
)

__all__ = [
    "quantize_fp4_rows_triton",
    "quantize_fp8_dual_blocks_triton",
    "quantize_fp8_groups_triton",
    "tensorwise_cast_fp8_triton",
]
