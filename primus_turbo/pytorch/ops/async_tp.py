"""Tensor-parallel communication fused with GEMMs, with autograd (async TP).

``fused_all_gather_matmul`` is the column-parallel linear under sequence parallelism (gather the
sequence shards, multiply by each weight) and ``fused_matmul_reduce_scatter`` the row-parallel one
(multiply, sum the partial products over the group and keep this rank's shard). Each one's backward is
the other: the gradient of an all-gather is a reduce-scatter and the reverse.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from primus_turbo.pytorch.core.custom_op import call_op
from primus_turbo.pytorch.core.fused_wgrad import check_fuse_bgrad_accum_pattern, finish_fused_wgrad
from primus_turbo.pytorch.core.validation import check_dtype, check_same_device, check_tensor
from primus_turbo.pytorch.kernels.async_tp.async_tp_impl import (
    REDUCE_OPS,
    fused_all_gather_matmul_impl,
    fused_all_gather_scaled_matmul_impl,
    fused_matmul_reduce_scatter_impl,
    group_size,
)
from primus_turbo.pytorch.kernels.gemm.gemm_impl import gemm_accum_impl, gemm_impl

__all__ = ["fused_all_gather_matmul", "fused_all_gather_scaled_matmul", "fused_matmul_reduce_scatter"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def _group_name(group: dist.ProcessGroup | None) -> str:
    return (group if group is not None else dist.group.WORLD).group_name


def _weight_grad(a: torch.Tensor, grad: torch.Tensor, b: torch.Tensor, trans_b: bool, accum: str | None):
    """The gradient of weight ``b``: ``a``^T @ ``grad`` over all leading dimensions ([K, N]; its
    transpose when ``trans_b``), or added into ``b.main_grad`` with ``accum`` (then a dummy)."""
    flat_a, flat_g = a.reshape(-1, a.shape[-1]), grad.reshape(-1, grad.shape[-1])
    lhs, rhs = (flat_g, flat_a) if trans_b else (flat_a, flat_g)
    if accum is None:
        return call_op(gemm_impl, lhs, rhs, True, False, b.dtype)
    call_op(gemm_accum_impl, lhs, rhs, b.main_grad, True, False)
    return finish_fused_wgrad(b)


def _input_grad(grads: list[torch.Tensor], kbs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum over the weights of ``grad_i @ B_i``^T (``kbs``: the [K, N] weights)."""
    total = None
    for grad, b in zip(grads, kbs, strict=True):
        flat = grad.reshape(-1, grad.shape[-1])
        part = call_op(gemm_impl, flat, b, False, True, grad.dtype).view(*grad.shape[:-1], b.shape[0])
        total = part if total is None else total + part
    return total


def _as_kn(b: torch.Tensor, trans_b: bool) -> torch.Tensor:
    return b.t() if trans_b else b


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a_shard, gather_dim, group_name, trans_b, accum, *bs):
        kbs = [_as_kn(b, trans_b) for b in bs]
        a, *outs = call_op(fused_all_gather_matmul_impl, a_shard, kbs, gather_dim, group_name)
        ctx.gather_dim, ctx.group_name, ctx.trans_b, ctx.accum = gather_dim, group_name, trans_b, accum
        ctx.save_for_backward(a, *bs)
        return (a, *outs)

    @staticmethod
    def backward(ctx, grad_a, *grad_outs):
        a, *bs = ctx.saved_tensors
        kbs = [_as_kn(b, ctx.trans_b) for b in bs]
        used = [(g, b) for g, b in zip(grad_outs, kbs, strict=True) if g is not None]
        grad_shard = None
        if ctx.needs_input_grad[0]:
            if len(used) == 1 and grad_a is None:
                ((grad, b),) = used
                grad_shard = call_op(
                    fused_matmul_reduce_scatter_impl, grad, b.t(), ctx.gather_dim, ctx.group_name, "sum"
                )
            else:
                full = _input_grad([g for g, _ in used], [b for _, b in used]) if used else None
                if grad_a is not None:
                    full = grad_a if full is None else full + grad_a
                grad_shard = funcol.wait_tensor(
                    funcol.reduce_scatter_tensor(full.contiguous(), "sum", ctx.gather_dim, ctx.group_name)
                )
        grad_bs = [
            _weight_grad(a, g, b, ctx.trans_b, ctx.accum)
            if g is not None and ctx.needs_input_grad[5 + i]
            else None
            for i, (g, b) in enumerate(zip(grad_outs, bs, strict=True))
        ]
        return grad_shard, None, None, None, None, *grad_bs


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, scatter_dim, group_name, reduce_op, trans_b, accum):
        ctx.scatter_dim, ctx.group_name, ctx.reduce_op = scatter_dim, group_name, reduce_op
        ctx.trans_b, ctx.accum = trans_b, accum
        ctx.save_for_backward(a, b)
        return call_op(
            fused_matmul_reduce_scatter_impl, a, _as_kn(b, trans_b), scatter_dim, group_name, reduce_op
        )

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        if ctx.reduce_op == "avg":
            grad = grad / group_size(ctx.group_name)
        gathered, grad_a = call_op(
            fused_all_gather_matmul_impl, grad.contiguous(), [_as_kn(b, ctx.trans_b).t()], ctx.scatter_dim,
            ctx.group_name,
        )  # fmt: skip
        grad_b = _weight_grad(a, gathered, b, ctx.trans_b, ctx.accum) if ctx.needs_input_grad[1] else None
        return (grad_a if ctx.needs_input_grad[0] else None), grad_b, None, None, None, None, None


def _leading_dim(name: str, dim: int, x: torch.Tensor) -> int:
    """``dim`` normalised; it must index a leading (not the feature) dimension of ``x``."""
    if not -x.dim() <= dim < x.dim() or dim % x.dim() == x.dim() - 1:
        raise ValueError(f"{name} must index one of the leading dimensions of a {x.dim()}-D input, got {dim}")
    return dim % x.dim()


def _check_weight(name: str, b: torch.Tensor, a: torch.Tensor, trans_b: bool, accum: str | None) -> None:
    check_tensor(name, b, dim=2)
    k = b.shape[1] if trans_b else b.shape[0]
    if k != a.shape[-1]:
        layout = "[N, K]" if trans_b else "[K, N]"
        raise ValueError(
            f"{name} must be {layout} with K = a's last dimension {a.shape[-1]}, got {tuple(b.shape)}"
        )
    if b.dtype != a.dtype:
        raise TypeError(f"{name} must have a's dtype {a.dtype}, got {b.dtype}")
    check_same_device(a=a, **{name: b})
    check_fuse_bgrad_accum_pattern(accum, b)


def fused_all_gather_matmul(
    a_shard: torch.Tensor,
    bs: Sequence[torch.Tensor],
    gather_dim: int,
    group: dist.ProcessGroup | None = None,
    *,
    return_a: bool = True,
    trans_b: bool = False,
    fuse_bgrad_accum_pattern: str | None = None,
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """``A = all_gather(a_shard, gather_dim)`` over ``group`` (WORLD when None) and ``[A @ B_i]`` for the
    weights ``bs`` ([K, N_i] each, or [N_i, K] linear weights with ``trans_b``, sharing the one gather);
    returns ``(A or None, outputs)``.

    Differentiable in ``a_shard`` and every weight: the input gradient is a GEMM + reduce-scatter. With
    ``fuse_bgrad_accum_pattern="megatron"`` each weight's gradient is added into its ``main_grad``.
    """
    check_tensor("a_shard", a_shard)
    check_dtype("a_shard", a_shard.dtype, _DTYPES)
    if a_shard.dim() < 2:
        raise ValueError(
            f"a_shard must have a leading and a feature dimension, got shape {tuple(a_shard.shape)}"
        )
    gather_dim = _leading_dim("gather_dim", gather_dim, a_shard)
    if isinstance(bs, torch.Tensor) or not bs:
        raise ValueError("bs must be a non-empty sequence of [K, N] weights")
    for i, b in enumerate(bs):
        _check_weight(f"bs[{i}]", b, a_shard, trans_b, fuse_bgrad_accum_pattern)
    name = _group_name(group)
    a, *outs = _AllGatherMatmul.apply(a_shard, gather_dim, name, trans_b, fuse_bgrad_accum_pattern, *bs)
    return (a if return_a else None), outs


def fused_all_gather_scaled_matmul(
    a_shard: torch.Tensor,
    bs: Sequence[torch.Tensor],
    a_scale: torch.Tensor,
    b_scales: Sequence[torch.Tensor],
    gather_dim: int,
    group: dist.ProcessGroup | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    return_a: bool = True,
) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, list[torch.Tensor]]:
    """FP8 all-gather + GEMM: ``A = all_gather(a_shard)`` with its scales gathered alongside, and
    ``[(A * s_A) @ (B_i * s_Bi)]`` in ``out_dtype``; returns ``((A, A's row scales) or None, outputs)``.

    ``a_shard`` FP8 [..., K] with ``a_scale`` (the dequantising multiplier) tensorwise (0-d; each rank's
    own) or row-wise ([..., 1]); ``bs`` FP8 [K, N_i] column-major (the transpose of a row-major [N_i, K]
    weight, as ``torch._scaled_mm`` takes it) with ``b_scales`` 0-d or one per output column. Inputs are
    already quantized, so the op has no autograd (as PyTorch's ``fused_all_gather_scaled_matmul``).
    """
    check_tensor("a_shard", a_shard)
    check_dtype("a_shard", a_shard.dtype, _FP8_DTYPES)
    if a_shard.dim() < 2:
        raise ValueError(f"a_shard needs a leading and a feature dimension, got shape {tuple(a_shard.shape)}")
    gather_dim = _leading_dim("gather_dim", gather_dim, a_shard)
    check_tensor("a_scale", a_scale)
    if a_scale.dim() and tuple(a_scale.shape) != (*a_shard.shape[:-1], 1):
        raise ValueError(
            f"a_scale must be 0-d (tensorwise) or {(*a_shard.shape[:-1], 1)} (row-wise), "
            f"got {tuple(a_scale.shape)}"
        )
    check_dtype("out_dtype", out_dtype, _DTYPES)
    if isinstance(bs, torch.Tensor) or not bs or len(bs) != len(b_scales):
        raise ValueError("bs must be a non-empty sequence of [K, N] FP8 weights, one b_scales entry each")
    for i, (b, b_scale) in enumerate(zip(bs, b_scales, strict=True)):
        check_tensor(f"bs[{i}]", b, dim=2)
        check_dtype(f"bs[{i}]", b.dtype, _FP8_DTYPES)
        if b.shape[0] != a_shard.shape[-1] or not b.t().is_contiguous():
            raise ValueError(
                f"bs[{i}] must be a column-major [K, N] FP8 weight with K = {a_shard.shape[-1]} (the "
                f"transpose of a row-major [N, K] tensor), got shape {tuple(b.shape)}, strides {b.stride()}"
            )
        check_tensor(f"b_scales[{i}]", b_scale)
        if b_scale.numel() not in (1, b.shape[1]):
            raise ValueError(f"b_scales[{i}] must hold 1 or N = {b.shape[1]} scales, got {b_scale.numel()}")
        check_same_device(a_shard=a_shard, **{f"bs[{i}]": b})
    a, scales, *outs = call_op(
        fused_all_gather_scaled_matmul_impl, a_shard, a_scale, list(bs), list(b_scales), gather_dim,
        _group_name(group), out_dtype,
    )  # fmt: skip
    return ((a, scales) if return_a else None), outs


def fused_matmul_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    scatter_dim: int,
    group: dist.ProcessGroup | None = None,
    reduce_op: str = "sum",
    *,
    trans_b: bool = False,
    fuse_bgrad_accum_pattern: str | None = None,
) -> torch.Tensor:
    """``reduce_scatter(a @ b, scatter_dim)`` over ``group`` (WORLD when None): this rank's shard of the
    partial products summed (``reduce_op="sum"``) or averaged (``"avg"``) over the group.

    ``a`` [..., K], ``b`` [K, N] ([N, K] with ``trans_b``); ``a.shape[scatter_dim]`` must divide by the
    group size. Differentiable in ``a`` and ``b``: the input gradient is an all-gather + GEMM. With
    ``fuse_bgrad_accum_pattern="megatron"`` the weight gradient is added into ``b.main_grad``.
    """
    check_tensor("a", a)
    check_dtype("a", a.dtype, _DTYPES)
    if a.dim() < 2:
        raise ValueError(f"a must have a leading and a feature dimension, got shape {tuple(a.shape)}")
    scatter_dim = _leading_dim("scatter_dim", scatter_dim, a)
    _check_weight("b", b, a, trans_b, fuse_bgrad_accum_pattern)
    if reduce_op not in REDUCE_OPS:
        raise ValueError(f"reduce_op must be one of {', '.join(REDUCE_OPS)}, got {reduce_op!r}")
    name = _group_name(group)
    world = dist.get_world_size(group)
    if a.shape[scatter_dim] % world:
        raise ValueError(
            f"a.shape[{scatter_dim}] = {a.shape[scatter_dim]} must divide by the group size {world}"
        )
    return _MatmulReduceScatter.apply(a, b, scatter_dim, name, reduce_op, trans_b, fuse_bgrad_accum_pattern)
