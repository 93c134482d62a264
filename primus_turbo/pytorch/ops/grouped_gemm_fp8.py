"""FP8 grouped GEMM with autograd:
``grouped_gemm_fp8(a, b, group_lens, group_offs, trans_b, out_dtype, config, fuse_bgrad_accum_pattern)``.

Scaling per granularity (``Format.HYBRID``: E4M3 forward operands, E5M2 gradients):

- TENSORWISE: one scale for the tokens (``a``, the gradient), one per expert weight; wgrad reuses them.
- ROWWISE: one scale per token row along the reduction dimension; expert weights per row along K
  (forward) or N (dgrad); the wgrad operands get one scale per (group, column) over the group's
  tokens (``quantize_fp8_group_columns``).

Block scaling is not offered for grouped GEMM yet.
"""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.custom_op import call_op
from primus_turbo.pytorch.core.fused_wgrad import check_fuse_bgrad_accum_pattern, finish_fused_wgrad
from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, ScalingGranularity, fp8_dtype_for
from primus_turbo.pytorch.core.validation import check_dtype
from primus_turbo.pytorch.kernels.grouped_gemm.group_offs_impl import compute_group_offs
from primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_fp8_impl import (
    grouped_gemm_fp8_impl,
    grouped_gemm_fp8_variable_k_impl,
    quantize_fp8_group_columns_impl,
)
from primus_turbo.pytorch.ops.grouped_gemm import check_grouped_args
from primus_turbo.pytorch.ops.quantization import quantize_fp8

__all__ = ["grouped_gemm_fp8"]

_G = ScalingGranularity
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _quantize_tokens(x: torch.Tensor, dtype: torch.dtype, granularity: ScalingGranularity):
    """Token-major operand [T, C] along C: one scale, or one per row ([T, 1])."""
    axis = None if granularity is _G.TENSORWISE else 1
    return quantize_fp8(x, dtype, granularity, axis=axis)


def _quantize_experts(b: torch.Tensor, dtype: torch.dtype, granularity: ScalingGranularity, axis: int):
    """Expert weights [G, X, Y]: one scale per expert ([G, 1, 1]), or per row along ``axis``."""
    if granularity is _G.TENSORWISE:
        q, scale = quantize_fp8(b.reshape(b.shape[0], -1), dtype, _G.ROWWISE, axis=1)
        return q.view(b.shape), scale.view(-1, 1, 1)
    return quantize_fp8(b, dtype, _G.ROWWISE, axis=axis)


class _GroupedGemmFp8Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, group_offs, trans_b, out_dtype, config, accum_pattern):
        gran = config.granularity
        fwd_dtype = fp8_dtype_for(config.format, is_forward=True)
        qa, sa = _quantize_tokens(a, fwd_dtype, gran)
        k_axis = 2 if trans_b else 1  # b is [G, N, K] with trans_b, else [G, K, N]
        qb, sb = _quantize_experts(b, fwd_dtype, gran, k_axis)
        out = call_op(grouped_gemm_fp8_impl, qa, sa, qb, sb, group_offs, trans_b, out_dtype)
        ctx.save_for_backward(a, b, group_offs, qa, sa, qb, sb)
        ctx.trans_b, ctx.config, ctx.accum_pattern = trans_b, config, accum_pattern
        return out

    @staticmethod
    def backward(ctx, grad_out):
        a, b, group_offs, qa, sa, qb, sb = ctx.saved_tensors
        config, trans_b = ctx.config, ctx.trans_b
        gran = config.granularity
        grad_dtype = fp8_dtype_for(config.format, is_forward=False)
        fwd_dtype = fp8_dtype_for(config.format, is_forward=True)
        grad_out = grad_out.contiguous()
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            qg, sg = _quantize_tokens(grad_out, grad_dtype, gran)
            if gran is _G.ROWWISE:  # the weights along N for dgrad
                qb, sb = _quantize_experts(b, fwd_dtype, gran, 1 if trans_b else 2)
            grad_a = call_op(grouped_gemm_fp8_impl, qg, sg, qb, sb, group_offs, not trans_b, a.dtype)
        if ctx.needs_input_grad[1]:
            if gran is _G.TENSORWISE:
                qg_t, sg_t = _quantize_tokens(grad_out, grad_dtype, gran)
                qa_t, sa_t = qa, sa
            else:
                qg_t, sg_t = call_op(quantize_fp8_group_columns_impl, grad_out, group_offs, grad_dtype)
                qa_t, sa_t = call_op(quantize_fp8_group_columns_impl, a, group_offs, fwd_dtype)
            # [G, N, K] = per group dy^T a for the transposed layout, else [G, K, N] = a^T dy
            operands = (qg_t, sg_t, qa_t, sa_t) if trans_b else (qa_t, sa_t, qg_t, sg_t)
            if ctx.accum_pattern == "megatron":
                result = call_op(grouped_gemm_fp8_variable_k_impl, *operands, group_offs, torch.float32)
                b.main_grad.add_(result)
                grad_b = finish_fused_wgrad(b)
            else:
                grad_b = call_op(grouped_gemm_fp8_variable_k_impl, *operands, group_offs, b.dtype)
        return grad_a, grad_b, None, None, None, None, None


def grouped_gemm_fp8(
    a: torch.Tensor,
    b: torch.Tensor,
    group_lens: torch.Tensor,
    group_offs: torch.Tensor | None = None,
    trans_b: bool = False,
    out_dtype: torch.dtype | None = None,
    config: Float8QuantConfig | None = None,
    fuse_bgrad_accum_pattern: str | None = None,
) -> torch.Tensor:
    """``grouped_gemm`` with FP8 operands (TENSORWISE or ROWWISE ``config``, default tensorwise E4M3),
    differentiable in ``a`` and ``b``; ``out_dtype`` defaults to ``a``'s dtype."""
    config = Float8QuantConfig() if config is None else config
    if not isinstance(config, Float8QuantConfig):
        raise TypeError(f"config must be a Float8QuantConfig, got {config!r}")
    if config.granularity not in (_G.TENSORWISE, _G.ROWWISE):
        raise ValueError(
            f"grouped_gemm_fp8 takes TENSORWISE or ROWWISE scaling, not {config.granularity.name}"
        )
    check_grouped_args(a, b, group_lens, trans_b)
    check_fuse_bgrad_accum_pattern(fuse_bgrad_accum_pattern, b)
    out_dtype = a.dtype if out_dtype is None else out_dtype
    check_dtype("out_dtype", out_dtype, _DTYPES)
    group_offs = compute_group_offs(group_lens) if group_offs is None else group_offs
    a = a if a.stride(-1) == 1 else a.contiguous()
    return _GroupedGemmFp8Function.apply(
        a, b, group_offs, trans_b, out_dtype, config, fuse_bgrad_accum_pattern
    )
