"""Attention operators."""

from primus_turbo.pytorch.ops.attention.flash_attn import flash_attn_func, flash_attn_varlen_func
from primus_turbo.pytorch.ops.attention.flash_attn_fp8 import flash_attn_fp8_func

__all__ = ["flash_attn_fp8_func", "flash_attn_func", "flash_attn_varlen_func"]
