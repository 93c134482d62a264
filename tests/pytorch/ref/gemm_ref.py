"""fp64 references for dense GEMM: forward and the gradients of both operands."""

from __future__ import annotations

import torch

__all__ = ["gemm_ref", "gemm_ref_with_grads"]


def gemm_ref(a: torch.Tensor, b: torch.Tensor, trans_a: bool = False, trans_b: bool = False) -> torch.Tensor:
    """``op(a) @ op(b)`` in float64 (on the operands' device), returned on the CPU."""
    a64 = a.detach().double()
    b64 = b.detach().double()
    return ((a64.t() if trans_a else a64) @ (b64.t() if trans_b else b64)).cpu()


def gemm_ref_with_grads(
    a: torch.Tensor, b: torch.Tensor, grad_out: torch.Tensor, trans_a: bool = False, trans_b: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, grad_a, grad_b) in float64 on the CPU, each in the stored layout of its operand."""
    a64 = a.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_()
    out = (a64.t() if trans_a else a64) @ (b64.t() if trans_b else b64)
    out.backward(grad_out.detach().double())
    return out.detach().cpu(), a64.grad.cpu(), b64.grad.cpu()
