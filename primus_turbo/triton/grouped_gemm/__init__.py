"""Grouped GEMM kernels (MoE experts)."""

from primus_turbo.triton.grouped_gemm.group_quant_kernel import (
    group_block_layout_triton,
    quantize_fp8_group_blocks_triton,
    quantize_fp8_group_columns_triton,
    token_major_empty,
)
from primus_turbo.triton.grouped_gemm.grouped_gemm_kernel import (
    grouped_fp8_scale_block,
    grouped_fp8_sm90_takes,
    grouped_gemm_fp8_triton,
    grouped_gemm_fp8_variable_k_triton,
    grouped_gemm_triton,
    grouped_gemm_variable_k_triton,
)

__all__ = [
    "group_block_layout_triton",
    "grouped_fp8_scale_block",
    "grouped_fp8_sm90_takes",
    "grouped_gemm_fp8_triton",
    "grouped_gemm_fp8_variable_k_triton",
    "grouped_gemm_triton",
    "grouped_gemm_variable_k_triton",
    "quantize_fp8_group_blocks_triton",
    "quantize_fp8_group_columns_triton",
    "token_major_empty",
]
