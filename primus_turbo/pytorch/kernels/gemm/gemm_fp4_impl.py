"""MXFP4 GEMM custom ops ``primus_turbo::gemm_fp4`` / ``gemm_fp4_accum`` in the NT layout.

Operands are ``quantize_fp4`` outputs along K: ``a`` (M, K / 2) and ``b`` (N, K / 2) with E8M0 scales
(M, K / 32) and (N, K / 32). Hopper has no FP4 tensor cores, so the product runs on the dequantized
operands: E2M1 values times power-of-two scales are exact in bf16, and the bf16 GEMM accumulates in
fp32, so the result is what an FP4 tensor-core GEMM computes, up to the accumulation order.
"""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.custom_op import custom_op
from primus_turbo.pytorch.kernels.quantization.quantization_fp4_impl import dequantize_fp4_reference

__all__ = ["gemm_fp4_accum_impl", "gemm_fp4_impl"]


def _operand_dtype(device: torch.device) -> torch.dtype:
    # exact either way; bf16 reaches the tensor cores on GPUs, fp32 is the fast CPU path
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _product(a, a_scale, b, b_scale) -> torch.Tensor:
    dtype = _operand_dtype(a.device)
    lhs = dequantize_fp4_reference(a, a_scale, dtype)
    rhs = dequantize_fp4_reference(b, b_scale, dtype)
    return torch.mm(lhs, rhs.t(), out_dtype=torch.float32) if dtype != torch.float32 else lhs @ rhs.t()


@custom_op("primus_turbo::gemm_fp4", mutates_args=())
def gemm_fp4_impl(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``dequant(a) @ dequant(b)^T`` as a new (M, N) tensor of ``out_dtype``."""
    return _product(a, a_scale, b, b_scale).to(out_dtype)


@gemm_fp4_impl.register_fake
def _gemm_fp4_fake(a, a_scale, b, b_scale, out_dtype):
    return torch.empty((a.shape[0], b.shape[0]), dtype=out_dtype, device=a.device)


@custom_op("primus_turbo::gemm_fp4_accum", mutates_args=("out",))
def gemm_fp4_accum_impl(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out: torch.Tensor
) -> None:
    """``out += dequant(a) @ dequant(b)^T`` (fp32 ``main_grad`` for fused wgrad accumulation)."""
    out.add_(_product(a, a_scale, b, b_scale))


@gemm_fp4_accum_impl.register_fake
def _gemm_fp4_accum_fake(a, a_scale, b, b_scale, out):
    return None
