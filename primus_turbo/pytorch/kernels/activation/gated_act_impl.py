"""Gated-activation custom ops ``primus_turbo::gated_act_fwd`` / ``gated_act_bwd`` on 2-D (rows, 2H)
inputs: the Triton kernels on GPUs (and under the interpreter), the TORCH reference elsewhere.

``act`` is 0 for SiLU (SwiGLU) and 1 for tanh-approximated GELU (GeGLU); ``probs`` and ``row_mask`` are
optional per-row tensors (routing probabilities, valid rows).
"""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.custom_op import custom_op
from primus_turbo.pytorch.kernels.quantization.dual_block_cuda import (
    PRODUCER_GATED,
    dual_block_cuda,
    dual_block_cuda_usable,
)
from primus_turbo.pytorch.kernels.quantization.quantization_impl import (
    EMIT_MODES,
    fp8_producer_empty,
    fp8_producer_reference,
    fp8_triton_usable,
)
from primus_turbo.triton.activation import (
    GELU_TANH,
    SILU,
    gated_act_bwd_triton,
    gated_act_fp8_triton,
    gated_act_fwd_triton,
)
from primus_turbo.triton.quantization import EMIT_BLOCK
from primus_turbo.triton.utils.device_info import triton_runs_on

__all__ = [
    "GELU_TANH",
    "SILU",
    "gated_act_bwd_impl",
    "gated_act_fp8_fwd_impl",
    "gated_act_fwd_impl",
    "gated_act_reference",
    "gated_act_uses_triton",
]


def gated_act_uses_triton(x: torch.Tensor) -> bool:
    """Whether the gated-activation ops run the Triton kernels on ``x`` (else the TORCH reference)."""
    return triton_runs_on(x.device)


def _act(a: torch.Tensor, act: int) -> torch.Tensor:
    if act == SILU:
        return torch.nn.functional.silu(a)
    return torch.nn.functional.gelu(a, approximate="tanh")


def _act_backward(grad: torch.Tensor, a: torch.Tensor, act: int) -> torch.Tensor:
    """``grad * d act(a) / da`` (ATen's fused SiLU / tanh-GELU derivatives)."""
    if act == SILU:
        return torch.ops.aten.silu_backward(grad, a)
    return torch.ops.aten.gelu_backward(grad, a, approximate="tanh")


def gated_act_reference(
    x: torch.Tensor, probs: torch.Tensor | None, row_mask: torch.Tensor | None, act: int
) -> torch.Tensor:
    """``act(a) * b (* probs)`` in fp32 from ``x = [a, b]``, zero on masked rows (differentiable)."""
    a, b = x.float().chunk(2, dim=-1)
    out = _act(a, act) * b
    if probs is not None:
        out = out * probs.float()[:, None]
    if row_mask is not None:
        out = out * row_mask[:, None]
    return out


@custom_op("primus_turbo::gated_act_fwd", mutates_args=())
def gated_act_fwd_impl(
    x: torch.Tensor, probs: torch.Tensor | None, row_mask: torch.Tensor | None, act: int
) -> torch.Tensor:
    """``act(x[:, :H]) * x[:, H:] (* probs)`` as a (rows, H) tensor of x's dtype."""
    if gated_act_uses_triton(x):
        return gated_act_fwd_triton(x, probs, row_mask, act)
    return gated_act_reference(x, probs, row_mask, act).to(x.dtype)


@gated_act_fwd_impl.register_fake
def _gated_act_fwd_fake(x, probs, row_mask, act):
    return x.new_empty((x.shape[0], x.shape[1] // 2))


@custom_op("primus_turbo::gated_act_bwd", mutates_args=())
def gated_act_bwd_impl(
    dy: torch.Tensor, x: torch.Tensor, probs: torch.Tensor | None, row_mask: torch.Tensor | None, act: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dprobs)``: dprobs fp32 per row, empty when ``probs`` is None."""
    if gated_act_uses_triton(x):
        return gated_act_bwd_triton(dy, x, probs, row_mask, act)
    # written out, not through torch.autograd: a custom op's body may run below the autograd dispatch
    # key (under torch.compile or the profiler), where no graph would be recorded
    a, b = x.float().chunk(2, dim=-1)
    scale = dy.float()
    if probs is not None:
        scale = scale * probs.float()[:, None]
    if row_mask is not None:
        scale = scale * row_mask[:, None]
    act_a = _act(a, act)
    dx = torch.cat([_act_backward(scale * b, a, act), scale * act_a], dim=-1).to(x.dtype)
    dprobs = x.new_empty(0, dtype=torch.float32)
    if probs is not None:
        gated = act_a * b * dy.float()
        if row_mask is not None:
            gated = gated * row_mask[:, None]
        dprobs = gated.sum(dim=-1)
    return dx, dprobs


@gated_act_bwd_impl.register_fake
def _gated_act_bwd_fake(dy, x, probs, row_mask, act):
    return x.new_empty(x.shape), x.new_empty(x.shape[0] if probs is not None else 0, dtype=torch.float32)


@custom_op("primus_turbo::gated_act_fp8_fwd", mutates_args=())
def gated_act_fp8_fwd_impl(
    x: torch.Tensor,
    probs: torch.Tensor | None,
    row_mask: torch.Tensor | None,
    act: int,
    fp8_dtype: torch.dtype,
    granularity: int,
    block_size: int,
    columnwise: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scale_inv, q_t, scale_inv_t)``: the gated activation written only as FP8, equal bit for bit to
    ``quantize_fp8_with_trans`` of the unfused output (tensorwise, per row or 1 x ``block_size``
    blocks); without ``columnwise``, ``q_t`` and ``scale_inv_t`` are empty and ``q``/``scale_inv`` are
    ``quantize_fp8`` along H."""
    if not fp8_triton_usable(x, fp8_dtype) or x.numel() == 0:
        out = gated_act_reference(x, probs, row_mask, act).to(x.dtype)
        return fp8_producer_reference(out, fp8_dtype, granularity, block_size, columnwise)
    shape = torch.Size((x.shape[0], x.shape[1] // 2))
    q, scale, q_t, scale_t = fp8_producer_empty(
        shape, fp8_dtype, granularity, block_size, columnwise, x.device
    )
    both_blocks = columnwise and EMIT_MODES[granularity] == EMIT_BLOCK
    if both_blocks and _cuda_tiles(x, probs, row_mask, fp8_dtype, block_size):
        dual_block_cuda(x, PRODUCER_GATED, q, scale, q_t, scale_t, probs=probs, row_mask=row_mask, act=act)
        return q, scale, q_t, scale_t
    column = (q_t, scale_t) if columnwise else (None, None)
    gated_act_fp8_triton(x, probs, row_mask, act, EMIT_MODES[granularity], q, scale, *column, block_size)
    return q, scale, q_t, scale_t


def _cuda_tiles(
    x: torch.Tensor,
    probs: torch.Tensor | None,
    row_mask: torch.Tensor | None,
    fp8_dtype: torch.dtype,
    block_size: int,
) -> bool:
    """Both 1 x 128 copies from the C++ kernel, where it runs: both halves' rows 16-byte aligned (H % 8 ==
    0), probs in fp32 or x's dtype."""
    return (
        (x.shape[1] // 2) % 8 == 0
        and dual_block_cuda_usable(x, fp8_dtype, block_size)
        and (probs is None or probs.dtype in (torch.float32, x.dtype))
    )


@gated_act_fp8_fwd_impl.register_fake
def _gated_act_fp8_fwd_fake(x, probs, row_mask, act, fp8_dtype, granularity, block_size, columnwise):
    shape = torch.Size((x.shape[0], x.shape[1] // 2))
    return fp8_producer_empty(shape, fp8_dtype, granularity, block_size, columnwise, x.device)
