"""Helpers shared by the training-op benchmarks: timers, inputs and the platform label."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable

import torch
import triton
import triton.testing

from benchmark.ops.training.config import GemmShape

__all__ = ["MIN_TIMED_CALLS", "cpu_timer", "cuda_graph_timer", "cuda_timer", "make_inputs", "platform_name"]


MIN_TIMED_CALLS = 20  # long GEMMs get a longer timing window so their median has this many samples


def cuda_timer(fn: Callable[[], object], grad_to_none: list[torch.Tensor] | None = None) -> float:
    """Median milliseconds of ``fn`` from CUDA events; triton flushes L2 before every timed call.

    The window is at least 100 ms and at least ``MIN_TIMED_CALLS`` calls, so multi-millisecond GEMMs
    are not judged on a handful of samples.
    """
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    fn()
    end.record()
    end.synchronize()
    rep = max(100.0, MIN_TIMED_CALLS * start.elapsed_time(end))
    return triton.testing.do_bench(fn, warmup=25, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def cuda_graph_timer(fn: Callable[[], object], grad_to_none: list[torch.Tensor] | None = None) -> float:
    """Median milliseconds of ``fn`` replayed from a CUDA graph: device time only, without the host's
    per-call launch and dispatch cost (and without an L2 flush between calls)."""
    fn()  # any first-call tuning and compilation happens outside the capture
    return triton.testing.do_bench_cudagraph(fn, rep=100, grad_to_none=grad_to_none, return_mode="median")


def cpu_timer(
    fn: Callable[[], object], grad_to_none: list[torch.Tensor] | None = None, iters: int = 5
) -> float:
    """Median wall-clock milliseconds of ``fn`` after one warm-up call (CPU smoke tests only)."""
    times = []
    for _ in range(iters + 1):
        for t in grad_to_none or ():
            t.grad = None
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def make_inputs(shape: GemmShape, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    """Random a (M, K) and w (N, K) requiring grad, scaled so that out ~ N(0, 1); grad_out (M, N)."""
    a = torch.randn(shape.M, shape.K, dtype=dtype, device=device, requires_grad=True)
    w = torch.randn(shape.N, shape.K, dtype=dtype, device=device).mul_(shape.K**-0.5).requires_grad_()
    grad_out = torch.randn(shape.M, shape.N, dtype=dtype, device=device)
    return a, w, grad_out


def platform_name(device: str) -> str:
    """``CUDA <gpu>``, ``ROCm <gpu>`` or ``CPU <arch>``."""
    if device == "cpu":
        return f"CPU {platform.machine()}"
    return f"{'ROCm' if torch.version.hip else 'CUDA'} {torch.cuda.get_device_name()}"
