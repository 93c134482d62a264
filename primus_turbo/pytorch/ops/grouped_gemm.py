"""Grouped GEMM for MoE experts with autograd:
``grouped_gemm(a, b, group_lens, group_offs, trans_b, fuse_bgrad_accum_pattern)``.

``a`` is [T, K] with the tokens of group ``g`` in rows ``offs[g]:offs[g + 1]``; ``b`` is [G, K, N], or
[G, N, K] with ``trans_b`` (the expert-weight layout of ``nn.Linear``). Forward and dgrad are grouped
GEMMs; wgrad is a variable-K grouped GEMM over each group's tokens. Group sizes stay on the device the
whole way, so the op can be captured in a CUDA graph. Set ``PRIMUS_TURBO_DEBUG_CHECKS=1`` to also
check, at the cost of a host sync per call, that ``group_lens`` are non-negative and sum to T.
"""

from __future__ import annotations

import torch

from primus_turbo.common.constants import ENV_DEBUG_CHECKS
from primus_turbo.common.env import env_reader
from primus_turbo.pytorch.core.custom_op import apply_function, call_op
from primus_turbo.pytorch.core.fused_wgrad import check_fuse_bgrad_accum_pattern, finish_fused_wgrad
from primus_turbo.pytorch.core.validation import check_dtype, check_same_device, check_tensor
from primus_turbo.pytorch.kernels.grouped_gemm.group_offs_impl import compute_group_offs
from primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_impl import (
    grouped_gemm_impl,
    grouped_gemm_variable_k_accum_impl,
    grouped_gemm_variable_k_impl,
)

_debug_checks_env = env_reader(ENV_DEBUG_CHECKS)

__all__ = ["check_grouped_args", "grouped_gemm", "grouped_wgrad"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class _GroupedGemmFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, group_offs, trans_b, accum_pattern):
        ctx.save_for_backward(a, b, group_offs)
        ctx.trans_b, ctx.accum_pattern = trans_b, accum_pattern
        return call_op(grouped_gemm_impl, a, b, group_offs, trans_b)

    @staticmethod
    def backward(ctx, grad_out):
        a, b, group_offs = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = call_op(grouped_gemm_impl, grad_out, b, group_offs, not ctx.trans_b)
        if ctx.needs_input_grad[1]:
            grad_b = grouped_wgrad(a, grad_out, b, group_offs, ctx.trans_b, ctx.accum_pattern)
        return grad_a, grad_b, None, None, None


def grouped_wgrad(
    a: torch.Tensor,
    grad_out: torch.Tensor,
    b: torch.Tensor,
    group_offs: torch.Tensor,
    trans_b: bool,
    accum_pattern: str | None,
) -> torch.Tensor | None:
    """The weight gradient of ``grouped_gemm(a, b, ...)`` in a's dtype (``grad_out`` cast to it): per group
    [K, N] = a_g^T dy_g, or [N, K] = dy_g^T a_g for the transposed layout; added into ``b.main_grad``
    under the ``"megatron"`` pattern."""
    if grad_out.dtype != a.dtype:
        grad_out = grad_out.to(a.dtype)
    lhs, rhs = (grad_out, a) if trans_b else (a, grad_out)
    if accum_pattern == "megatron":
        call_op(grouped_gemm_variable_k_accum_impl, lhs, rhs, group_offs, b.main_grad)
        return finish_fused_wgrad(b)
    grad_b = call_op(grouped_gemm_variable_k_impl, lhs, rhs, group_offs)
    return grad_b if grad_b.dtype == b.dtype else grad_b.to(b.dtype)


def _check_group_sizes(group_lens: torch.Tensor, tokens: int) -> None:
    """Host-side checks of the group sizes: where they are already on the host, or when asked; never
    while compiling (the values are not known then)."""
    if torch.compiler.is_compiling():
        return
    if group_lens.device.type != "cpu" and _debug_checks_env() != "1":
        return
    lens = group_lens.tolist()  # one copy (free on the host), then plain Python
    if any(n < 0 for n in lens):
        raise ValueError(f"group_lens must be non-negative, got {lens}")
    total = sum(lens)
    if total != tokens:
        raise ValueError(f"group_lens sum to {total}, but a has {tokens} rows")


def check_grouped_args(a: torch.Tensor, b: torch.Tensor, group_lens: torch.Tensor, trans_b: bool) -> None:
    """Shapes, dtypes and devices of a grouped GEMM call (and the group sizes where they can be read)."""
    check_tensor("a", a, dim=2)
    check_tensor("b", b, dim=3)
    check_dtype("a.dtype", a.dtype, _DTYPES)
    if b.dtype != a.dtype:
        raise TypeError(f"a and b must have the same dtype, got {a.dtype} and {b.dtype}")
    check_tensor("group_lens", group_lens, dim=1)
    check_dtype("group_lens.dtype", group_lens.dtype, (torch.int64,))
    check_same_device(a=a, b=b, group_lens=group_lens)
    if not isinstance(trans_b, bool):
        raise TypeError(f"trans_b must be a bool, got {trans_b!r}")
    groups, k_b = b.shape[0], (b.shape[2] if trans_b else b.shape[1])
    if group_lens.shape[0] != groups:
        raise ValueError(f"group_lens has {group_lens.shape[0]} groups but b has {groups}")
    if a.shape[1] != k_b:
        raise ValueError(
            f"a has K={a.shape[1]} but b has K={k_b} ({'[G, N, K]' if trans_b else '[G, K, N]'})"
        )
    _check_group_sizes(group_lens, a.shape[0])


def grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    group_lens: torch.Tensor,
    group_offs: torch.Tensor | None = None,
    trans_b: bool = False,
    fuse_bgrad_accum_pattern: str | None = None,
) -> torch.Tensor:
    """[T, N]: each group's rows of ``a`` [T, K] times its ``b[g]`` ([K, N], or [N, K] with ``trans_b``).

    ``group_lens`` is an int64 [G] tensor on ``a``'s device; ``group_offs`` its exclusive prefix sum
    ([G + 1], computed when omitted). Differentiable in ``a`` and ``b``; with
    ``fuse_bgrad_accum_pattern="megatron"`` the weight gradient is added into ``b.main_grad``.
    """
    check_grouped_args(a, b, group_lens, trans_b)
    check_fuse_bgrad_accum_pattern(fuse_bgrad_accum_pattern, b)
    if group_offs is None:
        group_offs = compute_group_offs(group_lens)
    else:
        check_tensor("group_offs", group_offs, dim=1)
        check_dtype("group_offs.dtype", group_offs.dtype, (torch.int64,))
        if group_offs.shape[0] != b.shape[0] + 1:
            raise ValueError(
                f"group_offs must have G + 1 = {b.shape[0] + 1} entries, got {group_offs.shape[0]}"
            )
    a = a if a.stride(-1) == 1 else a.contiguous()
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return apply_function(_GroupedGemmFunction, a, b, group_offs, trans_b, fuse_bgrad_accum_pattern)
    return call_op(grouped_gemm_impl, a, b, group_offs, trans_b)
