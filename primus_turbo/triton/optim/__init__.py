"""Optimizer kernels: AdamW steps that also write a parameter's FP8 copies."""

from primus_turbo.triton.optim.adamw_fp8_kernel import adamw_fp8_step_triton

__all__ = ["adamw_fp8_step_triton"]
