"""FP8 flash attention with autograd: ``flash_attn_fp8_func``."""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.backend import BackendType
from primus_turbo.pytorch.core.custom_op import call_op
from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, Format, ScalingGranularity
from primus_turbo.pytorch.kernels.attention.flash_attn_fp8_impl import flash_attn_fp8_fwd_impl
from primus_turbo.pytorch.kernels.attention.flash_attn_impl import (
    flash_attn_bwd_impl,
    package_attention,
    resolve_attention_backend,
)
from primus_turbo.pytorch.ops.attention.flash_attn import check_attention_args, kernel_grad, window_bounds
from primus_turbo.triton.attention import FP8_BLOCK

__all__ = ["flash_attn_fp8_func"]

DEFAULT_FP8_CONFIG = Float8QuantConfig(granularity=ScalingGranularity.BLOCKWISE, block_size=FP8_BLOCK)


class _FlashAttnFp8Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, left, right, backward_backend):
        out, lse = call_op(flash_attn_fp8_fwd_impl, q, k, v, scale, left, right)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.window, ctx.backend = scale, (left, right), backward_backend
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        grad_out = kernel_grad(grad_out, q.dtype)
        args = (grad_out, q, k, v, out, lse, None, ctx.scale, *ctx.window, ctx.backend)
        dq, dk, dv, _ = call_op(flash_attn_bwd_impl, *args)
        return dq, dk, dv, None, None, None, None


def _check_config(config: Float8QuantConfig | None) -> None:
    if config is None:
        return
    if not isinstance(config, Float8QuantConfig):
        raise TypeError(f"fp8_config must be a Float8QuantConfig, got {type(config).__name__}")
    if (
        config.granularity is not ScalingGranularity.BLOCKWISE
        or config.block_size != FP8_BLOCK
        or config.format not in (Format.E4M3, Format.HYBRID)
    ):
        raise ValueError(
            f"FP8 attention takes E4M3 (or HYBRID) BLOCKWISE scaling with block_size {FP8_BLOCK} "
            f"(one scale per head and {FP8_BLOCK} tokens), got {config}"
        )


def flash_attn_fp8_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    deterministic: bool = False,
    return_lse: bool = False,
    fp8_config: Float8QuantConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``flash_attn_func`` whose forward multiplies E4M3 operands: q, k and v (bf16/fp16, any of the
    bshd / sbhd / bhsd layouts) are quantized with one scale per head and 128-token block, Q K^T and P V
    run on FP8 tensor cores, and the output is in the inputs' dtype. The backward is the high-precision
    one on the original q, k, v (the forward's output and log-sum-exp stand in for the exact ones), so
    gradients are as good as the FP8 forward allows. ``fp8_config`` may only restate that recipe
    (BLOCKWISE, block 128).
    """
    _check_config(fp8_config)
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"FP8 attention quantizes fp16 or bf16 inputs, got {q.dtype}")
    scale = check_attention_args(q, k, v, 0.0, softmax_scale, None)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    left, right = window_bounds(causal, window_size, q.shape[1], k.shape[1])
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        backend = resolve_attention_backend(q, k, v, None, scale, left, right)
        if package_attention(backend) is not None:  # an external package has no lse-based backward here
            backend = BackendType.TRITON.name
        out, lse = _FlashAttnFp8Function.apply(q, k, v, scale, left, right, backend)
    else:
        out, lse = call_op(flash_attn_fp8_fwd_impl, q, k, v, scale, left, right)
    return (out, lse) if return_lse else out
