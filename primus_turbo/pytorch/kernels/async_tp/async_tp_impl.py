"""Custom ops ``primus_turbo::fused_all_gather_matmul`` / ``primus_turbo::fused_matmul_reduce_scatter``.

``fused_all_gather_matmul``: ``A = all_gather(A_shard, gather_dim)`` and ``C_i = A @ B_i`` for weights
``B_i`` [K, N_i] sharing the one gather. ``fused_matmul_reduce_scatter``: ``C = reduce_scatter(A @ B,
scatter_dim)``. The process group travels as its name (``ProcessGroup.group_name``) so the ops have a
schema ``torch.compile`` can capture. Backends: TORCH runs the collective, then this library's GEMM, on
any process group (NCCL, gloo).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from primus_turbo.pytorch.core.backend import AutoKernelDispatcher, BackendType, KernelBackend
from primus_turbo.pytorch.core.custom_op import call_op, custom_op
from primus_turbo.pytorch.kernels.gemm.gemm_impl import gemm_impl

__all__ = [
    "AllGatherMatmulDispatcher",
    "MatmulReduceScatterDispatcher",
    "REDUCE_OPS",
    "fused_all_gather_matmul_impl",
    "fused_matmul_reduce_scatter_impl",
    "group_size",
]

REDUCE_OPS = ("sum", "avg")

# torch 2.13 renames the single-tensor collectives; older releases have only the old names
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def group_size(group_name: str) -> int:
    """Ranks in the process group registered under ``group_name``."""
    return dist.get_world_size(_resolve_process_group(group_name))


def _gathered_shape(a_shard: torch.Tensor, gather_dim: int, world: int) -> list[int]:
    shape = list(a_shard.shape)
    shape[gather_dim] *= world
    return shape


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a`` [..., K] @ ``b`` [K, N] -> [..., N] with this library's GEMM."""
    flat = a.reshape(-1, a.shape[-1])
    out = call_op(gemm_impl, flat, b, False, False, a.dtype)
    return out.view(*a.shape[:-1], b.shape[1])


def _all_gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((dist.get_world_size(group) * moved.shape[0], *moved.shape[1:]))
    _all_gather_single(out, moved, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup, reduce_op: str) -> torch.Tensor:
    world = dist.get_world_size(group)
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // world, *moved.shape[1:]))
    _reduce_scatter_single(out, moved, op=dist.ReduceOp.SUM, group=group)
    if reduce_op == "avg":
        out.div_(world)
    return out.movedim(0, dim).contiguous()


class TorchAllGatherMatmulBackend(KernelBackend):
    """The all-gather, then one GEMM per weight: no overlap, any process group."""

    autotune = False

    @staticmethod
    def execute(a_shard, bs, gather_dim, group, **_: Any) -> list[torch.Tensor]:
        a = _all_gather(a_shard, gather_dim, group)
        return [a, *(_matmul(a, b) for b in bs)]


class TorchMatmulReduceScatterBackend(KernelBackend):
    """The GEMM, then the reduce-scatter: no overlap, any process group."""

    autotune = False

    @staticmethod
    def execute(a, b, scatter_dim, group, reduce_op, **_: Any) -> torch.Tensor:
        return _reduce_scatter(_matmul(a, b), scatter_dim, group, reduce_op)


class AllGatherMatmulDispatcher(AutoKernelDispatcher):
    """Backend choice for all-gather + GEMM."""

    op_name = "fused_all_gather_matmul"
    backends = {BackendType.TORCH: TorchAllGatherMatmulBackend}

    @classmethod
    def make_key(cls, a_shard, bs, gather_dim, group, **_: Any) -> Hashable:
        return (a_shard.device.type, tuple(a_shard.shape), tuple(tuple(b.shape) for b in bs), gather_dim)

    @classmethod
    def default_backend(cls, **_: Any) -> BackendType:
        return BackendType.TORCH


class MatmulReduceScatterDispatcher(AutoKernelDispatcher):
    """Backend choice for GEMM + reduce-scatter."""

    op_name = "fused_matmul_reduce_scatter"
    backends = {BackendType.TORCH: TorchMatmulReduceScatterBackend}

    @classmethod
    def make_key(cls, a, b, scatter_dim, group, reduce_op, **_: Any) -> Hashable:
        return (a.device.type, tuple(a.shape), tuple(b.shape), scatter_dim, reduce_op)

    @classmethod
    def default_backend(cls, **_: Any) -> BackendType:
        return BackendType.TORCH


@custom_op("primus_turbo::fused_all_gather_matmul", mutates_args=())
def fused_all_gather_matmul_impl(
    a_shard: torch.Tensor, bs: list[torch.Tensor], gather_dim: int, group_name: str
) -> list[torch.Tensor]:
    """``[A, A @ B_0, A @ B_1, ...]`` with ``A = all_gather(a_shard, gather_dim)`` over ``group_name``."""
    group = _resolve_process_group(group_name)
    return AllGatherMatmulDispatcher.dispatch(
        None, a_shard=a_shard, bs=bs, gather_dim=gather_dim, group=group
    )


@fused_all_gather_matmul_impl.register_fake
def _fused_all_gather_matmul_fake(a_shard, bs, gather_dim, group_name):
    shape = _gathered_shape(a_shard, gather_dim, group_size(group_name))
    return [a_shard.new_empty(shape), *(a_shard.new_empty((*shape[:-1], b.shape[1])) for b in bs)]


@custom_op("primus_turbo::fused_matmul_reduce_scatter", mutates_args=())
def fused_matmul_reduce_scatter_impl(
    a: torch.Tensor, b: torch.Tensor, scatter_dim: int, group_name: str, reduce_op: str
) -> torch.Tensor:
    """``reduce_scatter(a @ b, scatter_dim)`` over ``group_name``, summed or averaged."""
    group = _resolve_process_group(group_name)
    return MatmulReduceScatterDispatcher.dispatch(
        None, a=a, b=b, scatter_dim=scatter_dim, group=group, reduce_op=reduce_op
    )


@fused_matmul_reduce_scatter_impl.register_fake
def _fused_matmul_reduce_scatter_fake(a, b, scatter_dim, group_name, reduce_op):
    shape = [*a.shape[:-1], b.shape[1]]
    shape[scatter_dim] //= group_size(group_name)
    return a.new_empty(shape)
