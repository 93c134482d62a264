"""Host time per call of flash attention on a GPU, at a shape small enough that the GPU waits on the host.

Host time over many calls (``bench_gemm_overhead.host_us``, one synchronize at the end) of the TRITON
backend's forward and forward + backward, of the default route (SDPA, cuDNN first) and of a bare
``scaled_dot_product_attention``; the TRITON launchers alone, called from the main thread and from a
second thread (autograd runs a CUDA backward on its own thread); a trivial ``autograd.Function`` round
trip; then the host time per Python function of the TRITON step (cProfile: on Python 3.12 it sees every
thread) and torch.profiler's CPU table.

    PYTHONPATH=. python scripts/profile_attention_host.py --tokens 128 --heads 32,8 --dim 128
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import threading
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from benchmark.ops.training.bench_gemm_overhead import host_us
from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager
from primus_turbo.pytorch.ops import flash_attn_func
from primus_turbo.triton.attention import flash_attn_kernel as kernels


def in_thread(fn: Callable[[], float]) -> float:
    """``fn()`` run on a second thread."""
    result: list[float] = []
    worker = threading.Thread(target=lambda: result.append(fn()))
    worker.start()
    worker.join()
    return result[0]


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


def main(argv: list[str] | None = None) -> None:
    """Print the per-call host times, then the cProfile and torch.profiler tables of the TRITON step."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--heads", default="32,8", help="query heads, key/value heads")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--calls", type=int, default=300)
    args = p.parse_args(argv)
    h_q, h_kv = (int(h) for h in args.heads.split(","))
    q, k, v = (
        torch.randn(1, args.tokens, h, args.dim, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        for h in (h_q, h_kv, h_kv)
    )
    grad = torch.randn(1, args.tokens, h_q, args.dim, dtype=torch.bfloat16, device="cuda")

    def attention() -> torch.Tensor:
        return flash_attn_func(q, k, v, causal=True)

    def sdpa() -> torch.Tensor:
        views = (t.transpose(1, 2) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(*views, is_causal=True, enable_gqa=h_q != h_kv)
        return out.transpose(1, 2)

    def forward(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                fn()

        return run

    def step(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        return lambda: fn().backward(grad)

    rows = []
    for label in ("TRITON", "DEFAULT"):
        GlobalBackendManager.reset()
        if label == "TRITON":
            GlobalBackendManager.set_attn_backend(BackendType.TRITON)
        rows.append((f"{label} forward", host_us(forward(attention), args.calls)))
        rows.append((f"{label} forward + backward", host_us(step(attention), args.calls)))
    rows.append(("bare SDPA forward", host_us(forward(sdpa), args.calls)))
    rows.append(("bare SDPA forward + backward", host_us(step(sdpa), args.calls)))

    qd, kd, vd = (t.detach() for t in (q, k, v))
    out = torch.empty_like(grad)
    lse = kernels.flash_attn_fwd_triton(qd, kd, vd, None, args.dim**-0.5, -1, 0, out)
    grads = [torch.empty_like(t) for t in (qd, kd, vd)]

    def fwd_launcher() -> None:
        kernels.flash_attn_fwd_triton(qd, kd, vd, None, args.dim**-0.5, -1, 0, out)

    def bwd_launcher() -> None:
        kernels.flash_attn_bwd_triton(grad, qd, kd, vd, out, lse, args.dim**-0.5, -1, 0, *grads)

    rows.append(("TRITON forward launcher", host_us(fwd_launcher, args.calls)))
    rows.append(("TRITON backward launcher", host_us(bwd_launcher, args.calls)))
    rows.append(
        ("TRITON backward launcher, 2nd thread", in_thread(lambda: host_us(bwd_launcher, args.calls)))
    )
    x = torch.randn(grad.shape, device="cuda", requires_grad=True)
    rows.append(
        (
            "trivial autograd.Function fwd + bwd",
            host_us(lambda: _Identity.apply(x).backward(grad.float()), args.calls),
        )
    )
    for name, us in rows:
        print(f"{name:40s} {us:9.1f} us")

    GlobalBackendManager.reset()
    GlobalBackendManager.set_attn_backend(BackendType.TRITON)
    triton_step = step(attention)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(200):
        triton_step()
    torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            triton_step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
