"""Host time per GEMM call: what Python dispatch adds on top of the kernel launch.

A small shape keeps the GPU idle, so enqueueing ``--calls`` calls without a sync measures the host
path alone: ``torch.matmul``, then ``primus_turbo.pytorch.ops.gemm`` pinned to each backend and under
autotune, with and without autograd; then the grouped GEMM (``torch._grouped_mm`` next to
``grouped_gemm`` per backend, forward alone and forward + backward, and ``grouped_gemm_fp8`` per
scaling), whose small MoE layers (Qwen3-30B-A3B's 768-wide experts) are short enough for host time to
show in the step.

Example::

    python -m benchmark.ops.training.bench_gemm_overhead --calls 2000
"""

from __future__ import annotations

import argparse
import functools

import torch
from tabulate import tabulate

from benchmark.ops.training.bench_host_overhead import host_us as bench_host_us


def host_us(fn, calls: int) -> float:
    """Microseconds of host time per call of ``fn`` (warm), synchronizing only at the end."""
    return bench_host_us(fn, calls, torch.device("cuda"), warmup=50)


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
    rows += grouped_rows(args.calls)
    print(tabulate(rows, headers=["call", "host us/call"], floatfmt=".1f"))


def grouped_rows(calls: int, groups: int = 4, tokens: int = 64, n: int = 256, k: int = 256) -> list[list]:
    """Host microseconds per grouped GEMM call: the vendor op, then each library path."""
    from benchmark.ops.training.bench_gemm_fp8 import quant_config
    from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager
    from primus_turbo.pytorch.ops import grouped_gemm, grouped_gemm_fp8

    lens = torch.full((groups,), tokens, dtype=torch.int64, device="cuda")
    offs32 = torch.cumsum(lens, 0).to(torch.int32)
    a = torch.randn(groups * tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(groups, n, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(groups * tokens, n, device="cuda", dtype=torch.bfloat16)

    def vendor():
        return torch._grouped_mm(a, b.transpose(1, 2), offs=offs32)

    def turbo(config=None):
        if config is None:
            return grouped_gemm(a, b, lens, trans_b=True)
        return grouped_gemm_fp8(a, b, lens, trans_b=True, config=config)

    def measure(label: str, fn) -> list[list]:
        with torch.no_grad():
            fwd = host_us(fn, calls)
        step = host_us(lambda: fn().backward(grad), calls)
        return [[f"{label} (no_grad)", fwd], [f"{label} fwd+bwd", step]]

    rows = measure("torch._grouped_mm", vendor)
    for label in ("default", "TORCH", "TRITON"):
        GlobalBackendManager.reset()
        if label != "default":
            GlobalBackendManager.set_grouped_gemm_backend(BackendType[label])
        rows += measure(f"grouped_gemm {label}", turbo)
    GlobalBackendManager.reset()
    for name in ("tensorwise", "rowwise", "blockwise"):
        rows += measure(f"grouped_gemm_fp8 {name}", functools.partial(turbo, quant_config(name)))
    return rows


if __name__ == "__main__":
    main()
