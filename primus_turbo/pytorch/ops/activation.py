"""Gated activations with autograd: ``swiglu``, ``geglu`` and the MoE variants ``swiglu_with_probs``,
``geglu_with_probs``.

``x`` is [tokens, 2H] (gate half first, then the linear half, as Megatron's fused ``fc1`` output); the
result is ``act(x[:, :H]) * x[:, H:]``, times ``probs[:, None]`` for the MoE variants. ``act`` is SiLU
for SwiGLU and the tanh approximation of GELU for GeGLU. ``row_mask`` (bool [tokens]) marks valid rows:
the others are not computed and get zero output and zero gradients (expert-capacity padding).
"""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.custom_op import apply_function, call_op, direct_call_allowed
from primus_turbo.pytorch.core.low_precision import Float8QuantConfig
from primus_turbo.pytorch.core.validation import check_dtype, check_same_device, check_tensor
from primus_turbo.pytorch.kernels.activation.gated_act_impl import (
    GELU_TANH,
    SILU,
    gated_act_bwd_impl,
    gated_act_fp8_fwd_impl,
    gated_act_fwd_impl,
    gated_act_reference,
    gated_act_uses_triton,
)
from primus_turbo.pytorch.ops.quantization import (
    QuantizedTensor,
    fused_fp8_output,
    fused_fp8_settings,
    grad_anchor,
)

__all__ = ["geglu", "geglu_fp8", "geglu_with_probs", "swiglu", "swiglu_fp8", "swiglu_with_probs"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _gated_backward(ctx, dy) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx, dprobs) from the tensors a gated-activation Function saved."""
    x2d, probs, row_mask = ctx.saved_tensors
    dy2d = dy.reshape(-1, dy.shape[-1])
    dx, dprobs = call_op(gated_act_bwd_impl, dy2d.contiguous(), x2d, probs, row_mask, ctx.act)
    grad_probs = dprobs.to(probs.dtype) if probs is not None and ctx.needs_input_grad[1] else None
    return dx.view(ctx.shape), grad_probs


def _gated_forward(x, probs, row_mask, act) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [..., H], the (rows, 2H) view of ``x`` the kernel read, for backward)."""
    x2d = x.reshape(-1, x.shape[-1])
    x2d = x2d if x2d.stride(-1) == 1 else x2d.contiguous()
    out = call_op(gated_act_fwd_impl, x2d, probs, row_mask, act)
    return out.view(*x.shape[:-1], x.shape[-1] // 2), x2d


class _GatedActFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, probs, row_mask, act):
        out, x2d = _gated_forward(x, probs, row_mask, act)
        ctx.save_for_backward(x2d, probs, row_mask)
        ctx.act, ctx.shape = act, x.shape
        return out

    @staticmethod
    def backward(ctx, dy):
        return (*_gated_backward(ctx, dy), None, None)


class _GatedActFp8Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, probs, row_mask, act, fp8_dtype, granularity, block_size, columnwise):
        x2d = x if x.stride(-1) == 1 else x.contiguous()
        quantized = call_op(
            gated_act_fp8_fwd_impl, x2d, probs, row_mask, act, fp8_dtype, granularity, block_size, columnwise
        )
        ctx.save_for_backward(x2d, probs, row_mask)
        ctx.act, ctx.shape = act, x.shape
        ctx.mark_non_differentiable(*quantized)
        return grad_anchor(quantized[0], x.dtype), *quantized

    @staticmethod
    def backward(ctx, dy, *_):
        return (*_gated_backward(ctx, dy), *(None,) * 6)


def _check(x: torch.Tensor, probs: torch.Tensor | None, row_mask: torch.Tensor | None) -> None:
    check_tensor("x", x)
    if x.dtype not in _DTYPES:
        check_dtype("x.dtype", x.dtype, _DTYPES)
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"x's last dimension must be even ([..., 2H]), got shape {tuple(x.shape)}")
    tokens = x.numel() // max(x.shape[-1], 1)
    if probs is not None:
        check_tensor("probs", probs, dim=1)
        check_dtype("probs.dtype", probs.dtype, _DTYPES)
        check_same_device(x=x, probs=probs)
        if x.dim() != 2 or probs.shape[0] != tokens:
            raise ValueError(
                f"probs must be [tokens] for x [tokens, 2H], got {tuple(probs.shape)} and {tuple(x.shape)}"
            )
    if row_mask is not None:
        check_tensor("row_mask", row_mask, dim=1)
        check_dtype("row_mask.dtype", row_mask.dtype, (torch.bool,))
        check_same_device(x=x, row_mask=row_mask)
        if x.dim() != 2 or row_mask.shape[0] != tokens:
            raise ValueError(f"row_mask must be [tokens] for x [tokens, 2H], got {tuple(row_mask.shape)}")


def _per_row(t: torch.Tensor | None) -> torch.Tensor | None:
    """The kernels read per-row tensors (probs, row_mask) with a unit stride."""
    return t if t is None or t.is_contiguous() else t.contiguous()


def _gated(x, probs, row_mask, act) -> torch.Tensor:
    _check(x, probs, row_mask)
    probs, row_mask = _per_row(probs), _per_row(row_mask)
    if not gated_act_uses_triton(x) and direct_call_allowed(x, probs, row_mask):
        # the TORCH path in eager mode: PyTorch's own autograd of the reference expression costs less host
        # time than a Python Function around the same ops
        return gated_act_reference(x, probs, row_mask, act).to(x.dtype)
    if torch.is_grad_enabled() and (x.requires_grad or (probs is not None and probs.requires_grad)):
        return apply_function(_GatedActFunction, x, probs, row_mask, act)
    return _gated_forward(x, probs, row_mask, act)[0]


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :H]) * x[..., H:]`` for ``x`` [..., 2H]."""
    return _gated(x, None, None, SILU)


def geglu(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x[..., :H]) * x[..., H:]`` for ``x`` [..., 2H]."""
    return _gated(x, None, None, GELU_TANH)


def swiglu_with_probs(
    x: torch.Tensor, probs: torch.Tensor, row_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``silu(a) * b * probs[:, None]`` for ``x = [a, b]`` [tokens, 2H]; gradients reach x and probs."""
    return _gated(x, probs, row_mask, SILU)


def geglu_with_probs(
    x: torch.Tensor, probs: torch.Tensor, row_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``gelu_tanh(a) * b * probs[:, None]`` for ``x = [a, b]`` [tokens, 2H]."""
    return _gated(x, probs, row_mask, GELU_TANH)


def _gated_fp8(x, config, probs, row_mask, act, columnwise) -> QuantizedTensor:
    _check(x, probs, row_mask)
    check_tensor("x", x, dim=2)
    if not isinstance(columnwise, bool):
        raise TypeError(f"columnwise must be a bool, got {columnwise!r}")
    fp8_dtype, granularity, block = fused_fp8_settings(config, "swiglu_fp8/geglu_fp8")
    anchor, *quantized = _GatedActFp8Function.apply(
        x, _per_row(probs), _per_row(row_mask), act, fp8_dtype, granularity, block, columnwise
    )
    return fused_fp8_output(*quantized, config, anchor, columnwise)


def swiglu_fp8(
    x: torch.Tensor,
    config: Float8QuantConfig,
    probs: torch.Tensor | None = None,
    row_mask: torch.Tensor | None = None,
    columnwise: bool = True,
) -> QuantizedTensor:
    """``swiglu`` (``swiglu_with_probs`` when ``probs`` is given) of ``x`` [tokens, 2H] written only in
    FP8, for the next ``gemm_fp8`` (see ``rmsnorm_fp8``): ``data``/``scale_inv`` equal ``quantize_fp8`` of
    the output along H bit for bit, ``data_t``/``scale_inv_t`` (with ``columnwise``) the copy along the
    tokens for the weight gradient, and ``grad_anchor`` carries the output's gradient back."""
    return _gated_fp8(x, config, probs, row_mask, SILU, columnwise)


def geglu_fp8(
    x: torch.Tensor,
    config: Float8QuantConfig,
    probs: torch.Tensor | None = None,
    row_mask: torch.Tensor | None = None,
    columnwise: bool = True,
) -> QuantizedTensor:
    """``geglu`` / ``geglu_with_probs`` written only in FP8, as ``swiglu_fp8``."""
    return _gated_fp8(x, config, probs, row_mask, GELU_TANH, columnwise)
