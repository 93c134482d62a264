"""Gated-activation kernels."""

from primus_turbo.triton.activation.gated_act_kernel import (
    GELU_TANH,
    SILU,
    gated_act_bwd_triton,
    gated_act_fp8_triton,
    gated_act_fwd_triton,
)

__all__ = ["GELU_TANH", "SILU", "gated_act_bwd_triton", "gated_act_fp8_triton", "gated_act_fwd_triton"]
