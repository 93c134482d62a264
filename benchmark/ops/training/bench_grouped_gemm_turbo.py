"""Grouped GEMM (MoE experts) against ``torch._grouped_mm`` and a per-expert ``torch.matmul`` loop.

Per model, EP degree (experts per GPU = experts / EP), tokens per expert and routing (balanced, or
skewed with weights 0.2 + 0.8 * rand), for the expert fc1 (gate+up, [T, H] x [G, 2I, H]^T) and fc2
([T, I] x [G, H, I]^T) GEMMs: forward and backward (dgrad + variable-K wgrad) time and TFLOP/s of each
backend label, the peers in the same run, and the ratios. Labels: a backend name pins it, DEFAULT is the
library's selection out of the box (no pin, no autotune), AUTO turns autotune on. See
``benchmark/README.md``.

Example::

    python -m benchmark.ops.training.bench_grouped_gemm_turbo --shapes quick --backends TORCH,DEFAULT
"""

from __future__ import annotations

import argparse
import csv
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tabulate import tabulate

from benchmark.ops.training.bench_utils import (
    add_timer_argument,
    graph_timer,
    platform_name,
    time_interleaved,
    timing_stream,
    write_csv,
)
from benchmark.ops.training.config import MOE_MODELS, MoEModelConfig

LOG = logging.getLogger("bench_grouped_gemm_turbo")
GPT_OSS_20B = MoEModelConfig("GPT-OSS-20B", 32, 2880, 2880, 4)


@dataclass(frozen=True)
class Case:
    """One grouped GEMM: ``groups`` experts of [n, k] weights over ``groups * tokens`` routed rows."""

    model: str
    gemm: str
    ep: int
    groups: int
    tokens: int
    n: int
    k: int
    routing: str


def cases(name: str) -> list[Case]:
    """fc1 and fc2 of every MoE model at EP 8/16/32 and 512-16384 tokens per expert."""
    if name == "tiny":
        return [Case("tiny", "fc1", 1, 4, 16, 48, 32, routing) for routing in ("balanced", "skewed")]
    models = [*MOE_MODELS.values(), GPT_OSS_20B]
    eps, tokens = ((8,), (2048,)) if name == "quick" else ((8, 16, 32), (512, 2048, 8192, 16384))
    out = []
    for model in models:
        for ep in eps:
            groups = max(1, model.num_experts // ep)
            for t in tokens:
                for routing in ("balanced", "skewed"):
                    fc1 = Case(
                        model.name, "fc1", ep, groups, t, 2 * model.moe_intermediate, model.hidden, routing
                    )
                    fc2 = Case(
                        model.name, "fc2", ep, groups, t, model.hidden, model.moe_intermediate, routing
                    )
                    out += [fc1, fc2]
    return out


def group_lens(case: Case, device: str) -> torch.Tensor:
    """Tokens per expert summing to ``groups * tokens``: equal, or skewed by 0.2 + 0.8 * rand."""
    total = case.groups * case.tokens
    if case.routing == "balanced":
        return torch.full((case.groups,), case.tokens, dtype=torch.int64, device=device)
    gen = torch.Generator().manual_seed(case.groups * 7 + case.tokens)
    weights = 0.2 + 0.8 * torch.rand(case.groups, generator=gen)
    lens = (weights / weights.sum() * total).long()
    lens[-1] += total - lens.sum()
    return lens.to(device)


def time_fwd_bwd(
    fns: dict[str, Callable], a: torch.Tensor, b: torch.Tensor, device: str, graph: bool = False
) -> dict[str, tuple[float, float]]:
    """(forward ms, backward ms) of each ``fn(a, b)``, the functions interleaved call by call; every
    backward gets the same output gradient. ``graph`` times CUDA-graph replays (device time only)."""
    names = list(fns)
    with timing_stream(graph):
        with torch.no_grad():
            fwd = time_interleaved([functools.partial(fns[n], a, b) for n in names], None, device, graph)
        outs = [fns[n](a, b) for n in names]
        grad = torch.randn_like(outs[0])
        backwards = [functools.partial(out.backward, grad, retain_graph=True) for out in outs]
        bwd = time_interleaved(backwards, [a, b], device, graph)
    a.grad = b.grad = None
    return {name: (f, bw) for name, f, bw in zip(names, fwd, bwd, strict=True)}


def main(argv: list[str] | None = None) -> None:
    """Benchmark every case for every backend label and write the CSV."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", choices=("full", "quick", "tiny"), default="quick")
    p.add_argument("--backends", default="TRITON,TORCH,DEFAULT,AUTO")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    p.add_argument(
        "--granularity",
        choices=("tensorwise", "rowwise", "blockwise"),
        default="tensorwise",
        help="FP8 scaling with --dtype fp8 (rows from bench_grouped_gemm_fp8.py)",
    )
    add_timer_argument(p)
    p.add_argument("-o", "--output", default="bench_grouped_gemm.csv")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.dtype == "fp8":
        run_fp8(args)
        return

    from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager
    from primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_impl import GroupedGemmDispatcher
    from primus_turbo.pytorch.ops import grouped_gemm

    labels = [b.strip().upper() for b in args.backends.split(",") if b.strip()]
    rows = []
    for case in cases(args.shapes):
        lens = group_lens(case, args.device)
        offs32 = torch.cumsum(lens, 0).to(torch.int32)
        bounds = [0, *torch.cumsum(lens.cpu(), 0).tolist()]
        a = torch.randn(bounds[-1], case.k, device=args.device, dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(case.groups, case.n, case.k, device=args.device, dtype=torch.bfloat16) * case.k**-0.5
        b.requires_grad_()
        flops = 2 * bounds[-1] * case.n * case.k

        def peer(a, b, offs32=offs32):
            return torch._grouped_mm(a, b.transpose(1, 2), offs=offs32)

        def loop(a, b, bounds=bounds):
            return torch.cat([a[bounds[g] : bounds[g + 1]] @ b[g].t() for g in range(len(bounds) - 1)])

        for label in labels:
            GlobalBackendManager.reset()
            if label == "AUTO":
                GlobalBackendManager.set_auto_tune(True)
            elif label != "DEFAULT":
                GlobalBackendManager.set_grouped_gemm_backend(BackendType[label])
            row = {"Model": case.model, "GEMM": case.gemm, "EP": case.ep, "Experts": case.groups}
            row.update(Tokens=case.tokens, N=case.n, K=case.k, Routing=case.routing, Backend=label)
            try:

                def turbo(a, b, lens=lens):
                    return grouped_gemm(a, b, lens, trans_b=True)

                reference = loop(a.detach().float(), b.detach().float())
                out = turbo(a.detach(), b.detach())
                row["Selected"] = GroupedGemmDispatcher.last_selected().name
                err = ((out.float() - reference).norm() / reference.norm()).item()
                row["Check"] = "PASS" if err < 1e-2 else f"FAIL {err:.1e}"
                fns = {"turbo": turbo, "peer": peer, "loop": loop}
                times = time_fwd_bwd(fns, a, b, args.device, graph_timer(args))
                for key, (fwd_ms, bwd_ms) in times.items():
                    row[f"{key} fwd ms"], row[f"{key} bwd ms"] = fwd_ms, bwd_ms
                row["Fwd TFLOPS"] = flops / row["turbo fwd ms"] / 1e9
                row["Bwd TFLOPS"] = 2 * flops / row["turbo bwd ms"] / 1e9
                for direction in ("fwd", "bwd"):
                    row[f"{direction} vs grouped_mm"] = (
                        row[f"peer {direction} ms"] / row[f"turbo {direction} ms"]
                    )
                    row[f"{direction} vs loop"] = row[f"loop {direction} ms"] / row[f"turbo {direction} ms"]
            except Exception as exc:  # report the row and keep benchmarking
                row["Check"] = f"ERROR {type(exc).__name__}: {exc}"[:200]
                LOG.warning("%s", row["Check"])
            row["Platform"] = platform_name(args.device)
            rows.append(row)
            LOG.info("%s", {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
        if args.device == "cuda":
            torch.cuda.empty_cache()
    columns = ["Model", "GEMM", "EP", "Tokens", "Routing", "Backend", "Check", "Fwd TFLOPS"]
    columns += ["fwd vs grouped_mm", "bwd vs grouped_mm", "fwd vs loop"]
    print(tabulate([[r.get(c, "-") for c in columns] for r in rows], headers=columns, floatfmt=".2f"))
    write_csv(args.output, rows)


def run_fp8(args: argparse.Namespace) -> None:
    """The FP8 rows (``bench_grouped_gemm_fp8``), written to the CSV as they come."""
    from benchmark.ops.training import bench_grouped_gemm_fp8

    labels = [b.strip().upper() for b in args.backends.split(",") if b.strip()]
    rows = []
    with open(args.output, "w", newline="") as f:
        writer = None
        for case in cases(args.shapes):
            for row in bench_grouped_gemm_fp8.bench_case(case, group_lens(case, args.device), labels, args):
                LOG.info("%s", {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
                if writer is None:
                    writer = csv.DictWriter(f, fieldnames=FP8_COLUMNS, extrasaction="ignore")
                    writer.writeheader()
                writer.writerow(row)
                rows.append(row)
            f.flush()
            if args.device == "cuda":
                torch.cuda.empty_cache()
    bench_grouped_gemm_fp8.print_tables(rows, labels)


FP8_COLUMNS = [
    "Model", "GEMM", "EP", "Experts", "Tokens", "N", "K", "Routing", "Granularity", "Backend", "Selected",
    "Check", "SNR dB", "GEMM ms", "GEMM TFLOPS", "Peer ms", "Peer TFLOPS", "Ratio vs peer", "BF16 ms",
    "Ratio vs bf16", "Fwd ms", "BF16 Fwd ms", "Fwd ratio vs bf16", "Step ms", "BF16 Step ms",
    "Step ratio vs bf16", "Platform",
]  # fmt: skip


if __name__ == "__main__":
    main()
