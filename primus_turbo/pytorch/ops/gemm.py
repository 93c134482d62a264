"""Dense GEMM with autograd: ``gemm(a, b, trans_a, trans_b, out_dtype, fuse_bgrad_accum_pattern)``."""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.custom_op import apply_function, call_op, direct_call_allowed
from primus_turbo.pytorch.core.fused_wgrad import check_fuse_bgrad_accum_pattern, finish_fused_wgrad
from primus_turbo.pytorch.core.validation import check_dtype, check_same_device, check_tensor
from primus_turbo.pytorch.kernels.gemm.gemm_impl import gemm_accum_impl, gemm_call, gemm_impl

__all__ = ["gemm"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _dgrad(grad_out, b, trans_a, trans_b, dtype, run):
    """Gradient of op(a) @ op(b) w.r.t. ``a``, in a's stored layout."""
    if trans_a:
        return run(b, grad_out, trans_b, True, dtype)
    return run(grad_out, b, False, not trans_b, dtype)


def _wgrad_operands(grad_out, a, trans_a, trans_b):
    """(lhs, rhs, trans_lhs, trans_rhs) whose product is the gradient w.r.t. ``b`` in b's stored layout."""
    if trans_b:
        return grad_out, a, True, trans_a
    return a, grad_out, not trans_a, False


class _GemmFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, trans_a, trans_b, out_dtype, accum_pattern):
        ctx.save_for_backward(a, b)
        ctx.trans_a, ctx.trans_b, ctx.accum_pattern = trans_a, trans_b, accum_pattern
        return call_op(gemm_impl, a, b, trans_a, trans_b, out_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        a, b = ctx.saved_tensors
        if grad_out.dtype != a.dtype:
            grad_out = grad_out.to(a.dtype)
        grad_a = grad_b = None
        # one mode check for both GEMMs: the op bodies directly, or both through torch.library
        run = gemm_call if direct_call_allowed(grad_out, a, b) else gemm_impl
        if ctx.needs_input_grad[0]:
            grad_a = _dgrad(grad_out, b, ctx.trans_a, ctx.trans_b, a.dtype, run)
        if ctx.needs_input_grad[1]:
            lhs, rhs, trans_lhs, trans_rhs = _wgrad_operands(grad_out, a, ctx.trans_a, ctx.trans_b)
            if ctx.accum_pattern == "megatron":
                call_op(gemm_accum_impl, lhs, rhs, b.main_grad, trans_lhs, trans_rhs)
                grad_b = finish_fused_wgrad(b)
            else:
                grad_b = run(lhs, rhs, trans_lhs, trans_rhs, b.dtype)
        return grad_a, grad_b, None, None, None, None


def _check_gemm_args(a, b, trans_a, trans_b, out_dtype, fuse_bgrad_accum_pattern) -> torch.dtype:
    check_tensor("a", a, dim=2)
    check_tensor("b", b, dim=2)
    check_dtype("a.dtype", a.dtype, _DTYPES)
    if b.dtype != a.dtype:
        raise TypeError(f"a and b must have the same dtype, got {a.dtype} and {b.dtype}")
    if a.device != b.device:
        check_same_device(a=a, b=b)
    for name, flag in (("trans_a", trans_a), ("trans_b", trans_b)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    k_a = a.shape[0] if trans_a else a.shape[1]
    k_b = b.shape[1] if trans_b else b.shape[0]
    if k_a != k_b:
        raise ValueError(
            f"inner dimensions differ: op(a) is {_op_shape(a, trans_a)} and op(b) is {_op_shape(b, trans_b)}"
        )
    if out_dtype is None:
        out_dtype = a.dtype
    elif out_dtype not in _DTYPES:
        check_dtype("out_dtype", out_dtype, _DTYPES)
    if fuse_bgrad_accum_pattern is not None:
        check_fuse_bgrad_accum_pattern(fuse_bgrad_accum_pattern, b)
    return out_dtype


def _op_shape(t: torch.Tensor, trans: bool) -> tuple[int, int]:
    return (t.shape[1], t.shape[0]) if trans else (t.shape[0], t.shape[1])


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    trans_a: bool = False,
    trans_b: bool = False,
    out_dtype: torch.dtype | None = None,
    fuse_bgrad_accum_pattern: str | None = None,
) -> torch.Tensor:
    """``op(a) @ op(b)`` for 2-D fp16/bf16/fp32 tensors, differentiable in ``a`` and ``b``.

    ``a`` is (M, K), or (K, M) with ``trans_a``; ``b`` is (K, N), or (N, K) with ``trans_b`` (the
    ``nn.Linear`` weight layout). ``out_dtype`` defaults to the input dtype. With
    ``fuse_bgrad_accum_pattern="megatron"`` the gradient of ``b`` is added into ``b.main_grad``
    inside the GEMM, ``b.grad_added_to_main_grad`` is set and autograd receives a dummy gradient,
    as Megatron's gradient-accumulation fusion expects.
    """
    out_dtype = _check_gemm_args(a, b, trans_a, trans_b, out_dtype, fuse_bgrad_accum_pattern)
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return apply_function(_GemmFunction, a, b, trans_a, trans_b, out_dtype, fuse_bgrad_accum_pattern)
    return call_op(gemm_impl, a, b, trans_a, trans_b, out_dtype)
