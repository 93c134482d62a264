"""RMSNorm with autograd: ``rmsnorm(x, gamma, eps, zero_centered)`` and the fused residual variant
``rmsnorm_residual(x, residual, gamma, eps, zero_centered) -> (y, x + residual)``.

Normalization runs over the last dimension in fp32; outputs keep ``x``'s dtype. ``zero_centered``
stores the weight as an offset from 1 (``w = 1 + gamma``), as Megatron's ``apply_layernorm_1p`` does.
Rows may be strided (a slice of a wider tensor) without a copy as long as the last dimension is
contiguous.
"""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.custom_op import apply_function, call_op
from primus_turbo.pytorch.core.low_precision import Float8QuantConfig
from primus_turbo.pytorch.core.validation import check_dtype, check_same_device, check_tensor
from primus_turbo.pytorch.kernels.normalization.rmsnorm_impl import (
    rmsnorm_bwd_impl,
    rmsnorm_fp8_fwd_impl,
    rmsnorm_fwd_impl,
    rmsnorm_residual_fwd_impl,
)
from primus_turbo.pytorch.ops.quantization import (
    QuantizedTensor,
    fused_fp8_output,
    fused_fp8_settings,
    grad_anchor,
)

__all__ = ["rmsnorm", "rmsnorm_fp8", "rmsnorm_residual"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(rows, H) view of ``x`` with a unit column stride (a copy only when no such view exists)."""
    x2d = x.reshape(-1, x.shape[-1])
    return x2d if x2d.stride(-1) == 1 else x2d.contiguous()


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, eps, zero_centered):
        x2d = _rows(x)
        y, rstd = call_op(rmsnorm_fwd_impl, x2d, gamma, eps, zero_centered)
        ctx.save_for_backward(x2d, gamma, rstd)
        ctx.zero_centered = zero_centered
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2d, gamma, rstd = ctx.saved_tensors
        dx, dgamma = call_op(rmsnorm_bwd_impl, _rows(dy), x2d, gamma, rstd, ctx.zero_centered)
        return dx.view(dy.shape), dgamma, None, None


class _RMSNormFp8Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, eps, zero_centered, fp8_dtype, granularity, block_size, columnwise):
        x2d = _rows(x)
        rstd, *quantized = call_op(
            rmsnorm_fp8_fwd_impl,
            x2d,
            gamma,
            eps,
            zero_centered,
            fp8_dtype,
            granularity,
            block_size,
            columnwise,
        )
        ctx.save_for_backward(x2d, gamma, rstd)
        ctx.zero_centered = zero_centered
        ctx.mark_non_differentiable(*quantized)
        return grad_anchor(quantized[0], x.dtype), *quantized

    @staticmethod
    def backward(ctx, dy, *_):
        x2d, gamma, rstd = ctx.saved_tensors
        dx, dgamma = call_op(rmsnorm_bwd_impl, _rows(dy), x2d, gamma, rstd, ctx.zero_centered)
        return dx.view(dy.shape), dgamma, *(None,) * 6


class _RMSNormResidualFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, gamma, eps, zero_centered):
        y, s, rstd = call_op(rmsnorm_residual_fwd_impl, _rows(x), _rows(residual), gamma, eps, zero_centered)
        ctx.save_for_backward(s, gamma, rstd)
        ctx.zero_centered = zero_centered
        # an unused output's gradient stays None instead of a tensor of zeros read back in full
        ctx.set_materialize_grads(False)
        return y.view(x.shape), s.view(x.shape)

    @staticmethod
    def backward(ctx, dy, ds):
        s, gamma, rstd = ctx.saved_tensors
        if dy is None:
            return ds, ds, None, None, None
        ds2d = _rows(ds) if ds is not None else None
        dx, dgamma = call_op(rmsnorm_bwd_impl, _rows(dy), s, gamma, rstd, ctx.zero_centered, ds2d)
        dx = dx.view(dy.shape)
        return dx, dx, dgamma, None, None


def _check(x: torch.Tensor, gamma: torch.Tensor, eps: float, zero_centered: bool) -> None:
    check_tensor("x", x)
    check_tensor("gamma", gamma, dim=1)
    if x.dtype not in _DTYPES:
        check_dtype("x.dtype", x.dtype, _DTYPES)
    if gamma.dtype not in _DTYPES:
        check_dtype("gamma.dtype", gamma.dtype, _DTYPES)
    if x.device != gamma.device:
        check_same_device(x=x, gamma=gamma)
    if x.dim() == 0 or x.shape[-1] != gamma.shape[0]:
        raise ValueError(
            f"gamma has {gamma.shape[0]} elements but x's last dimension is {tuple(x.shape)[-1:]}"
        )
    if not isinstance(eps, float) or eps < 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    if not isinstance(zero_centered, bool):
        raise TypeError(f"zero_centered must be a bool, got {zero_centered!r}")


def rmsnorm(
    x: torch.Tensor, gamma: torch.Tensor, eps: float = 1e-6, zero_centered: bool = False
) -> torch.Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * w`` with ``w = gamma`` (or ``1 + gamma``), differentiable in
    ``x`` and ``gamma``; any leading shape."""
    _check(x, gamma, eps, zero_centered)
    gamma = gamma if gamma.is_contiguous() else gamma.contiguous()
    if torch.is_grad_enabled() and (x.requires_grad or gamma.requires_grad):
        return apply_function(_RMSNormFunction, x, gamma, eps, zero_centered)
    return call_op(rmsnorm_fwd_impl, _rows(x), gamma, eps, zero_centered)[0].view(x.shape)


def rmsnorm_residual(
    x: torch.Tensor,
    residual: torch.Tensor,
    gamma: torch.Tensor,
    eps: float = 1e-6,
    zero_centered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(x + residual), x + residual)`` in one pass over memory (the pre-norm residual stream)."""
    _check(x, gamma, eps, zero_centered)
    check_tensor("residual", residual)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual must match x: got {tuple(residual.shape)} {residual.dtype}, "
            f"x is {tuple(x.shape)} {x.dtype}"
        )
    if residual.device != x.device:
        check_same_device(x=x, residual=residual)
    gamma = gamma if gamma.is_contiguous() else gamma.contiguous()
    if torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad or gamma.requires_grad):
        return apply_function(_RMSNormResidualFunction, x, residual, gamma, eps, zero_centered)
    y, s, _ = call_op(rmsnorm_residual_fwd_impl, _rows(x), _rows(residual), gamma, eps, zero_centered)
    return y.view(x.shape), s.view(x.shape)


def rmsnorm_fp8(
    x: torch.Tensor,
    gamma: torch.Tensor,
    config: Float8QuantConfig,
    eps: float = 1e-6,
    zero_centered: bool = False,
    columnwise: bool = True,
) -> QuantizedTensor:
    """``rmsnorm`` of a 2-D ``x`` [tokens, H] written only in FP8, ready to be ``gemm_fp8``'s activation.

    ``data``/``scale_inv`` equal ``quantize_fp8`` of the normalized output along H bit for bit
    (tensorwise, per row, or 1 x ``block_size`` blocks; E4M3 for the forward operand under HYBRID);
    with ``columnwise`` (the default) ``data_t``/``scale_inv_t`` hold the copy along the tokens that
    ``gemm_fp8``'s weight gradient reads, as ``quantize_fp8_with_trans`` makes it. No bf16 output is
    written: the result's ``grad_anchor`` carries the gradient back through the norm. Pass
    ``columnwise=False`` when the weight needs no gradient.
    """
    _check(x, gamma, eps, zero_centered)
    check_tensor("x", x, dim=2)
    if not isinstance(columnwise, bool):
        raise TypeError(f"columnwise must be a bool, got {columnwise!r}")
    fp8_dtype, granularity, block = fused_fp8_settings(config, "rmsnorm_fp8")
    anchor, *quantized = _RMSNormFp8Function.apply(
        x, gamma.contiguous(), eps, zero_centered, fp8_dtype, granularity, block, columnwise
    )
    return fused_fp8_output(*quantized, config, anchor, columnwise)
