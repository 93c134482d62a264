"""Flash attention kernels."""

from primus_turbo.triton.attention.flash_attn_kernel import (
    FP8_BLOCK,
    MAX_HEAD_DIM,
    Varlen,
    flash_attn_bwd_triton,
    flash_attn_fwd_triton,
)
from primus_turbo.triton.attention.fp8_quant_kernel import quantize_attention_blocks_triton

__all__ = [
    "FP8_BLOCK",
    "MAX_HEAD_DIM",
    "Varlen",
    "flash_attn_bwd_triton",
    "flash_attn_fwd_triton",
    "quantize_attention_blocks_triton",
]
