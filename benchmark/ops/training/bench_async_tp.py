"""Async TP: all-gather + GEMM and GEMM + reduce-scatter across the GPUs of one host, bf16.

One process per rank (NCCL on GPUs, gloo on the CPU for a smoke run). Per shape, timed per call,
interleaved, each call between two barriers (the slowest rank's median):

- ``turbo``: ``ops.fused_all_gather_matmul`` / ``ops.fused_matmul_reduce_scatter`` (the selected backend,
  ``PRIMUS_TURBO_ASYNC_TP_BACKEND``);
- ``ring``: the TURBO backend (the GEMM overlapped with point-to-point transfers on a ring), called
  directly;
- ``sequential``: the NCCL collective, then cuBLAS (``torch.mm``), one after the other;
- ``torch fused``: PyTorch's ``torch.ops.symm_mem.fused_all_gather_matmul`` /
  ``fused_matmul_reduce_scatter`` (GPUs only; symmetric memory without multicast);
- ``comm`` and ``gemm`` alone, for the overlap efficiency max(t_comm, t_gemm) / t_turbo.

    python -m benchmark.ops.training.bench_async_tp -o async_tp.csv
    python -m benchmark.ops.training.bench_async_tp --device cpu --world 2 --shapes tiny
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from benchmark.ops.training.bench_utils import platform_name, spawn_ranks, timed_across_ranks
from benchmark.ops.training.config import ASYNC_TP_SHAPE_SETS, TPShape, async_tp_shapes

LOG = logging.getLogger("bench_async_tp")


def _torch_fused(shape: TPShape, a: torch.Tensor, b: torch.Tensor, group_name: str) -> Callable | None:
    """PyTorch's symmetric-memory op for the shape, or None where it cannot run."""
    if a.device.type != "cuda" or not hasattr(torch.ops, "symm_mem"):
        return None
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    enable_symm_mem_for_group(group_name)
    if shape.kind == "all-gather":
        return lambda: torch.ops.symm_mem.fused_all_gather_matmul(a, [b], 0, group_name, return_A=False)
    return lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, group_name)


def _calls(shape: TPShape, world: int, device: torch.device) -> dict[str, Callable[[], object]]:
    """The timed functions of one shape on this rank."""
    from primus_turbo.pytorch.kernels.async_tp.async_tp_impl import (
        RingAllGatherMatmulBackend,
        RingMatmulReduceScatterBackend,
    )
    from primus_turbo.pytorch.ops import fused_all_gather_matmul, fused_matmul_reduce_scatter

    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(dist.get_rank())
    rows = shape.M // world if shape.kind == "all-gather" else shape.M
    a = torch.randn(rows, shape.K, generator=gen).to(device, torch.bfloat16)
    b = (torch.randn(shape.K, shape.N, generator=gen) / shape.K**0.5).to(device, torch.bfloat16)
    if shape.kind == "all-gather":
        gathered = a.new_empty(shape.M, shape.K)
        calls = {
            "turbo": lambda: fused_all_gather_matmul(a, [b], 0, group, return_a=False),
            "ring": lambda: RingAllGatherMatmulBackend.execute(a_shard=a, bs=[b], gather_dim=0, group=group),
            "sequential": lambda: (dist.all_gather_into_tensor(gathered, a, group=group), gathered @ b),
            "comm": lambda: dist.all_gather_into_tensor(gathered, a, group=group),
            "gemm": lambda: gathered @ b,
        }
    else:
        full = a.new_empty(shape.M, shape.N)
        shard = a.new_empty(shape.M // world, shape.N)
        calls = {
            "turbo": lambda: fused_matmul_reduce_scatter(a, b, 0, group),
            "ring": lambda: RingMatmulReduceScatterBackend.execute(
                a=a, b=b, scatter_dim=0, group=group, reduce_op="sum"
            ),
            "sequential": lambda: dist.reduce_scatter_tensor(shard, torch.mm(a, b, out=full), group=group),
            "comm": lambda: dist.reduce_scatter_tensor(shard, full, group=group),
            "gemm": lambda: torch.mm(a, b, out=full),
        }
    fused = _torch_fused(shape, a, b, group.group_name)
    if fused is not None:
        calls["torch fused"] = fused
    return calls


def _run(rank: int, world: int, args: argparse.Namespace) -> list[dict] | None:
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    rows = []
    for shape in async_tp_shapes(args.shapes, world):
        times = timed_across_ranks(_calls(shape, world, device), args.iters, args.device)
        names = list(times)
        slowest = torch.tensor([times[n] for n in names], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        ms = dict(zip(names, slowest.tolist(), strict=True))
        turbo, fused = ms["turbo"], ms.get("torch fused", float("nan"))
        row = {"Model": shape.model, "GEMM": shape.gemm, "Collective": shape.kind, "Ranks": world,
               "M": shape.M, "N": shape.N, "K": shape.K, "turbo ms": turbo, "ring ms": ms["ring"],
               "sequential ms": ms["sequential"],
               "torch fused ms": fused, "comm ms": ms["comm"], "gemm ms": ms["gemm"],
               "vs sequential": ms["sequential"] / turbo, "vs torch fused": fused / turbo,
               "overlap efficiency": max(ms["comm"], ms["gemm"]) / turbo,
               "ring vs sequential": ms["sequential"] / ms["ring"],
               "Platform": platform_name(args.device)}  # fmt: skip
        rows.append(row)
        if rank == 0:
            LOG.info("%s %s M %d: turbo %.3f ms, sequential %.3f ms", shape.gemm, shape.kind, shape.M, turbo,
                     ms["sequential"])  # fmt: skip
    return rows if rank == 0 else None


def main(argv: list[str] | None = None) -> None:
    """Spawn one process per rank and time each shape's calls."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--world", type=int, default=0, help="ranks (default: every GPU, or 2 on the CPU)")
    p.add_argument("--shapes", choices=ASYNC_TP_SHAPE_SETS, default="llama70b")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("-o", "--output", default="bench_async_tp.csv")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    columns = ["GEMM", "Collective", "M", "N", "K", "turbo ms", "ring ms", "sequential ms", "torch fused ms",
               "vs sequential", "vs torch fused", "ring vs sequential", "overlap efficiency"]  # fmt: skip
    spawn_ranks(_run, args, "async TP", columns)


if __name__ == "__main__":
    main()
