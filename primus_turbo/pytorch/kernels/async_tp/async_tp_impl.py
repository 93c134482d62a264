"""Custom ops ``primus_turbo::fused_all_gather_matmul``, ``fused_all_gather_scaled_matmul`` and
``fused_matmul_reduce_scatter``.

``fused_all_gather_matmul``: ``A = all_gather(A_shard, gather_dim)`` and ``C_i = A @ B_i`` for weights
``B_i`` [K, N_i] sharing the one gather; ``fused_all_gather_scaled_matmul`` the same on FP8 operands, A's
scales gathered with it. ``fused_matmul_reduce_scatter``: ``C = reduce_scatter(A @ B, scatter_dim)``.
The process group travels as its name (``ProcessGroup.group_name``) so the ops have a schema
``torch.compile`` can capture. Backends (``PRIMUS_TURBO_ASYNC_TP_BACKEND`` or
``GlobalBackendManager.set_async_tp_backend``; never autotuned, since every rank must pick the same one):
TORCH runs the collective, then this library's GEMM; TURBO overlaps them on a ring of point-to-point
transfers: each rank multiplies the chunk it holds while the next one arrives (all-gather), or sends
its partial sums on while computing the next chunk's (reduce-scatter). Both run on any process group.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from primus_turbo.pytorch.core.backend import (
    AutoKernelDispatcher,
    BackendType,
    GlobalBackendManager,
    KernelBackend,
    precision_of,
)
from primus_turbo.pytorch.core.custom_op import call_op, custom_op
from primus_turbo.pytorch.core.low_precision import ScalingGranularity
from primus_turbo.pytorch.kernels.gemm.gemm_fp8_impl import gemm_fp8_impl
from primus_turbo.pytorch.kernels.gemm.gemm_impl import gemm_impl

__all__ = [
    "AllGatherMatmulDispatcher",
    "AllGatherScaledMatmulDispatcher",
    "MatmulReduceScatterDispatcher",
    "REDUCE_OPS",
    "fused_all_gather_matmul_impl",
    "fused_all_gather_scaled_matmul_impl",
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


def _row_scales(a_shard: torch.Tensor, a_scale: torch.Tensor) -> torch.Tensor:
    """A's scales as one per row ([..., 1] float32): a tensorwise scale repeated over the shard's rows."""
    shape = (*a_shard.shape[:-1], 1)
    return a_scale.float().reshape(shape if a_scale.dim() else (1,) * len(shape)).expand(shape).contiguous()


def _column_scales(b: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """B's scales as one per output column, (N, 1) float32, the layout the FP8 GEMM takes."""
    return b_scale.float().reshape(-1, 1).expand(b.shape[1], 1).contiguous()


class TorchAllGatherScaledMatmulBackend(KernelBackend):
    """The all-gather of the FP8 rows and their scales (bytes: any process group), then one row-wise
    scaled GEMM per weight."""

    autotune = False

    @staticmethod
    def execute(a_shard, a_scale, bs, b_scales, gather_dim, group, out_dtype, **_: Any) -> list[torch.Tensor]:
        a = _all_gather(a_shard.view(torch.uint8), gather_dim, group).view(a_shard.dtype)
        scales = _all_gather(_row_scales(a_shard, a_scale), gather_dim, group)
        flat, flat_scales = a.reshape(-1, a.shape[-1]), scales.reshape(-1, 1)
        outs = []
        for b, b_scale in zip(bs, b_scales, strict=True):
            out = call_op(gemm_fp8_impl, flat, flat_scales, b.t(), _column_scales(b, b_scale), out_dtype,
                          ScalingGranularity.ROWWISE.value, 0, False, False)  # fmt: skip
            outs.append(out.view(*a.shape[:-1], b.shape[1]))
        return [a, scales, *outs]


def _exchange(send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup) -> list[dist.Work]:
    """Start sending ``send`` to the next rank of the ring and receiving ``recv`` from the previous one."""
    rank, world = dist.get_group_rank(group, dist.get_rank()), dist.get_world_size(group)
    nxt = dist.get_global_rank(group, (rank + 1) % world)
    prev = dist.get_global_rank(group, (rank - 1) % world)
    return dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, send, nxt, group), dist.P2POp(dist.irecv, recv, prev, group)]
    )


class RingAllGatherMatmulBackend(KernelBackend):
    """The gather as a ring: at step ``s`` a rank multiplies the shard of rank ``r - s`` while it passes
    that shard on and receives the one of rank ``r - s - 1``, straight into the gathered tensor."""

    autotune = False

    @staticmethod
    def execute(a_shard, bs, gather_dim, group, **_: Any) -> list[torch.Tensor]:
        world, rank = dist.get_world_size(group), dist.get_group_rank(group, dist.get_rank())
        shard = a_shard.movedim(gather_dim, 0).contiguous()
        rows = shard.shape[0]
        gathered = shard.new_empty((world * rows, *shard.shape[1:]))
        outs = [shard.new_empty((world * rows, *shard.shape[1:-1], b.shape[1])) for b in bs]
        gathered[rank * rows : (rank + 1) * rows].copy_(shard)
        for step in range(world):
            held, coming = (rank - step) % world, (rank - step - 1) % world
            chunk = gathered[held * rows : (held + 1) * rows]
            works = []
            if step < world - 1:
                works = _exchange(chunk, gathered[coming * rows : (coming + 1) * rows], group)
            for out, b in zip(outs, bs, strict=True):
                out[held * rows : (held + 1) * rows] = _matmul(chunk, b)
            for work in works:
                work.wait()
        return [t.movedim(0, gather_dim).contiguous() for t in (gathered, *outs)]


class RingMatmulReduceScatterBackend(KernelBackend):
    """The reduce-scatter as a ring: at step ``s`` a rank computes its partial product for chunk
    ``r - s - 1`` while the running sum of that chunk arrives from the previous rank, adds it and passes
    it on; after ``world - 1`` hops each chunk's sum ends on its owner."""

    autotune = False

    @staticmethod
    def execute(a, b, scatter_dim, group, reduce_op, **_: Any) -> torch.Tensor:
        world, rank = dist.get_world_size(group), dist.get_group_rank(group, dist.get_rank())
        moved = a.movedim(scatter_dim, 0).contiguous()
        rows = moved.shape[0] // world
        running = None
        for step in range(world):
            chunk = (rank - step - 1) % world
            # the transfer is queued before the GEMM, so the two run at once
            incoming = None if running is None else torch.empty_like(running)
            works = [] if running is None else _exchange(running, incoming, group)
            partial = _matmul(moved[chunk * rows : (chunk + 1) * rows], b)
            for work in works:
                work.wait()
            running = partial if incoming is None else partial.add_(incoming)
        if reduce_op == "avg":
            running.div_(world)
        return running.movedim(0, scatter_dim).contiguous()


class TorchMatmulReduceScatterBackend(KernelBackend):
    """The GEMM, then the reduce-scatter: no overlap, any process group."""

    autotune = False

    @staticmethod
    def execute(a, b, scatter_dim, group, reduce_op, **_: Any) -> torch.Tensor:
        return _reduce_scatter(_matmul(a, b), scatter_dim, group, reduce_op)


class AllGatherMatmulDispatcher(AutoKernelDispatcher):
    """Backend choice for all-gather + GEMM."""

    op_name = "fused_all_gather_matmul"
    backends = {BackendType.TORCH: TorchAllGatherMatmulBackend, BackendType.TURBO: RingAllGatherMatmulBackend}

    @classmethod
    def make_key(cls, a_shard, bs, gather_dim, group, **_: Any) -> Hashable:
        return (a_shard.device.type, tuple(a_shard.shape), tuple(tuple(b.shape) for b in bs), gather_dim)

    @classmethod
    def default_backend(cls, **_: Any) -> BackendType:
        return BackendType.TORCH


class AllGatherScaledMatmulDispatcher(AutoKernelDispatcher):
    """Backend choice for all-gather + FP8 GEMM."""

    op_name = "fused_all_gather_scaled_matmul"
    backends = {BackendType.TORCH: TorchAllGatherScaledMatmulBackend}

    @classmethod
    def make_key(cls, a_shard, bs, gather_dim, out_dtype, **_: Any) -> Hashable:
        shapes = tuple(tuple(b.shape) for b in bs)
        return (a_shard.device.type, tuple(a_shard.shape), a_shard.dtype, shapes, gather_dim, out_dtype)

    @classmethod
    def default_backend(cls, **_: Any) -> BackendType:
        return BackendType.TORCH


class MatmulReduceScatterDispatcher(AutoKernelDispatcher):
    """Backend choice for GEMM + reduce-scatter."""

    op_name = "fused_matmul_reduce_scatter"
    backends = {
        BackendType.TORCH: TorchMatmulReduceScatterBackend,
        BackendType.TURBO: RingMatmulReduceScatterBackend,
    }

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
    choice = GlobalBackendManager.get_async_tp_backend(precision_of(a_shard.dtype))
    return AllGatherMatmulDispatcher.dispatch(
        choice, a_shard=a_shard, bs=bs, gather_dim=gather_dim, group=group
    )


@fused_all_gather_matmul_impl.register_fake
def _fused_all_gather_matmul_fake(a_shard, bs, gather_dim, group_name):
    shape = _gathered_shape(a_shard, gather_dim, group_size(group_name))
    return [a_shard.new_empty(shape), *(a_shard.new_empty((*shape[:-1], b.shape[1])) for b in bs)]


@custom_op("primus_turbo::fused_all_gather_scaled_matmul", mutates_args=())
def fused_all_gather_scaled_matmul_impl(
    a_shard: torch.Tensor,
    a_scale: torch.Tensor,
    bs: list[torch.Tensor],
    b_scales: list[torch.Tensor],
    gather_dim: int,
    group_name: str,
    out_dtype: torch.dtype,
) -> list[torch.Tensor]:
    """``[A, A's row scales, (A * s_A) @ (B_0 * s_B0), ...]`` with ``A`` and its scales gathered along
    ``gather_dim`` over ``group_name``; FP8 ``B_i`` [K, N_i] column-major, scales 0-d or one per column."""
    return AllGatherScaledMatmulDispatcher.dispatch(
        GlobalBackendManager.get_async_tp_backend(precision_of(a_shard.dtype)),
        a_shard=a_shard,
        a_scale=a_scale,
        bs=bs,
        b_scales=b_scales,
        gather_dim=gather_dim,
        group=_resolve_process_group(group_name),
        out_dtype=out_dtype,
    )


@fused_all_gather_scaled_matmul_impl.register_fake
def _fused_all_gather_scaled_matmul_fake(a_shard, a_scale, bs, b_scales, gather_dim, group_name, out_dtype):
    shape = _gathered_shape(a_shard, gather_dim, group_size(group_name))
    outs = [a_shard.new_empty((*shape[:-1], b.shape[1]), dtype=out_dtype) for b in bs]
    return [a_shard.new_empty(shape), a_shard.new_empty((*shape[:-1], 1), dtype=torch.float32), *outs]


@custom_op("primus_turbo::fused_matmul_reduce_scatter", mutates_args=())
def fused_matmul_reduce_scatter_impl(
    a: torch.Tensor, b: torch.Tensor, scatter_dim: int, group_name: str, reduce_op: str
) -> torch.Tensor:
    """``reduce_scatter(a @ b, scatter_dim)`` over ``group_name``, summed or averaged."""
    group = _resolve_process_group(group_name)
    choice = GlobalBackendManager.get_async_tp_backend(precision_of(a.dtype))
    return MatmulReduceScatterDispatcher.dispatch(
        choice, a=a, b=b, scatter_dim=scatter_dim, group=group, reduce_op=reduce_op
    )


@fused_matmul_reduce_scatter_impl.register_fake
def _fused_matmul_reduce_scatter_fake(a, b, scatter_dim, group_name, reduce_op):
    shape = [*a.shape[:-1], b.shape[1]]
    shape[scatter_dim] //= group_size(group_name)
    return a.new_empty(shape)
