"""Quantization kernels: FP8 with per-group scales, the FP8 output stage of fused producers, MXFP4."""

from primus_turbo.triton.quantization.fp4_quant_kernel import quantize_fp4_rows_triton
from primus_turbo.triton.quantization.fp8_emit import EMIT_BLOCK, EMIT_ROW, EMIT_TENSOR
from primus_turbo.triton.quantization.fp8_quant_kernel import (
    quantize_fp8_dual_blocks_triton,
    quantize_fp8_groups_triton,
    quantize_fp8_with_trans_tiles_triton,
    tensorwise_cast_fp8_triton,
)

__all__ = [
    "EMIT_BLOCK",
    "EMIT_ROW",
    "EMIT_TENSOR",
    "quantize_fp4_rows_triton",
    "quantize_fp8_dual_blocks_triton",
    "quantize_fp8_groups_triton",
    "quantize_fp8_with_trans_tiles_triton",
    "tensorwise_cast_fp8_triton",
]
