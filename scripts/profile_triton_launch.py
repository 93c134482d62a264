"""Host microseconds per launch: Triton's own launcher against a cached compiled-kernel handle.

Times, for one tiny elementwise kernel with few and with many arguments: a PyTorch op of the same work
(the peer), ``kernel[grid](...)`` (``JITFunction.run``: argument binding, specialization key, cache
lookup, launch), the same kernel under ``@cached_launch`` with ``PRIMUS_TURBO_TRITON_LAUNCHER=cached``, and
the ``CompiledKernel`` that launch returns, called through ``compiled[grid](...)``
and through its ``run`` entry with the stream and metadata prebuilt (what a launcher of our own that
caches per specialization would do). Each variant's output is checked against the peer first. GPU only.

    PYTHONPATH=. python scripts/profile_triton_launch.py --calls 5000
    PYTHONPATH=. python scripts/profile_triton_launch.py --cprofile rmsnorm,swiglu

``--cprofile`` shows where an op's host time goes: it profiles the named rows of ``bench_host_overhead``
(forward under ``no_grad``, then forward + backward) and prints the functions that hold the most time.
"""

from __future__ import annotations

import argparse
import cProfile
import math
import os
import pstats
import sys
from collections.abc import Callable
from unittest import mock

import torch
import triton
import triton.language as tl
from tabulate import tabulate

from benchmark.ops.training.bench_host_overhead import host_us as bench_host_us
from primus_turbo.common.constants import ENV_TRITON_LAUNCHER
from primus_turbo.triton.utils.launch import cached_launch


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * alpha, mask=mask)


@triton.jit
def _scale_kernel_wide(
    x_ptr,
    y_ptr,
    a_ptr,
    b_ptr,
    c_ptr,
    d_ptr,
    n,
    s0,
    s1,
    s2,
    s3,
    s4,
    s5,
    alpha,
    BLOCK: tl.constexpr,
    FLAG_A: tl.constexpr,
    FLAG_B: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    value = tl.load(x_ptr + offs, mask=mask) * alpha
    if FLAG_A:
        value += s0 + s1 + s2 + s3 + s4 + s5
    tl.store(y_ptr + offs, value, mask=mask)


def host_us(fn, calls: int) -> float:
    return bench_host_us(fn, calls, torch.device("cuda"), warmup=100)


def _variants(label, kernel, launch_args, constexprs, grid, x, y, calls) -> list[list]:
    """Host us of ``kernel`` launched through Triton's launcher, the compiled handle and its ``run``."""
    rows = [[f"kernel[grid](...) {label}", host_us(lambda: kernel[grid](*launch_args, **constexprs), calls)]]
    cached = cached_launch(kernel)
    with mock.patch.dict(os.environ, {ENV_TRITON_LAUNCHER: "cached"}):
        y.zero_()
        cached[grid](*launch_args, **constexprs)
        torch.cuda.synchronize()
        ok = torch.equal(y, x * 2.0)
        cached_us = host_us(lambda: cached[grid](*launch_args, **constexprs), calls)
    rows.append([f"@cached_launch {label}", cached_us if ok else float("nan")])
    compiled = kernel[grid](*launch_args, **constexprs)
    runner = None
    for candidate in (launch_args, (*launch_args, *constexprs.values())):
        y.zero_()
        try:
            compiled[grid](*candidate)
            torch.cuda.synchronize()
            if torch.equal(y, x * 2.0):
                runner = candidate
                break
        except Exception as exc:  # the handle's calling convention differs between Triton versions
            print(f"compiled[grid] with {len(candidate)} args: {type(exc).__name__}: {exc}")
    if runner is None:
        return [*rows, [f"compiled[grid](...) {label}", float("nan")]]
    rows.append([f"compiled[grid](...) {label}", host_us(lambda: compiled[grid](*runner), calls)])
    stream = torch.cuda.current_stream().cuda_stream
    compiled._init_handles()

    def raw():
        compiled.run(
            grid[0], 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *runner
        )

    try:
        y.zero_()
        raw()
        torch.cuda.synchronize()
        ok = torch.equal(y, x * 2.0)
        rows.append([f"compiled.run, prebuilt {label}", host_us(raw, calls) if ok else float("nan")])
    except Exception as exc:
        print(f"compiled.run {label}: {type(exc).__name__}: {exc}")
    return rows


def _node_call(fn) -> Callable[[], object] | None:
    """A call of the one autograd node behind ``fn``'s differentiable outputs on their output gradients
    (the outputs kept alive), so that the node's backward alone is timed and profiled on this thread,
    without the engine; None when the outputs come from several nodes."""
    from benchmark.ops.training.bench_host_overhead import _differentiable

    outs = _differentiable(fn())
    nodes = {id(t.grad_fn) for t in outs}
    if len(nodes) != 1:
        return None
    node = outs[0].grad_fn
    # a custom Function's node runs its backward through ``apply``; a C++ node is called
    call = node.apply if isinstance(node, torch.autograd.function.BackwardCFunction) else node
    grads = [torch.ones_like(t) for t in outs]
    return lambda: (outs, call(*grads))


def backward_split(case, calls: int, device: torch.device) -> list[list]:
    """Host us of the forward with autograd, the forward + backward through the engine, and the top backward
    node called directly on this thread, for the op and its peer: where backward host time goes."""
    from benchmark.ops.training.bench_host_overhead import _backward_step

    rows = []
    for label, fn in (("turbo", case.turbo), ("peer", case.peer)):
        if fn is None:
            continue
        with torch.enable_grad():
            fwd = bench_host_us(fn, calls, device, warmup=20)
            step = bench_host_us(_backward_step(fn, case.leaves), calls, device, warmup=20)
            node = _node_call(fn)
            direct = math.nan
            if node is not None:
                try:
                    direct = bench_host_us(node, calls, device, warmup=20)
                except (RuntimeError, TypeError) as exc:  # saved tensors gone, or more grads expected
                    print(f"{case.name} {label}: direct node call failed: {exc}")
        rows.append([case.name, label, fwd, step, step - fwd, direct])
    return rows


def profile_cases(names: list[str], calls: int, top: int) -> None:
    """cProfile of ``calls`` forward, forward + backward and direct backward-node calls of each named
    host-bench row, then the backward split of each (``backward_split``)."""
    from benchmark.ops.training.bench_host_overhead import _backward_step, _sync, op_cases

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    split: list[list] = []
    for case in op_cases(device):
        if not any(name == case.name.split()[0] for name in names):
            continue
        steps = [("forward", case.turbo)]
        if not case.fwd_only:
            steps.append(("forward+backward", _backward_step(case.turbo, case.leaves)))
            with torch.enable_grad():
                node = _node_call(case.turbo)
            if node is not None:
                steps.append(("backward node, called directly", node))
            split += backward_split(case, calls, device)
        for label, fn in steps:
            grad = label != "forward"
            with torch.set_grad_enabled(grad):
                try:
                    bench_host_us(fn, 100, device)
                except (RuntimeError, TypeError) as exc:
                    print(f"== {case.name} {label}: {exc}")
                    continue
                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(calls):
                    fn()
                profiler.disable()
            _sync(device)
            print(f"== {case.name} {label}: {calls} calls")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(top)
    headers = ["op", "side", "fwd (grad) us", "fwd+bwd us", "bwd via engine us", "bwd node direct us"]
    print(tabulate(split, headers=headers, floatfmt=".1f"))


class _PassBackward(torch.autograd.Function):
    """``2 x`` with a Python backward that launches nothing (the base of the two below)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2.0

    @staticmethod
    def backward(ctx, grad):
        return grad


class _TorchBackward(_PassBackward):
    """``2 x`` with a Python backward of one PyTorch op."""

    @staticmethod
    def backward(ctx, grad):
        return grad * 2.0


class _TritonBackward(_PassBackward):
    """``2 x`` with a Python backward of one Triton launch (``kernel[grid]``, the launcher in effect)."""

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty_like(grad)
        _CACHED_SCALE[(triton.cdiv(grad.numel(), 1024),)](grad, out, grad.numel(), 2.0, BLOCK=1024)
        return out


_CACHED_SCALE = cached_launch(_scale_kernel)


def engine_costs(calls: int) -> None:
    """Host us of forward + backward through autograd's engine for one C++ node against one Python node
    whose backward runs nothing, one PyTorch op or one Triton launch, and two chained Python nodes; and
    the same backward bodies called on this thread; each with the engine's device thread and with the
    backward kept on the calling thread (``torch.autograd.set_multithreading_enabled(False)``). Separates
    the engine's price of a Python node (the device thread, the GIL) from what the backward itself costs."""
    import threading

    x = torch.randn(4096, device="cuda", requires_grad=True)
    g = torch.ones(4096, device="cuda")
    variants = {
        "C++ node (x * 2)": lambda: x * 2.0,
        "Python node, no op": lambda: _PassBackward.apply(x),
        "Python node, 1 torch op": lambda: _TorchBackward.apply(x),
        "Python node, 1 Triton launch": lambda: _TritonBackward.apply(x),
        "2 Python nodes, 1 torch op each": lambda: _TorchBackward.apply(_TorchBackward.apply(x)),
        "2 C++ nodes": lambda: (x * 2.0) * 2.0,
    }
    rows = []
    for label, fn in variants.items():
        fwd = host_us(fn, calls)

        def step(fn=fn):
            torch.autograd.backward(fn(), g)
            x.grad = None

        both = host_us(step, calls)
        with torch.autograd.set_multithreading_enabled(False):
            here = host_us(step, calls)
        rows.append([label, fwd, both, both - fwd, here, here - fwd])
    direct = {
        "torch op": lambda: g * 2.0,
        "Triton launch": lambda: _TritonBackward.backward(None, g),
    }
    for label, fn in direct.items():
        rows.append([f"backward body on this thread: {label}", math.nan, host_us(fn, calls), *[math.nan] * 3])
    names = [t.name for t in threading.enumerate()]
    print(f"python threads: {names}, switch interval {sys.getswitchinterval()}")
    headers = ["variant", "fwd us", "fwd+bwd us", "bwd us", "fwd+bwd, calling thread", "bwd, calling thread"]
    print(tabulate(rows, headers=headers, floatfmt=".1f"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=5000)
    p.add_argument("--cprofile", default="", help="comma-separated bench_host_overhead op names to profile")
    p.add_argument("--top", type=int, default=25, help="functions printed per profile")
    p.add_argument("--engine", action="store_true", help="the engine's cost of a Python node")
    args = p.parse_args()
    if args.engine:
        engine_costs(args.calls)
        return
    if args.cprofile:
        profile_cases([n.strip() for n in args.cprofile.split(",") if n.strip()], args.calls, args.top)
        return
    n, block = 4096, 1024
    x = torch.randn(n, device="cuda")
    y = torch.empty_like(x)
    extra = [torch.empty(16, device="cuda") for _ in range(4)]
    grid = (triton.cdiv(n, block),)
    rows = [["torch.mul (peer)", host_us(lambda: torch.mul(x, 2.0, out=y), args.calls)]]

    few = (x, y, n, 2.0)
    wide = (x, y, *extra, n, 0, 0, 0, 0, 0, 0, 2.0)
    for label, kernel, launch_args, constexprs in (
        ("4 args", _scale_kernel, few, dict(BLOCK=block)),
        ("16 args", _scale_kernel_wide, wide, dict(BLOCK=block, FLAG_A=False, FLAG_B=True)),
    ):
        rows += _variants(label, kernel, launch_args, constexprs, grid, x, y, args.calls)
    print(f"triton {triton.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(tabulate(rows, headers=["launch", "host us"], floatfmt=".2f"))


if __name__ == "__main__":
    main()
