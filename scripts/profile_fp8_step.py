"""Kernel-time breakdown of one FP8 training step (quantize + forward + backward) per granularity.

Prints torch.profiler's CUDA-time table (the kernel names tell vendor from Triton GEMMs) next to the
bf16 step, so a slow step can be traced to its GEMMs or to its quantization kernels; ``--host`` adds the
host time per Python function, for steps whose wall time exceeds their kernel time. ``--grouped
GxTxNxK`` profiles ``grouped_gemm_fp8`` (G experts, T tokens each, [G, N, K] weights) instead of
``gemm_fp8``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from benchmark.ops.training.bench_gemm_fp8 import GRANULARITY_NAMES, quant_config
from primus_turbo.pytorch.core.backend import GlobalBackendManager
from primus_turbo.pytorch.ops import gemm_fp8, grouped_gemm, grouped_gemm_fp8


def linear_steps(mnk: str, names: list[str]) -> dict[str, Callable[[], None]]:
    """bf16 and FP8 steps of one Linear, M x N x K = tokens x out x in."""
    m, n, k = (int(v) for v in mnk.split("x"))
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5).requires_grad_()
    grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    steps: dict[str, Callable[[], None]] = {"bf16": lambda: torch.matmul(a, w.t()).backward(grad)}
    for name in names:
        config = quant_config(name)
        steps[name] = lambda config=config: gemm_fp8(a, w, trans_b=True, config=config).backward(grad)
    return steps


def grouped_steps(gtnk: str, names: list[str]) -> dict[str, Callable[[], None]]:
    """bf16 steps of ``torch._grouped_mm`` and of the library's ``grouped_gemm``, and the FP8 grouped
    steps, of G balanced experts."""
    g, t, n, k = (int(v) for v in gtnk.split("x"))
    lens = torch.full((g,), t, dtype=torch.int64, device="cuda")
    offs32 = torch.cumsum(lens, 0).to(torch.int32)
    a = torch.randn(g * t, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5).requires_grad_()
    grad = torch.randn(g * t, n, device="cuda", dtype=torch.bfloat16)

    def bf16() -> None:
        torch._grouped_mm(a, w.transpose(1, 2), offs=offs32).backward(grad)

    def bf16_turbo() -> None:
        grouped_gemm(a, w, lens, trans_b=True).backward(grad)

    steps: dict[str, Callable[[], None]] = {"bf16": bf16, "bf16 grouped_gemm": bf16_turbo}
    for name in names:
        config = quant_config(name)

        def step(config=config) -> None:
            grouped_gemm_fp8(a, w, lens, trans_b=True, config=config).backward(grad)

        steps[name] = step
    return steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mnk", default="4096x57344x8192", help="M x N x K of the Linear (tokens, out, in)")
    p.add_argument("--grouped", default="", help="G x T x N x K: profile the grouped GEMM instead")
    p.add_argument("--granularities", default="tensorwise,rowwise,blockwise")
    p.add_argument("--rows", type=int, default=14, help="kernels shown per table")
    p.add_argument("--host", action="store_true", help="also print cProfile's host-time table per step")
    args = p.parse_args()
    names = args.granularities.split(",")
    for name in names:
        assert name in GRANULARITY_NAMES, name
    shape = args.grouped or args.mnk
    steps = grouped_steps(shape, names) if args.grouped else linear_steps(shape, names)
    for name, step in steps.items():
        GlobalBackendManager.reset()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        events = prof.key_averages()
        total = sum(e.self_device_time_total for e in events) / 5 / 1e3
        launches = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA) // 5
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            step()
        end.record()
        end.synchronize()
        wall = start.elapsed_time(end) / 10
        print(
            f"\n== {name} step, {shape}: {total:.3f} ms of kernel time, {wall:.3f} ms wall, "
            f"{launches} kernels per step"
        )
        print(events.table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=70))
        if args.host:
            host = cProfile.Profile()
            host.enable()
            for _ in range(10):
                step()
            host.disable()
            torch.cuda.synchronize()
            pstats.Stats(host).sort_stats("tottime").print_stats(args.rows)


if __name__ == "__main__":
    main()
