"""RMSNorm and gated activations against eager PyTorch and ``torch.compile`` of the same composite.

Per op and shape: forward and backward time, the bandwidth they reach over the minimum bytes each pass
must move, that bandwidth as a fraction of the device copy bandwidth measured in the same run, and the
ratio to the compiled composite. ``--fused-fp8`` instead times the fused FP8 producers (``rmsnorm_fp8``,
``swiglu_fp8`` per granularity, writing both ``gemm_fp8`` operand copies or the forward one alone)
against the Turbo op followed by ``quantize_fp8_with_trans`` / ``quantize_fp8`` and against
``torch.compile`` of norm/activation + the same quantization. See ``benchmark/README.md``.

Example::

    python -m benchmark.ops.training.bench_norm_act_turbo --shapes quick -o norm_act.csv
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch._dynamo.config
import torch._functorch.config
from tabulate import tabulate

from benchmark.ops.training.bench_utils import (
    copy_ms,
    cycling,
    graph_timer,
    platform_name,
    rotation_sets,
    time_interleaved,
    timing_stream,
    write_csv,
)
from benchmark.ops.training.config import DEEPSEEK_V3, DENSE_MODELS, MOE_MODELS

LOG = logging.getLogger("bench_norm_act_turbo")
COPY_BYTES = 1 << 30


@dataclass(frozen=True)
class Case:
    """One benchmark row: an op on (tokens, hidden) inputs."""

    model: str
    op: str
    tokens: int
    hidden: int


def cases(name: str) -> list[Case]:
    """RMSNorm on each model's hidden size and gated activations on its FFN width, 4096-32768 tokens."""
    if name == "tiny":
        return [Case("tiny", op, 8, 64) for op in OPS]
    tokens = (4096, 16384) if name == "quick" else (4096, 8192, 16384, 32768)
    hidden = {"Llama-3-8B": 4096, "Qwen2.5-72B": 8192, "DeepSeek-V3": DEEPSEEK_V3.hidden}
    ffn = {"Llama-3-8B": DENSE_MODELS["Llama-3-8B"].intermediate // 4, "DeepSeek-V3 expert": 2048}
    ffn["Qwen3-235B expert"] = MOE_MODELS["Qwen3-235B-A22B"].moe_intermediate
    out = [
        Case(m, op, t, h) for m, h in hidden.items() for t in tokens for op in ("rmsnorm", "rmsnorm_residual")
    ]
    out += [
        Case(m, op, t, h)
        for m, h in ffn.items()
        for t in tokens
        for op in ("swiglu", "swiglu_with_probs", "geglu")
    ]
    return out


def _rmsnorm_ref(x, gamma):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + 1e-6) * gamma.float()).to(x.dtype)


def _residual_ref(x, r, gamma):
    s = x + r
    return _rmsnorm_ref(s, gamma), s


def _swiglu_ref(x):
    a, b = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(a) * b


def _swiglu_probs_ref(x, probs):
    return _swiglu_ref(x) * probs[:, None].to(x.dtype)


def _geglu_ref(x):
    a, b = x.chunk(2, dim=-1)
    return torch.nn.functional.gelu(a, approximate="tanh") * b


def _turbo(op: str) -> Callable:
    from primus_turbo.pytorch import ops

    return getattr(ops, op)


OPS = ("rmsnorm", "rmsnorm_residual", "swiglu", "swiglu_with_probs", "geglu")
REFERENCES = {
    "rmsnorm": _rmsnorm_ref,
    "rmsnorm_residual": _residual_ref,
    "swiglu": _swiglu_ref,
    "swiglu_with_probs": _swiglu_probs_ref,
    "geglu": _geglu_ref,
}


def inputs(case: Case, device: str) -> tuple[tuple[torch.Tensor, ...], int, int]:
    """(inputs requiring grad, forward bytes, backward bytes): the minimum each pass reads and writes."""
    t, h, e = case.tokens, case.hidden, 2  # bf16
    x = lambda *shape: torch.randn(*shape, device=device, dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    if case.op == "rmsnorm":
        return (
            (x(t, h), torch.ones(h, device=device, dtype=torch.bfloat16, requires_grad=True)),
            2 * t * h * e,
            3 * t * h * e,
        )
    if case.op == "rmsnorm_residual":
        gamma = torch.ones(h, device=device, dtype=torch.bfloat16, requires_grad=True)
        return (x(t, h), x(t, h), gamma), 4 * t * h * e, 4 * t * h * e
    if case.op == "swiglu_with_probs":
        probs = torch.rand(t, device=device, requires_grad=True)
        return (x(t, 2 * h), probs), 3 * t * h * e + 4 * t, 5 * t * h * e + 8 * t
    return (x(t, 2 * h),), 3 * t * h * e, 5 * t * h * e


def _outputs(out) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def time_ops(
    fns: list[Callable], sets: list[tuple[torch.Tensor, ...]], device: str, graph: bool
) -> list[tuple[float, float]]:
    """(forward ms, backward ms) of each ``fn(*inputs)``, the functions interleaved call by call and each
    cycling over the input ``sets``; each backward takes the gradients of the inputs from every output
    (rmsnorm_residual's y and residual sum s) with fixed output gradients."""
    leaves = [t for inputs in sets for t in inputs]
    with timing_stream(graph):
        with torch.no_grad():
            forwards = [cycling([functools.partial(fn, *inputs) for inputs in sets]) for fn in fns]
            fwd = time_interleaved(forwards, None, device, graph)
        outs = [[_outputs(fn(*inputs)) for inputs in sets] for fn in fns]
        grads = tuple(torch.randn_like(out) for out in outs[0][0])
        # autograd.grad, not backward: the gradients are returned, never accumulated into the leaves
        # (two leaves sharing one gradient, as x and residual do, would cost an extra copy)
        backwards = [
            cycling(
                [
                    functools.partial(torch.autograd.grad, out, inputs, grads, retain_graph=True)
                    for out, inputs in zip(per_set, sets, strict=True)
                ]
            )
            for per_set in outs
        ]
        bwd = time_interleaved(backwards, leaves, device, graph)
    for t in leaves:
        t.grad = None
    return list(zip(fwd, bwd, strict=True))


def copy_bandwidth(device: str, graph: bool) -> float:
    """GB/s of a 1 GiB device-to-device copy (read + write), the ceiling for memory-bound kernels, timed
    the way the ops are (``copy_ms``: an elementwise kernel, since a graph runs ``copy_`` on the copy
    engines at about 2.7 TB/s on H200, against 4.2 TB/s for a kernel)."""
    return 2 * COPY_BYTES / copy_ms(2 * COPY_BYTES, device, graph) / 1e6


FUSED_GRANULARITIES = ("tensorwise", "rowwise", "blockwise")


def _fp8_config(name: str):
    from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, Format, ScalingGranularity

    granularity = ScalingGranularity[name.upper()]
    return Float8QuantConfig(
        format=Format.HYBRID, granularity=granularity, block_size=128 if name == "blockwise" else None
    )


def _quantize_composite(y: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch FP8 quantization along the last dimension, for ``torch.compile`` to fuse."""
    y32 = y.float()
    if name == "blockwise":
        y32 = y32.reshape(y.shape[0], -1, 128)
    amax = y32.abs().amax() if name == "tensorwise" else y32.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, 448.0 / amax, 1.0)
    q = (y32 * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(y.shape), 1.0 / scale


def _both_copies_composite(y: torch.Tensor, name: str) -> tuple[torch.Tensor, ...]:
    """Plain-torch quantization along the last dimension and, transposed, along the first."""
    return (*_quantize_composite(y, name), *_quantize_composite(y.t(), name))


def _fused_callables(
    base: str, sets: list[tuple[torch.Tensor, ...]], name: str, columnwise: bool
) -> list[Callable]:
    """[fused producer, Turbo op + quantize_fp8(_with_trans), compiled composite] for one granularity and
    one set of copies (both gemm_fp8 operand copies, or the forward one), each cycling over ``sets``."""
    from primus_turbo.pytorch import ops

    config = _fp8_config(name)
    axis = None if name == "tensorwise" else 1
    reference = _rmsnorm_ref if base == "rmsnorm" else _swiglu_ref
    op = ops.rmsnorm if base == "rmsnorm" else ops.swiglu
    producer = ops.rmsnorm_fp8 if base == "rmsnorm" else ops.swiglu_fp8
    e4m3, block = torch.float8_e4m3fn, config.block_size

    def unfused(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = op(*tensors)
        if columnwise:
            return ops.quantize_fp8_with_trans(y, e4m3, config.granularity, block_size=block)
        return ops.quantize_fp8(y, e4m3, config.granularity, block_size=block, axis=axis)

    quantize = _both_copies_composite if columnwise else _quantize_composite
    composite = torch.compile(lambda *tensors: quantize(reference(*tensors), name))

    def fused(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return producer(*tensors, config, columnwise=columnwise).data

    sides = (fused, unfused, composite)
    return [cycling([functools.partial(fn, *tensors) for tensors in sets]) for fn in sides]


def fused_rows(case: Case, args: argparse.Namespace, graph: bool) -> list[dict]:
    """Forward time of each fused FP8 producer against its unfused and compiled peers, writing both
    gemm_fp8 operand copies ("both") and the forward copy alone ("rows")."""
    base = "rmsnorm" if case.op == "rmsnorm" else "swiglu"
    first, fwd_bytes, _ = inputs(case, args.device)
    sets = [first] + [inputs(case, args.device)[0] for _ in range(rotation_sets(fwd_bytes, graph) - 1)]
    sets = [tuple(t.detach() for t in tensors) for tensors in sets]
    input_bytes = sum(t.numel() * t.element_size() for t in first)
    rows = []
    for name in FUSED_GRANULARITIES:
        if name == "blockwise" and case.hidden % 128:
            continue
        for columnwise in (True, False):
            with timing_stream(graph), torch.no_grad():
                callables = _fused_callables(base, sets, name, columnwise)
                times = time_interleaved(callables, None, args.device, graph)
            ms = dict(zip(("fused", "unfused", "compiled"), times, strict=True))
            row = {"Model": case.model, "Op": f"{base}_fp8", "Granularity": name}
            row.update({"Copies": "both" if columnwise else "rows", "Tokens": case.tokens})
            row.update({"Hidden": case.hidden, "Fused ms": ms["fused"], "Unfused ms": ms["unfused"]})
            row.update({"Compiled ms": ms["compiled"], "vs unfused": ms["unfused"] / ms["fused"]})
            row.update({"vs compiled": ms["compiled"] / ms["fused"]})
            nbytes = input_bytes + case.tokens * case.hidden * (2 if columnwise else 1)
            row["Fused GB/s"] = nbytes / ms["fused"] / 1e6
            if args.device == "cuda":
                row["Fused of same-size copy"] = copy_ms(nbytes, args.device, graph) / ms["fused"]
            rows.append(row)
            LOG.info("%s", row)
    return rows


def main(argv: list[str] | None = None) -> None:
    """Run every case, write the CSV and print the table and summary."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", choices=("full", "quick", "tiny"), default="quick")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--fused-fp8", action="store_true", help="time the fused FP8 producers instead")
    p.add_argument(
        "--timer",
        choices=("events", "graph"),
        default="graph",
        help="graph: CUDA-graph replays, device time only, inputs rotated past L2 (default); "
        "events: one eager call between CUDA events, L2 flushed, host launch cost included",
    )
    p.add_argument("-o", "--output", default="bench_norm_act.csv")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    # The compiled peers' backward is timed repeatedly on one graph (retain_graph), which donated
    # buffers forbid; and each case compiles its own composite, more than dynamo's default 8 per frame.
    torch._functorch.config.donated_buffer = False
    torch._dynamo.config.recompile_limit = 256
    graph = graph_timer(args)
    copy_gbs = copy_bandwidth(args.device, graph) if args.device == "cuda" else float("nan")
    LOG.info("device copy bandwidth %.0f GB/s on %s", copy_gbs, platform_name(args.device))
    rows = []
    if args.fused_fp8:
        for case in cases(args.shapes):
            if case.op in ("rmsnorm", "swiglu"):
                rows += fused_rows(case, args, graph)
        columns = ["Model", "Op", "Granularity", "Copies", "Tokens", "Hidden", "Fused GB/s"]
        columns += ["Fused of same-size copy", "vs unfused", "vs compiled"]
        print(tabulate([[r.get(c, "") for c in columns] for r in rows], headers=columns, floatfmt=".2f"))
        if rows:
            write_csv(args.output, rows)
        return
    for case in cases(args.shapes):
        fn, ref = _turbo(case.op), REFERENCES[case.op]
        compiled = torch.compile(ref)
        tensors, fwd_bytes, bwd_bytes = inputs(case, args.device)
        n_sets = rotation_sets(min(fwd_bytes, bwd_bytes), graph)
        sets = [tensors] + [inputs(case, args.device)[0] for _ in range(n_sets - 1)]
        row = {"Model": case.model, "Op": case.op, "Tokens": case.tokens, "Hidden": case.hidden}
        times = time_ops([fn, ref, compiled], sets, args.device, graph)
        for label, (fwd_ms, bwd_ms) in zip(("Turbo", "Eager", "Compiled"), times, strict=True):
            row[f"{label} fwd ms"], row[f"{label} bwd ms"] = fwd_ms, bwd_ms
        for direction, nbytes in (("fwd", fwd_bytes), ("bwd", bwd_bytes)):
            gbs = nbytes / row[f"Turbo {direction} ms"] / 1e6
            row[f"{direction} GB/s"] = gbs
            row[f"{direction} of copy"] = gbs / copy_gbs if not math.isnan(copy_gbs) else float("nan")
            row[f"{direction} vs compiled"] = row[f"Compiled {direction} ms"] / row[f"Turbo {direction} ms"]
            if args.device == "cuda":
                same_size = copy_ms(nbytes, args.device, graph) / row[f"Turbo {direction} ms"]
                row[f"{direction} of same-size copy"] = same_size
        row["Copy GB/s"], row["Timer"] = copy_gbs, "graph" if graph else "events"
        row["Platform"], row["Torch"] = platform_name(args.device), torch.__version__
        rows.append(row)
        LOG.info("%s", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()})
    columns = ["Model", "Op", "Tokens", "Hidden", "fwd GB/s", "fwd of copy", "fwd of same-size copy"]
    columns += ["fwd vs compiled", "bwd GB/s", "bwd of copy", "bwd of same-size copy", "bwd vs compiled"]
    print(tabulate([[r.get(c, "") for c in columns] for r in rows], headers=columns, floatfmt=".2f"))
    if rows:
        write_csv(args.output, rows)


if __name__ == "__main__":
    main()
