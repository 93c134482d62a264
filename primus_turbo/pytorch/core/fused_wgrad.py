"""Megatron's fused weight-gradient accumulation, shared by every GEMM op.

With ``fuse_bgrad_accum_pattern="megatron"`` the wgrad GEMM adds into ``weight.main_grad`` (the fp32
buffer Megatron's DDP owns), sets ``weight.grad_added_to_main_grad`` and hands autograd a dummy
gradient (zeros when ``weight.zero_out_wgrad`` asks for it), exactly as Megatron's own fused kernels do.
"""

from __future__ import annotations

import torch

__all__ = ["ACCUM_PATTERNS", "check_fuse_bgrad_accum_pattern", "finish_fused_wgrad"]

ACCUM_PATTERNS = (None, "megatron")
_MAIN_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_fuse_bgrad_accum_pattern(pattern: str | None, b: object) -> None:
    """``pattern`` is None or ``"megatron"``; the latter needs a tensor ``b`` with a usable ``main_grad``,
    and marks ``b.grad_added_to_main_grad`` when a gradient will be computed."""
    if pattern not in ACCUM_PATTERNS:
        raise ValueError(f"fuse_bgrad_accum_pattern must be None or 'megatron', got {pattern!r}")
    if pattern is None:
        return
    main_grad = getattr(b, "main_grad", None)
    if not isinstance(b, torch.Tensor) or not isinstance(main_grad, torch.Tensor):
        raise ValueError("fuse_bgrad_accum_pattern='megatron' needs b.main_grad (set by Megatron DDP)")
    if main_grad.shape != b.shape or not main_grad.is_contiguous() or main_grad.device != b.device:
        raise ValueError(
            f"b.main_grad must be a contiguous tensor of b's shape {tuple(b.shape)} on {b.device}, "
            f"got {tuple(main_grad.shape)} on {main_grad.device}"
        )
    if main_grad.dtype not in _MAIN_GRAD_DTYPES:
        raise TypeError(f"b.main_grad.dtype must be fp32, bf16 or fp16, got {main_grad.dtype}")
    if b.requires_grad and torch.is_grad_enabled():
        # set when the call is made rather than inside backward, which torch.compile cannot capture; the
        # flag is read by Megatron's gradient hook only after this call's backward has accumulated
        b.grad_added_to_main_grad = True


def finish_fused_wgrad(b: torch.Tensor) -> torch.Tensor:
    """The dummy gradient autograd receives once the wgrad went into ``b.main_grad``."""
    make = torch.zeros if getattr(b, "zero_out_wgrad", False) else torch.empty
    return make(b.shape, dtype=b.dtype, device=b.device)
