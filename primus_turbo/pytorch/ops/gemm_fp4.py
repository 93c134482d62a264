"""MXFP4 GEMM with autograd: ``gemm_fp4(a, b, trans_a, trans_b, out_dtype, config, ...)``.

The same NT arrangement as ``gemm_fp8``: each operand is quantized along the reduction dimension of
the GEMM that reads it (``quantize_fp4_with_trans`` makes both copies at once), forward, dgrad and
wgrad. Hopper has no FP4 tensor cores: the GEMM runs on exactly dequantized bf16 operands, so this op
gives MXFP4 numerics everywhere and FP4 speed nowhere yet.
"""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.custom_op import call_op
from primus_turbo.pytorch.core.fused_wgrad import check_fuse_bgrad_accum_pattern, finish_fused_wgrad
from primus_turbo.pytorch.core.low_precision import Float4QuantConfig
from primus_turbo.pytorch.core.validation import check_dtype, check_same_device, check_tensor
from primus_turbo.pytorch.kernels.gemm.gemm_fp4_impl import gemm_fp4_accum_impl, gemm_fp4_impl
from primus_turbo.pytorch.ops.quantization import quantize_fp4, quantize_fp4_with_trans

__all__ = ["gemm_fp4"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MX_BLOCK = 32


def _quantize(x: torch.Tensor, other: bool):
    """(q, scale, q_other, scale_other) of a logical (rows, K) operand; the other copy along rows."""
    if other:
        return quantize_fp4_with_trans(x)
    return (*quantize_fp4(x), None, None)


class _GemmFp4Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, trans_a, trans_b, out_dtype, accum_pattern):
        need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        qa, sa, qa_t, sa_t = _quantize(a.t() if trans_a else a, other=need_b)
        qb, sb, qb_t, sb_t = _quantize(b if trans_b else b.t(), other=need_a)
        ctx.save_for_backward(qa_t, sa_t, qb_t, sb_t, b if accum_pattern == "megatron" else None)
        ctx.trans_a, ctx.trans_b, ctx.accum_pattern = trans_a, trans_b, accum_pattern
        ctx.a_dtype, ctx.b_dtype = a.dtype, b.dtype
        return call_op(gemm_fp4_impl, qa, sa, qb, sb, out_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        qa_t, sa_t, qb_t, sb_t, b = ctx.saved_tensors
        need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        qg, sg, qg_t, sg_t = _quantize(grad_out, other=need_b)
        grad_a = grad_b = None
        if need_a:
            if ctx.trans_a:
                grad_a = call_op(gemm_fp4_impl, qb_t, sb_t, qg, sg, ctx.a_dtype)
            else:
                grad_a = call_op(gemm_fp4_impl, qg, sg, qb_t, sb_t, ctx.a_dtype)
        if need_b:
            lhs, rhs = ((qg_t, sg_t), (qa_t, sa_t)) if ctx.trans_b else ((qa_t, sa_t), (qg_t, sg_t))
            if ctx.accum_pattern == "megatron":
                call_op(gemm_fp4_accum_impl, *lhs, *rhs, b.main_grad)
                grad_b = finish_fused_wgrad(b)
            else:
                grad_b = call_op(gemm_fp4_impl, *lhs, *rhs, ctx.b_dtype)
        return grad_a, grad_b, None, None, None, None


def gemm_fp4(
    a: torch.Tensor,
    b: torch.Tensor,
    trans_a: bool = False,
    trans_b: bool = False,
    out_dtype: torch.dtype | None = None,
    config: Float4QuantConfig | None = None,
    fuse_bgrad_accum_pattern: str | None = None,
) -> torch.Tensor:
    """``op(a) @ op(b)`` with MXFP4 operands (E2M1, E8M0 scales per 32 along the reduction dimension).

    Layouts as ``gemm``; M, N and K must be multiples of 32. ``config`` defaults to
    ``Float4QuantConfig()``; stochastic rounding of gradients and scale preshuffling are not offered.
    """
    config = Float4QuantConfig() if config is None else config
    if not isinstance(config, Float4QuantConfig):
        raise TypeError(f"config must be a Float4QuantConfig, got {config!r}")
    if config.use_gradient_sr or config.use_preshuffle:
        raise ValueError("gemm_fp4 does not offer gradient stochastic rounding or scale preshuffling")
    for name, x in (("a", a), ("b", b)):
        check_tensor(name, x, dim=2)
        check_dtype(f"{name}.dtype", x.dtype, _DTYPES)
    check_same_device(a=a, b=b)
    for name, flag in (("trans_a", trans_a), ("trans_b", trans_b)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    m, k = (a.shape[1], a.shape[0]) if trans_a else a.shape
    k_b, n = (b.shape[1], b.shape[0]) if trans_b else b.shape
    if k != k_b:
        raise ValueError(f"inner dimensions differ: op(a) is ({m}, {k}) and op(b) is ({k_b}, {n})")
    if m % _MX_BLOCK or n % _MX_BLOCK or k % _MX_BLOCK:
        raise ValueError(f"gemm_fp4 needs M, N and K to be multiples of 32, got ({m}, {n}, {k})")
    out_dtype = a.dtype if out_dtype is None else out_dtype
    check_dtype("out_dtype", out_dtype, _DTYPES)
    check_fuse_bgrad_accum_pattern(fuse_bgrad_accum_pattern, b)
    return _GemmFp4Function.apply(a, b, trans_a, trans_b, out_dtype, fuse_bgrad_accum_pattern)
