"""Kernel-time breakdown of one FP8 Linear training step (quantize + forward + backward) per granularity.

Prints torch.profiler's CUDA-time table (the kernel names tell cuBLAS from Triton GEMMs) next to the bf16
step, so a slow step can be traced to its GEMMs or to its quantization kernels.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from benchmark.ops.training.bench_gemm_fp8 import GRANULARITY_NAMES, quant_config
from primus_turbo.pytorch.core.backend import GlobalBackendManager
from primus_turbo.pytorch.ops import gemm_fp8


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mnk", default="4096x57344x8192", help="M x N x K of the Linear (tokens, out, in)")
    p.add_argument("--granularities", default="tensorwise,rowwise,blockwise")
    p.add_argument("--rows", type=int, default=14, help="kernels shown per table")
    args = p.parse_args()
    m, n, k = (int(v) for v in args.mnk.split("x"))
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5).requires_grad_()
    grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    steps: dict[str, object] = {"bf16": lambda: torch.matmul(a, w.t()).backward(grad)}
    for name in args.granularities.split(","):
        assert name in GRANULARITY_NAMES, name
        config = quant_config(name)
        steps[name] = lambda config=config: gemm_fp8(a, w, trans_b=True, config=config).backward(grad)
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
        print(f"\n== {name} step, {m}x{n}x{k}: {total:.3f} ms of kernel time per step")
        print(events.table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=70))


if __name__ == "__main__":
    main()
