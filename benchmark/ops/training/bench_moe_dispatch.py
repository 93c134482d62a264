"""Expert-parallel dispatch and combine across the GPUs of one host, against Megatron's all-to-all path.

One process per rank (NCCL on GPUs, gloo on the CPU for a smoke run). Every rank routes ``--tokens``
random tokens of ``--hidden`` bf16 (or FP8 with 1 x 128 scales, ``--fp8``) to ``--topk`` of ``--experts``
experts. Timed per call, interleaved, each call between two barriers:

- ``Buffer.dispatch`` with a precomputed layout (as DeepEP's own test times it), and ``Buffer.combine``
  with its handle, on the selected backend (``PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND``); with
  ``--worst`` also the fixed-size (``num_worst_tokens``) path;
- Megatron's path without DeepEP: group the tokens by destination rank, exchange the counts, read them
  on the host, ``all_to_all_single``; combine sends the rows back and sums them with ``index_add_``.

Bandwidth follows DeepEP: bytes received by a rank, its own share included, over the call's time (the
slowest rank's median). Run on the GPUs of one host::

    python -m benchmark.ops.training.bench_moe_dispatch -o dispatch.csv
    python -m benchmark.ops.training.bench_moe_dispatch --device cpu --world 2 --tokens 64 --hidden 256
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from benchmark.ops.training.bench_utils import platform_name, spawn_ranks, timed_across_ranks

LOG = logging.getLogger("bench_moe_dispatch")


def megatron_dispatch(x: torch.Tensor, in_rank: torch.Tensor, group: dist.ProcessGroup) -> tuple:
    """Rows grouped by destination rank, counts exchanged and read on the host, one all-to-all."""
    ranks = in_rank.shape[1]
    order = in_rank.t().nonzero()[:, 1]
    send = in_rank.sum(0)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send_list, recv_list = send.tolist(), recv.tolist()
    out = x.new_empty((sum(recv_list), x.shape[1]))
    dist.all_to_all_single(out, x.index_select(0, order), recv_list, send_list, group=group)
    return out, (order, send_list, recv_list, x.shape[0], ranks)


def megatron_combine(y: torch.Tensor, handle: tuple, group: dist.ProcessGroup) -> torch.Tensor:
    """Rows back to their sources, summed per token in fp32 with ``index_add_``."""
    order, send_list, recv_list, tokens, _ = handle
    back = y.new_empty((sum(send_list), y.shape[1]))
    dist.all_to_all_single(back, y, send_list, recv_list, group=group)
    out = torch.zeros((tokens, y.shape[1]), dtype=torch.float32, device=y.device)
    return out.index_add_(0, order, back.float()).to(y.dtype)


def _run(rank: int, world: int, args: argparse.Namespace) -> list[dict] | None:
    from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager, PrecisionType
    from primus_turbo.pytorch.deep_ep import Buffer

    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(args.tokens, args.hidden, generator=gen).to(device, torch.bfloat16)
    topk_idx = torch.rand(args.tokens, args.experts, generator=gen).topk(args.topk, dim=-1).indices.to(device)
    topk_weights = torch.rand(args.tokens, args.topk, generator=gen).to(device)
    payload: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = x
    row_bytes = args.hidden * x.element_size()
    if args.fp8:
        from primus_turbo.pytorch.core.low_precision import ScalingGranularity
        from primus_turbo.pytorch.ops import quantize_fp8

        q, scales = quantize_fp8(x, torch.float8_e4m3fn, ScalingGranularity.BLOCKWISE, block_size=128, axis=1)
        if scales.shape[0] != args.tokens:  # block-major scales: one row per token
            scales = scales.reshape(-1, args.tokens).t().contiguous()
        payload = (q, scales)
        row_bytes = args.hidden + scales.shape[1] * scales.element_size()
    buffer = Buffer(group)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, args.experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    received = int(in_rank.sum(0).sum())  # this rank's sends; the receive count comes from a dispatch

    def dispatch(worst: int = 0):
        return buffer.dispatch(
            payload, topk_idx=topk_idx, topk_weights=topk_weights, num_worst_tokens=worst, **layout
        )

    recv, _, _, _, handle, _ = dispatch()
    recv_x = recv[0] if isinstance(recv, tuple) else recv
    received = recv_x.shape[0]
    expert_out = torch.randn(received, args.hidden, generator=gen).to(device, torch.bfloat16)
    base_out, base_handle = megatron_dispatch(x, in_rank, group)
    base_y = torch.randn(base_out.shape[0], args.hidden, generator=gen).to(device, torch.bfloat16)
    fns: dict[str, Callable[[], object]] = {
        "dispatch": dispatch,
        "combine": lambda: buffer.combine(expert_out, handle),
        "megatron dispatch": lambda: megatron_dispatch(x, in_rank, group),
        "megatron combine": lambda: megatron_combine(base_y, base_handle, group),
    }
    worst = args.tokens * world
    if args.worst:
        worst_recv, _, _, _, worst_handle, _ = dispatch(worst)
        worst_rows = (worst_recv[0] if isinstance(worst_recv, tuple) else worst_recv).shape[0]
        worst_out = torch.randn(worst_rows, args.hidden, generator=gen).to(device, torch.bfloat16)
        fns["dispatch (num_worst_tokens)"] = lambda: dispatch(worst)
        fns["combine (num_worst_tokens)"] = lambda: buffer.combine(worst_out, worst_handle)
    times = timed_across_ranks(fns, args.iters, args.device)
    names = list(times)
    slowest = torch.tensor([times[n] for n in names], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    counts = torch.tensor([received], dtype=torch.int64, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=group)
    if rank:
        return None
    choice = GlobalBackendManager.get_moe_dispatch_combine_backend(PrecisionType.BF16_FP16_FP32)
    backend = BackendType.TORCH.name
    if choice is not None and choice.backend is not None:
        backend = choice.backend.name
    sms = "collective" if backend == BackendType.TORCH.name else getattr(type(buffer), "num_sms", "")
    rows = []
    recv_bytes = int(counts) * row_bytes
    combine_bytes = int(counts) * args.hidden * 2
    for name, ms in zip(names, slowest.tolist(), strict=True):
        moved = combine_bytes if "combine" in name else recv_bytes
        if "megatron" in name:
            moved = int(counts) * args.hidden * 2
        row = {
            "Call": name,
            "Backend": "all_to_all_single" if "megatron" in name else backend,
            "Ranks": world,
            "Tokens/rank": args.tokens,
            "Hidden": args.hidden,
            "Topk": args.topk,
            "Experts": args.experts,
            "Dtype": "fp8" if args.fp8 and "dispatch" in name and "megatron" not in name else "bf16",
            "Received rows (max rank)": int(counts),
            "ms": ms,
            "GB/s": moved / ms / 1e6,
            "SMs": "collective" if "megatron" in name else sms,
            "Platform": platform_name(args.device),
        }
        rows.append(row)
    for kind in ("dispatch", "combine"):
        ours = next(r for r in rows if r["Call"] == kind)
        ours["vs megatron"] = next(r for r in rows if r["Call"] == f"megatron {kind}")["ms"] / ours["ms"]
    return rows


def main(argv: list[str] | None = None) -> None:
    """Spawn one process per rank and time dispatch and combine."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--world", type=int, default=0, help="ranks (default: every GPU, or 2 on the CPU)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--fp8", action="store_true", help="dispatch FP8 rows with 1 x 128 scales")
    p.add_argument("--worst", action="store_true", help="also time the fixed-size num_worst_tokens path")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("-o", "--output", default="bench_moe_dispatch.csv")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    columns = ["Call", "Backend", "Dtype", "Received rows (max rank)", "ms", "GB/s", "vs megatron", "SMs"]
    spawn_ranks(_run, args, "dispatch", columns)


if __name__ == "__main__":
    main()
