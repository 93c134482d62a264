"""Host time per GEMM call: what Python dispatch adds on top of the kernel launch.

A small shape keeps the GPU idle, so enqueueing ``--calls`` calls without a sync measures the host
path alone: ``torch.matmul``, then ``primus_turbo.pytorch.ops.gemm`` pinned to each backend and under
autotune, with and without autograd.

Example::

    python -m benchmark.ops.training.bench_gemm_overhead --calls 2000
"""

from __future__ import annotations

import argparse
import time

import torch
from tabulate import tabulate


def host_us(fn, calls: int) -> float:
    """Microseconds of host time per call of ``fn`` (warm), synchronizing only at the end."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main(argv: list[str] | None = None) -> None:
    """Print host microseconds per call for each way of running a small GEMM."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args(argv)

    from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager
    from primus_turbo.pytorch.ops import gemm

    n = args.size
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    rows = [["torch.matmul", host_us(lambda: torch.matmul(a, w.t()), args.calls)]]
    with torch.no_grad():
        rows.append(["torch.matmul (no_grad)", host_us(lambda: torch.matmul(a, w.t()), args.calls)])
    for label in ("default", "HIPBLASLT", "TRITON", "TORCH", "AUTO"):
        GlobalBackendManager.reset()
        if label == "AUTO":
            GlobalBackendManager.set_auto_tune(True)
        elif label != "default":
            GlobalBackendManager.set_gemm_backend(BackendType[label])
        rows.append([f"gemm {label}", host_us(lambda: gemm(a, w, trans_b=True), args.calls)])
        with torch.no_grad():
            rows.append([f"gemm {label} (no_grad)", host_us(lambda: gemm(a, w, trans_b=True), args.calls)])
    GlobalBackendManager.reset()
    print(tabulate(rows, headers=["call", "host us/call"], floatfmt=".1f"))


if __name__ == "__main__":
    main()
