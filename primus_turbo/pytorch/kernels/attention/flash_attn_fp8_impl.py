"""FP8 flash attention forward ``primus_turbo::flash_attn_fp8_fwd``.

q, k and v are quantized to E4M3 with one scale per head and ``FP8_BLOCK``-token block (the kernel's tiles
divide it, so each tile multiplies by one scalar), and both products (Q K^T and P V) run on FP8 operands;
v is quantized sequence-contiguous, the operand order FP8 tensor cores take for P V. Where Triton cannot
run, the same quantized values (``quantize_attention_blocks``) are multiplied by the fp32 math backend.
The backward (in ``ops``) is the high-precision one on the saved bf16/fp16 inputs.
"""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.custom_op import custom_op
from primus_turbo.pytorch.core.low_precision import float8_e4m3
from primus_turbo.pytorch.kernels.attention.flash_attn_impl import TorchAttentionBackend, empty_in_layout
from primus_turbo.pytorch.kernels.quantization.quantization_impl import fp8_triton_usable
from primus_turbo.triton.attention import FP8_BLOCK, flash_attn_fwd_triton, quantize_attention_blocks_triton

__all__ = ["flash_attn_fp8_fwd_impl", "quantize_attention_blocks"]


def quantize_attention_blocks(x: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 ``x`` in x's layout, fp32 scale_inv [B, H, ceil(S / block)]) for a logical [B, S, H, D] ``x``:
    one scale per head and ``block`` tokens (amax / E4M3 max; 1 for an all-zero block)."""
    b, s, h, d = x.shape
    blocks = -(-s // block)
    padded = torch.nn.functional.pad(x.float(), (0, 0, 0, 0, 0, blocks * block - s))
    amax = padded.unflatten(1, (blocks, block)).abs().amax(dim=(2, 4))  # [B, blocks, H]
    scale_inv = torch.where(amax > 0, amax / torch.finfo(float8_e4m3).max, torch.ones_like(amax))
    scale_inv = scale_inv.permute(0, 2, 1).contiguous()
    quantized = empty_in_layout(x, x.shape, float8_e4m3)
    quantized.copy_(x.float() / _per_token(scale_inv, block, s))
    return quantized, scale_inv


def _per_token(scale_inv: torch.Tensor, block: int, tokens: int) -> torch.Tensor:
    """[B, H, blocks] block scales as [B, tokens, H, 1], each repeated over its block's tokens."""
    return scale_inv.permute(0, 2, 1).repeat_interleave(block, dim=1)[:, :tokens, :, None]


def _dequantize(x8: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    return x8.float() * _per_token(scale_inv, block, x8.shape[1])


@custom_op("primus_turbo::flash_attn_fp8_fwd", mutates_args=())
def flash_attn_fp8_fwd_impl(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, left: int, right: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, Sq, Hq, Dv] in q's layout and dtype, lse fp32 [B, Hq, Sq]) from block-quantized q, k, v."""
    out = empty_in_layout(q, (*q.shape[:3], v.shape[3]))
    if fp8_triton_usable(q, float8_e4m3):
        (q8, q_scale), (k8, k_scale) = (quantize_attention_blocks_triton(t, float8_e4m3) for t in (q, k))
        v8, v_scale = quantize_attention_blocks_triton(v, float8_e4m3, seq_contiguous=True)
        scales = (q_scale, k_scale, v_scale)
        lse = flash_attn_fwd_triton(q8, k8, v8, None, scale, left, right, out, None, scales)
        return out, lse
    q32, k32, v32 = (_dequantize(*quantize_attention_blocks(t)) for t in (q, k, v))
    return out, TorchAttentionBackend.forward(q32, k32, v32, None, scale, left, right, out)


@flash_attn_fp8_fwd_impl.register_fake
def _flash_attn_fp8_fwd_fake(q, k, v, scale, left, right):
    out = empty_in_layout(q, (*q.shape[:3], v.shape[3]))
    return out, q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
