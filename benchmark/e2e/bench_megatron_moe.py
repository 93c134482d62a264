"""Megatron MoE GPT training throughput: Turbo against Megatron's local spec, in one run.

Each variant runs ``examples/megatron/train_moe.py`` (its own processes) on the same synthetic data;
the local spec starts from the same weights as the Turbo run it is compared with. Reports median
forward+backward tokens/s, the ratio to the local spec, and the final-loss gap after ``--steps``; the
optimizer step's time, tokens/s of the whole step with it, and the GPU memory held per parameter.

    python -m benchmark.e2e.bench_megatron_moe --nproc 1 --steps 50 -o megatron_moe.csv
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "megatron" / "train_moe.py"
BLOCKWISE = ["--fp8", "e4m3", "--fp8-recipe", "blockwise"]
TENSORWISE = ["--fp8", "e4m3", "--fp8-recipe", "tensorwise"]
AUTO_FILTER = "--turbo-fp8-auto-filter"
PRIMARY = "--fp8-param-gather"
HP_WGRAD = ["--no-turbo-fp8-expert-wgrad"]  # the experts' weight gradients in bf16
VARIANTS = {
    "turbo-bf16": ["--compare"],
    "turbo-fp8-blockwise": BLOCKWISE,
    "turbo-fp8-tensorwise": TENSORWISE,
    "turbo-bf16-mb4": ["--micro-batches", "4"],
    "turbo-fp8-blockwise-mb4": [*BLOCKWISE, "--micro-batches", "4"],
    "turbo-bf16-compiled": ["--compile"],
    "turbo-bf16-graph": ["--cuda-graph"],
    # the eager step with each backward on autograd's device thread (PyTorch's default), not the caller's
    "turbo-bf16-device-thread": ["--no-turbo-backward-on-caller-thread"],
    "turbo-fp8-blockwise-graph": [*BLOCKWISE, "--cuda-graph"],
    "turbo-fp8-tensorwise-graph": [*TENSORWISE, "--cuda-graph"],
    # FP8 primary weights: FusedAdamW writes the weights' FP8 copies, no forward quantizes a weight
    "turbo-fp8-blockwise-primary": [*BLOCKWISE, PRIMARY],
    "turbo-fp8-tensorwise-primary": [*TENSORWISE, PRIMARY],
    "turbo-fp8-blockwise-primary-graph": [*BLOCKWISE, PRIMARY, "--cuda-graph"],
    "turbo-fp8-tensorwise-primary-graph": [*TENSORWISE, PRIMARY, "--cuda-graph"],
    "turbo-fp8-blockwise-autofilter-primary-graph": [*BLOCKWISE, AUTO_FILTER, PRIMARY, "--cuda-graph"],
    "turbo-fp8-tensorwise-autofilter-primary-graph": [*TENSORWISE, AUTO_FILTER, PRIMARY, "--cuda-graph"],
    # the FP8 cost model keeps each layer in bf16 where FP8 would be slower (--turbo-fp8-auto-filter)
    "turbo-fp8-blockwise-autofilter": [*BLOCKWISE, AUTO_FILTER],
    "turbo-fp8-tensorwise-autofilter": [*TENSORWISE, AUTO_FILTER],
    "turbo-fp8-blockwise-autofilter-graph": [*BLOCKWISE, AUTO_FILTER, "--cuda-graph"],
    "turbo-fp8-tensorwise-autofilter-graph": [*TENSORWISE, AUTO_FILTER, "--cuda-graph"],
    "turbo-fp8-blockwise-hpwgrad-graph": [*BLOCKWISE, *HP_WGRAD, "--cuda-graph"],
    "turbo-bf16-compiled-graph": ["--compile", "--cuda-graph"],
    "turbo-fp8-blockwise-compiled-graph": [*BLOCKWISE, "--compile", "--cuda-graph"],
    "turbo-fp8-blockwise-hpwgrad-compiled-graph": [*BLOCKWISE, *HP_WGRAD, "--compile", "--cuda-graph"],
    # megatron-core's own graphs around the Turbo model, through its schedule
    "turbo-bf16-mcore-local": ["--cuda-graph-impl", "local"],
    "turbo-bf16-mcore-local-attn-router": [
        "--cuda-graph-impl",
        "local",
        "--cuda-graph-modules",
        "attn",
        "moe_router",
        "moe_preprocess",
    ],  # fmt: skip
    "turbo-bf16-mcore-full-iteration": ["--cuda-graph-impl", "full_iteration"],
}
ONE_GPU_FLAGS = ("--cuda-graph", "--cuda-graph-impl")
_FP8_PART = re.compile(r"fp8-(?:blockwise|tensorwise)(?:-hpwgrad)?(?:-autofilter)?(?:-primary)?")


def bf16_peer(variant: str) -> str | None:
    """The bf16 variant an FP8 variant is measured against: the same run with bf16 GEMMs
    (``turbo-fp8-blockwise-graph`` -> ``turbo-bf16-graph``); None for a bf16 variant."""
    peer = _FP8_PART.sub("bf16", variant)
    return peer if peer != variant else None


def _run(variant: str, extra: list[str], args: argparse.Namespace, folder: Path) -> dict[str, dict]:
    """Run one variant; -> {run name: {"tokens_per_s": median (forward+backward), "host_ms": median host
    time to enqueue a step, "opt_ms": median optimizer step, "step_tokens_per_s": median with the
    optimizer step, "bytes_per_param": GPU memory held after a step, "final_loss": loss}}."""
    steps_csv = folder / f"{variant}.csv"
    command = [sys.executable, str(EXAMPLE), "--size", args.size, "--nproc", str(args.nproc),
               "--tp", str(args.tp), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--csv", str(steps_csv), *extra]  # fmt: skip
    print("$", " ".join(command), flush=True)
    done = subprocess.run(
        command,
        cwd=ROOT,
        env=dict(
            os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        ),
    )
    if done.returncode != 0:  # report it and go on: one variant's failure must not cost the others' numbers
        print(f"{variant}: exit status {done.returncode}; no result", flush=True)
        return {}
    rows: dict[str, list[dict]] = {}
    with open(steps_csv) as f:
        for row in csv.DictReader(f):
            rows.setdefault(row["run"], []).append(row)
    result = {}
    for run, logs in rows.items():
        timed = logs[args.warmup :]
        rate = statistics.median(float(r["tokens_per_s"]) for r in timed)
        host = statistics.median(float(r["host_ms"]) for r in timed)
        opt = statistics.median(float(r["opt_ms"]) for r in timed)
        # each step's tokens over its forward+backward and optimizer time together
        step_rate = statistics.median(
            float(r["tokens_per_s"]) * float(r["fwd_bwd_ms"]) / (float(r["fwd_bwd_ms"]) + float(r["opt_ms"]))
            for r in timed
        )
        tail = [float(r["loss"]) for r in logs[-10:]]  # one batch's loss is noisy: the last 10 steps' mean
        result[run] = {
            "tokens_per_s": rate,
            "host_ms": host,
            "opt_ms": opt,
            "step_tokens_per_s": step_rate,
            "bytes_per_param": float(logs[-1]["bytes_per_param"]),
            "final_loss": sum(tail) / len(tail),
        }
    return result


def _ratios(values: dict, base: dict | None) -> tuple[str, str]:
    """(throughput against ``base``, relative final-loss gap to it), or empty strings without one."""
    if not base:
        return "", ""
    gap = abs(values["final_loss"] - base["final_loss"]) / base["final_loss"]
    return f"{values['tokens_per_s'] / base['tokens_per_s']:.3f}", f"{gap:.4f}"


def _row(values: dict, results: dict[str, dict], name: str) -> list[str]:
    """One table row: tokens/s, host ms, against the local spec and (FP8 runs) against their bf16 peer."""
    peer = bf16_peer(name)
    rate, host, loss = (
        f"{values['tokens_per_s']:.0f}",
        f"{values['host_ms']:.1f}",
        f"{values['final_loss']:.4f}",
    )
    vs_local, gap_local = _ratios(values, results.get("local"))
    base = results.get(peer) if peer else None
    vs_bf16, gap_bf16 = _ratios(values, base)
    step_vs_bf16 = f"{values['step_tokens_per_s'] / base['step_tokens_per_s']:.3f}" if base else ""
    extra = [f"{values['opt_ms']:.1f}", f"{values['step_tokens_per_s']:.0f}", step_vs_bf16]
    return [
        rate,
        host,
        vs_local,
        loss,
        gap_local,
        vs_bf16,
        gap_bf16,
        *extra,
        f"{values['bytes_per_param']:.2f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="small")
    parser.add_argument("--nproc", type=int, default=1, help="GPUs; expert parallelism is nproc / tp")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (sequence parallel on)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    default = "turbo-bf16,turbo-fp8-blockwise,turbo-bf16-compiled,turbo-bf16-graph,turbo-fp8-blockwise-graph"
    parser.add_argument("--variants", default=default, help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("-o", "--output", default="megatron_moe.csv")
    args = parser.parse_args()
    folder = Path(args.output).resolve().parent
    results: dict[str, dict] = {}
    for variant in args.variants.split(","):
        if any(flag in VARIANTS[variant] for flag in ONE_GPU_FLAGS) and args.nproc > 1:
            print(f"{variant}: skipped (the example's CUDA graphs are one-GPU only)", flush=True)
            continue
        for run, values in _run(variant, VARIANTS[variant], args, folder).items():
            results["local" if run == "local" else variant] = values
    table = [[name, args.nproc, args.tp, *_row(values, results, name)] for name, values in results.items()]
    header = ["run", "gpus", "tp", "tokens_per_s", "host_ms", "vs_local", "final_loss", "loss_gap_vs_local"]
    header += [
        "vs_bf16",
        "loss_gap_vs_bf16",
        "opt_ms",
        "step_tokens_per_s",
        "step_vs_bf16",
        "bytes_per_param",
    ]
    print(tabulate(table, headers=header))
    with open(args.output, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(table)


if __name__ == "__main__":
    main()
