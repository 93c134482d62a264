"""Helpers shared by the training-op benchmarks: timers, inputs and the platform label."""

from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import itertools
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tabulate import tabulate

from benchmark.ops.training.config import GemmShape

__all__ = [
    "HostCase",
    "ROTATION_BYTES",
    "copy_ms",
    "cpu_timer",
    "cycling",
    "make_inputs",
    "paired_cuda_timer",
    "platform_name",
    "rotation_sets",
    "time_interleaved",
    "timing_stream",
]


PAIRED_WINDOW_MS = 150.0  # device time each function gets in a paired measurement
MIN_TIMED_CALLS = 20  # long calls get a longer window so that each median has this many samples
PAIRED_MAX_CALLS = 400
GRAPH_REPLAY_MS = 0.5  # calls captured per graph so that one replay lasts at least this long
# Graph timing replays calls back to back on warm L2 (50 MB on H200); each side cycles over enough input
# sets that one round moves at least this many bytes, so no call finds its inputs still cached.
ROTATION_BYTES = 256 << 20


def _reset_grads(tensors: list[torch.Tensor] | None) -> None:
    for t in tensors or ():
        t.grad = None


def _captured(fn: Callable[[], object], grads: list[torch.Tensor] | None, calls: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` back-to-back calls of ``fn`` captured on the current stream.

    The current stream must be a side stream that also ran any forward whose backward ``fn`` runs:
    autograd replays a backward op on its forward's stream, which must be the capturing one."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.current_stream()):
        for _ in range(calls):
            _reset_grads(grads)
            fn()
    return graph


def paired_cuda_timer(
    fns: Sequence[Callable[[], object]], grad_to_none: list[torch.Tensor] | None = None, graph: bool = False
) -> list[float]:
    """Median milliseconds per call of each function, timed call by call in interleaved order.

    Iteration ``j`` times every function once (the order rotating with ``j``), each call between two
    CUDA events, so clock, power and thermal drift reach all functions alike and the ratio of two
    medians does not depend on when each was measured. Eager mode (``graph=False``) flushes L2 before
    each call, and the host's launch cost counts where it exceeds the flush; ``graph=True`` replays
    CUDA graphs (device time only, warm L2) and must run on a side stream (see ``_captured``).
    """
    once = []
    for fn in fns:
        _reset_grads(grad_to_none)
        fn()  # first-call tuning and compilation stay outside the timing
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _reset_grads(grad_to_none)
        start.record()
        fn()
        end.record()
        end.synchronize()
        once.append(start.elapsed_time(end))
    if graph:
        # one count for every side, so each replay's own launch gap is spread over the same calls
        calls = max(1, math.ceil(GRAPH_REPLAY_MS / max(min(once), 1e-3)))
        runs = [_captured(fn, grad_to_none, calls).replay for fn in fns]
        cache = None
    else:
        runs, calls = list(fns), 1
        cache = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    longest = max(once) * calls
    iters = min(PAIRED_MAX_CALLS, max(MIN_TIMED_CALLS, math.ceil(PAIRED_WINDOW_MS / max(longest, 1e-3))))
    events = [
        [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for _ in fns
    ]
    for j in range(iters):
        for step in range(len(fns)):
            i = (j + step) % len(fns)
            if cache is not None:
                _reset_grads(grad_to_none)
                cache.zero_()
            start, end = events[i][j]
            start.record()
            runs[i]()
            end.record()
    torch.cuda.synchronize()
    return [statistics.median(s.elapsed_time(e) for s, e in events[i]) / calls for i in range(len(fns))]


@contextlib.contextmanager
def timing_stream(graph: bool) -> Iterator[None]:
    """Run the block on a side stream for graph timing (the capture, and any forward whose backward is
    captured, must share it); on the current stream otherwise."""
    if not graph:
        yield
        return
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream().wait_stream(stream)


def add_timer_argument(parser: argparse.ArgumentParser) -> None:
    """``--timer events|graph`` of the timed benchmarks (``events`` by default)."""
    parser.add_argument(
        "--timer",
        choices=("events", "graph"),
        default="events",
        help="events: eager calls with an L2 flush each (host cost included where it exceeds the flush); "
        "graph: CUDA-graph replays (device time only)",
    )


def graph_timer(args: argparse.Namespace) -> bool:
    """Whether a benchmark's ``--timer`` asks for CUDA-graph replays and its device can capture them."""
    return args.device == "cuda" and args.timer == "graph"


def time_interleaved(
    fns: Sequence[Callable[[], object]],
    grad_to_none: list[torch.Tensor] | None = None,
    device: str = "cuda",
    graph: bool = False,
) -> list[float]:
    """Milliseconds per call of each function, measured together: ``paired_cuda_timer`` on a GPU, one
    after the other with ``cpu_timer`` on a CPU (smoke tests). With ``graph``, call it inside
    ``timing_stream(True)``."""
    if device == "cpu":
        return [cpu_timer(fn, grad_to_none) for fn in fns]
    return paired_cuda_timer(fns, grad_to_none, graph)


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


def write_csv(path: str, rows: list[dict]) -> None:
    """Write ``rows`` to ``path`` with every key any row has as a column, in first-seen order."""
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def cycling(calls: list[Callable]) -> Callable:
    """One callable that runs ``calls`` in turn, one per invocation (captured graphs hold each in turn)."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def rotation_sets(nbytes: int, graph: bool) -> int:
    """How many input sets a side cycles over so that one round moves at least ``ROTATION_BYTES`` when
    each call moves ``nbytes``: graph replays would otherwise find the inputs still in L2; one set for
    eager timing, which flushes L2 itself."""
    return math.ceil(ROTATION_BYTES / nbytes) if graph else 1


def copy_ms(nbytes: int, device: str, graph: bool) -> float:
    """Milliseconds of a device copy moving ``nbytes`` (half read, half written) by an elementwise kernel
    (``neg``; a graph would run ``copy_`` on the copy engines), cycling over buffers like the ops: the
    bandwidth ceiling at that size, launch and tail included."""
    elements = max(1, nbytes // 4)
    pairs = rotation_sets(nbytes, graph)
    buffers = [torch.randn(elements, dtype=torch.bfloat16, device=device) for _ in range(pairs)]
    outs = [torch.empty_like(b) for b in buffers]
    calls = [functools.partial(torch.neg, b, out=o) for b, o in zip(buffers, outs, strict=True)]
    with timing_stream(graph):
        (ms,) = time_interleaved([cycling(calls)], None, device, graph)
    return ms


def timed_across_ranks(fns: dict[str, Callable[[], object]], iters: int, device: str) -> dict[str, float]:
    """Median milliseconds per call of each function on this rank, interleaved, barriers around calls."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up: compilation and buffers outside the timing
        fn()
    for j in range(iters):
        names = list(fns)
        for name in names[j % len(names) :] + names[: j % len(names)]:
            dist.barrier()
            if device == "cuda":
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fns[name]()
                end.record()
                end.synchronize()
                samples[name].append(start.elapsed_time(end))
            else:
                begin = time.perf_counter()
                fns[name]()
                samples[name].append((time.perf_counter() - begin) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def _rank_worker(
    rank: int, world: int, store: str, run: Callable, args: argparse.Namespace, columns: list[str]
):
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    rows = run(rank, world, args)
    if rows is not None:
        print(tabulate([[r.get(c, "") for c in columns] for r in rows], headers=columns, floatfmt=".3f"))
        write_csv(args.output, rows)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: gloo's threads can abort it


def spawn_ranks(run: Callable, args: argparse.Namespace, what: str, columns: list[str]) -> None:
    """``run(rank, world, args)`` in one process per rank (``args.world`` ranks, default every GPU or 2 on
    the CPU; NCCL or gloo by ``args.device``); rank 0's rows are printed (``columns``) and written to
    ``args.output``."""
    world = args.world or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if world < 2:
        raise SystemExit(f"{what} needs at least 2 ranks, found {world}")
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "store")
        mp.spawn(_rank_worker, args=(world, store, run, args, columns), nprocs=world, join=True)


@dataclass
class HostCase:
    """One op (or module) and its peer, a row of ``bench_host_overhead``. ``turbo``/``peer`` return the
    outputs whose backward is timed;
    ``leaves`` are the tensors whose ``.grad`` is reset after each backward. ``fwd_only`` skips the
    backward rows (ops without one); ``target`` is the issue's bound on turbo / peer forward + backward."""

    family: str
    name: str
    turbo: Callable[[], object]
    peer: Callable[[], object] | None
    leaves: list[torch.Tensor] = field(default_factory=list)
    peer_label: str = ""
    fwd_only: bool = False
    target: float | None = None
