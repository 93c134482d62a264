"""Profile Turbo training steps of the example's MoE GPT on one GPU: wall time per step, GPU busy time,
and the top kernels and host ops (torch.profiler). Tells host-bound from device-bound steps. With
``--cprofile`` it also profiles the Python of the timed steps without torch.profiler (which turns the
custom ops' eager fast path off): the functions that take the host's time. ``--syncs`` lists every call
of one eager step that synchronised with the GPU (torch.cuda's sync debug mode), with its stack: a step
that synchronises cannot run ahead of the GPU.

    python scripts/profile_megatron_step.py --size small [--fp8 e4m3 --fp8-recipe blockwise] [--rows N]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
import os
import pstats
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from tabulate import tabulate
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("train_moe", ROOT / "examples" / "megatron" / "train_moe.py")
train_moe = importlib.util.module_from_spec(_spec)
sys.modules["train_moe"] = train_moe  # dataclasses look their module up while the file executes
_spec.loader.exec_module(train_moe)


_SOURCES = (
    ("/integrations/", "Turbo Megatron integration"),
    ("/megatron/", "Megatron (Python)"),
    ("primus_turbo/triton", "Turbo Triton wrappers"),
    ("primus_turbo", "Turbo ops (Python)"),
    ("/triton/", "Triton runtime"),
    ("/torch/", "torch (Python)"),
)


def host_by_source(stats: pstats.Stats, calls: int) -> list[tuple[str, float]]:
    """Own (not cumulative) profiled host ms per call, summed by where the code lives: own times add up
    to the whole, where cumulative times of code the autograd engine calls back into do not."""
    totals: dict[str, float] = {}
    for (path, _line, name), (_cc, _nc, own, _cum, _callers) in stats.stats.items():
        if path == "~":
            if "run_backward" in name:
                source = "autograd engine (C++ nodes, own)"
            else:
                source = "torch C++ ops and methods" if "torch" in name else "other built-ins"
        else:
            source = next((label for part, label in _SOURCES if part in path), "other Python")
        totals[source] = totals.get(source, 0.0) + own * 1e3 / calls
    return sorted(totals.items(), key=lambda item: -item[1])


def _python_profile(model: torch.nn.Module, args, device: torch.device, dump: str) -> None:
    """cProfile of three eager forward+backward calls on one batch made beforehand (the example's data
    generator and the optimizer step stay out of the profile): the top functions by own and by cumulative
    time; the raw statistics go to ``dump`` when given (``pstats.Stats(dump).print_callees(...)`` reads
    them on any machine)."""
    train_moe.set_aux_loss_scale(args, device)
    step = train_moe.forward_backward_step(model, args, *train_moe.causal_inputs(args, device))
    tokens = train_moe.synthetic_batch(0, 0, args, device)
    step(tokens)
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    calls = 3
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(calls):
        step(tokens)
        model.zero_grad(set_to_none=True)
    profiler.disable()
    host = (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    print(f"cProfile run: {host * 1e3:.1f} ms of host time per forward+backward (profiled)")
    if dump:
        profiler.dump_stats(dump)
    sources = host_by_source(pstats.Stats(profiler), calls)
    print(tabulate(sources, headers=["source", "ms per forward+backward (profiled)"], floatfmt=".2f"))
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(45)
        print(text.getvalue())


def _sync_report(model: torch.nn.Module, args, device: torch.device) -> None:
    """Run one step with torch.cuda's sync debug mode on; print each synchronising call's stack."""
    stacks: dict[str, int] = {}

    def record(*_args, **_kwargs) -> None:
        stack = "".join(traceback.format_stack(limit=16)[:-2])
        stacks[stack] = stacks.get(stack, 0) + 1

    args.steps = 1
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            train_moe.train(model, args, 0, device, impl=args.cuda_graph_impl)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    # the loss read after the timed region (``.item()``) is expected
    print(f"synchronising calls in one step: {sum(stacks.values())} ({len(stacks)} distinct stacks)")
    for stack, count in sorted(stacks.items(), key=lambda item: -item[1]):
        print(f"--- {count} x\n{stack}")


def main() -> None:
    own = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    own.add_argument("--cprofile", action="store_true")
    own.add_argument("--pstats", default="", help="with --cprofile: write the raw statistics to this file")
    own.add_argument("--syncs", action="store_true", help="list the synchronising calls of one step")
    own.add_argument("--rows", type=int, default=30, help="kernels listed by GPU time")
    mine, rest = own.parse_known_args()
    cprofile = mine.cprofile
    args = train_moe.parse_args(rest)
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group(
            "nccl", init_method=f"file://{os.path.join(folder, 's')}", rank=0, world_size=1
        )
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        ps.initialize_model_parallel(1)
        torch.manual_seed(args.seed)
        model_parallel_cuda_manual_seed(args.seed)
        device = torch.device("cuda", 0)
        model = train_moe.build_model(args, not args.local_only, device)
        args.steps = 5
        # warm up: compile, autotune, allocator
        train_moe.train(model, args, 0, device, impl=args.cuda_graph_impl)
        logs = train_moe.train(model, args, 0, device, impl=args.cuda_graph_impl)
        eager = sorted(log.fwd_bwd_s for log in logs)[len(logs) // 2]
        print(f"unprofiled: fwd+bwd {eager * 1e3:.1f} ms per step (median of 5)")
        if mine.syncs:
            _sync_report(model, args, device)
        if cprofile:
            _python_profile(model, args, device, mine.pstats)
        args.steps = 3
        torch.cuda.synchronize()
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            logs = train_moe.train(model, args, 0, device, impl=args.cuda_graph_impl)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / args.steps
        events = prof.key_averages()
        gpu_us = sum(e.self_device_time_total for e in events) / args.steps
        fwd_bwd = sum(log.fwd_bwd_s for log in logs) / len(logs)
        busy = gpu_us / 1e3
        print(f"per step: wall {wall * 1e3:.1f} ms (fwd+bwd {fwd_bwd * 1e3:.1f} ms), GPU busy {busy:.1f} ms")
        print(events.table(sort_by="self_device_time_total", row_limit=mine.rows, max_name_column_width=90))
        print(events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
