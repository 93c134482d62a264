"""``primus_turbo::adamw_fp8_step``: an AdamW step of a weight that also writes the weight's FP8 copies
(both layouts and their scales), so no forward has to quantize it. The Triton kernel on GPUs (and under
the interpreter), the TORCH reference elsewhere; both quantize the weight as stored after the step, as
``quantize_fp8_weight`` / ``quantize_fp8_experts`` would (see ``triton/optim/adamw_fp8_kernel.py``).

Tensors cross the op boundary as [B, R, C] views (one weight: B = 1); ``block`` is the 2-D block size, 0
for tensorwise scaling (``scale`` [B], ``scale_t`` unused).
"""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.custom_op import custom_op
from primus_turbo.pytorch.core.low_precision import ScalingGranularity
from primus_turbo.pytorch.kernels.quantization.quantization_impl import (
    fp8_triton_usable,
    quantize_fp8_reference,
    quantize_fp8_with_trans_reference,
)
from primus_turbo.triton.optim import adamw_fp8_step_triton

__all__ = ["adamw_fp8_step_impl", "adamw_fp8_step_reference"]

_BLOCKWISE = ScalingGranularity.BLOCKWISE.value
_ROWWISE = ScalingGranularity.ROWWISE.value
_MUTATED = ("param", "exp_avg", "exp_avg_sq", "master", "q", "q_t", "scale", "scale_t")


def adamw_fp8_step_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    master: torch.Tensor | None,
    q: torch.Tensor,
    q_t: torch.Tensor,
    scale: torch.Tensor,
    scale_t: torch.Tensor | None,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    block: int,
) -> None:
    """The TORCH path: ``torch.optim.AdamW``'s update in fp32, then the stored weight quantized."""
    g = grad.float()
    p = (master if master is not None else param).float() * (1.0 - lr * weight_decay)
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = (exp_avg_sq.sqrt() / (1.0 - beta2**step) ** 0.5).add_(eps)
    p.addcdiv_(exp_avg, denom, value=-lr / (1.0 - beta1**step))
    if master is not None:
        master.copy_(p)
    param.copy_(p)
    if block:
        values = quantize_fp8_with_trans_reference(param, q.dtype, _BLOCKWISE, block, True)
        for out, value in zip((q, scale, q_t, scale_t), values, strict=True):
            out.copy_(value)
        return
    # one scale per slice: the row quantization of the [B, R * C] view, as the experts' tensorwise copies
    flat, scale_inv = quantize_fp8_reference(
        param.reshape(param.shape[0], -1), q.dtype, _ROWWISE, 0, 1, False
    )
    q.copy_(flat.view(q.shape))
    q_t.copy_(q.transpose(1, 2))
    scale.copy_(scale_inv.view(scale.shape))


@custom_op("primus_turbo::adamw_fp8_step", mutates_args=_MUTATED)
def adamw_fp8_step_impl(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    master: torch.Tensor | None,
    q: torch.Tensor,
    q_t: torch.Tensor,
    scale: torch.Tensor,
    scale_t: torch.Tensor | None,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    block: int,
) -> None:
    """AdamW step ``step`` of ``param`` and its FP8 copies; see ``ops.fp8_primary.adamw_fp8_step_``."""
    if param.numel() == 0:
        return
    run = adamw_fp8_step_triton if fp8_triton_usable(param, q.dtype) else adamw_fp8_step_reference
    run(param, grad, exp_avg, exp_avg_sq, master, q, q_t, scale, scale_t,
        lr, beta1, beta2, eps, weight_decay, step, block)  # fmt: skip


def _adamw_fp8_step_fake(*args) -> None:
    """Nothing to allocate: the op writes its arguments in place."""


adamw_fp8_step_impl.register_fake(_adamw_fp8_step_fake)
