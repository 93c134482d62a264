"""Public operators: ``primus_turbo.pytorch.ops.<op>``."""

from primus_turbo.pytorch.ops.activation import (
    geglu,
    geglu_fp8,
    geglu_with_probs,
    swiglu,
    swiglu_fp8,
    swiglu_with_probs,
)
from primus_turbo.pytorch.ops.async_tp import (
    fused_all_gather_matmul,
    fused_all_gather_scaled_matmul,
    fused_matmul_reduce_scatter,
)
from primus_turbo.pytorch.ops.attention import flash_attn_fp8_func, flash_attn_func, flash_attn_varlen_func
from primus_turbo.pytorch.ops.fp8_primary import Fp8PrimaryWeight, adamw_fp8_step_
from primus_turbo.pytorch.ops.gemm import gemm
from primus_turbo.pytorch.ops.gemm_fp4 import gemm_fp4
from primus_turbo.pytorch.ops.gemm_fp8 import gemm_fp8, quantize_fp8_weight
from primus_turbo.pytorch.ops.grouped_gemm import grouped_gemm
from primus_turbo.pytorch.ops.grouped_gemm_fp8 import QuantizedExperts, grouped_gemm_fp8, quantize_fp8_experts
from primus_turbo.pytorch.ops.moe import (
    fused_group_topk_routing_with_aux_score,
    moe_combine,
    moe_dispatch,
    moe_permute,
    moe_unpermute,
    tokens_per_expert_to_mask,
)
from primus_turbo.pytorch.ops.normalization import rmsnorm, rmsnorm_fp8, rmsnorm_residual
from primus_turbo.pytorch.ops.quantization import (
    QuantizedTensor,
    dequantize_fp4,
    dequantize_fp8,
    quantize_fp4,
    quantize_fp4_with_trans,
    quantize_fp8,
    quantize_fp8_with_trans,
)

__all__ = [
    "Fp8PrimaryWeight",
    "QuantizedExperts",
    "QuantizedTensor",
    "adamw_fp8_step_",
    "dequantize_fp4",
    "dequantize_fp8",
    "flash_attn_fp8_func",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "fused_all_gather_matmul",
    "fused_all_gather_scaled_matmul",
    "fused_group_topk_routing_with_aux_score",
    "fused_matmul_reduce_scatter",
    "geglu",
    "geglu_fp8",
    "geglu_with_probs",
    "gemm",
    "gemm_fp4",
    "gemm_fp8",
    "grouped_gemm",
    "grouped_gemm_fp8",
    "quantize_fp8_experts",
    "moe_combine",
    "moe_dispatch",
    "moe_permute",
    "moe_unpermute",
    "quantize_fp4",
    "quantize_fp4_with_trans",
    "quantize_fp8",
    "quantize_fp8_weight",
    "quantize_fp8_with_trans",
    "rmsnorm",
    "rmsnorm_fp8",
    "rmsnorm_residual",
    "swiglu",
    "swiglu_fp8",
    "swiglu_with_probs",
    "tokens_per_expert_to_mask",
]
