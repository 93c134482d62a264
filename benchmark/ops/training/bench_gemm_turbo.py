"""Benchmark primus_turbo ``gemm`` against ``torch.matmul`` on real model GEMM shapes.

For every shape and backend label the turbo forward (``gemm(a, w, trans_b=True)``) and backward
(dgrad + wgrad through autograd) are checked against an fp32 reference and timed next to
``torch.matmul(a, w.t())`` in the same process. See ``benchmark/README.md``.

Example::

    python -m benchmark.ops.training.bench_gemm_turbo --shapes quick --backends TRITON,AUTO -o out.csv
"""

from __future__ import annotations

import argparse
import csv
import functools
import logging
import statistics
from collections.abc import Callable, Iterator
from typing import Any

import torch
import triton
import triton.testing
from tabulate import tabulate

from benchmark.ops.training.bench_utils import (
    add_timer_argument,
    graph_timer,
    make_inputs,
    platform_name,
    time_interleaved,
    timing_stream,
)
from benchmark.ops.training.config import SHAPE_SETS, GemmShape, gemm_shape_set

try:
    from tqdm import tqdm
except ImportError:
    tqdm = None

LOG = logging.getLogger("bench_gemm_turbo")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
AUTO = "AUTO"
DEFAULT = "DEFAULT"
CHECK_TOL = 1e-2  # bound on the relative Frobenius error against the fp32 reference
PARITY = 0.99  # a Fwd ratio at or above this counts as on par with torch.matmul
ERROR_CHARS = 200  # exception text kept in the CSV
TABLE_ERROR_CHARS = 40  # and in the console table

CSV_COLUMNS = [
    "Case", "GEMM", "MBS", "M", "N", "K", "Dtype", "Backend", "Selected", "Check", "Rel err",
    "Fwd ms", "Fwd TFLOPS", "Bwd ms", "Bwd TFLOPS",
    "Peer Fwd ms", "Peer Fwd TFLOPS", "Peer Bwd ms", "Peer Bwd TFLOPS",
    "Fwd ratio", "Bwd ratio", "Error", "Platform", "Torch", "Triton",
]  # fmt: skip
# Console table: header -> CSV column.
TABLE_COLUMNS = {
    "Case": "Case", "GEMM": "GEMM", "MBS": "MBS", "M": "M", "N": "N", "K": "K",
    "Backend": "Backend", "Selected": "Selected", "Check": "Check",
    "Fwd TF": "Fwd TFLOPS", "Bwd TF": "Bwd TFLOPS", "Peer Fwd TF": "Peer Fwd TFLOPS",
    "Peer Bwd TF": "Peer Bwd TFLOPS", "Fwd ratio": "Fwd ratio", "Bwd ratio": "Bwd ratio", "Error": "Error",
}  # fmt: skip

Op = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Timer = Callable[[Callable[[], object], list[torch.Tensor] | None], float]
Row = dict[str, Any]


def load_turbo(backends: list[str]) -> tuple[Op, Callable[[str], None]]:
    """Import primus_turbo, validate the backend labels and return ``(gemm op, configure(label))``.

    The import is deferred so that ``--help`` works without primus_turbo installed.
    """
    from primus_turbo.pytorch import ops
    from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager

    valid = [b.name for b in BackendType] + [AUTO, DEFAULT]
    unknown = [b for b in backends if b not in valid]
    if unknown:
        raise SystemExit(f"unknown backend(s) {unknown}; choose from {valid}")

    def configure(label: str) -> None:
        GlobalBackendManager.reset()
        if label == AUTO:
            GlobalBackendManager.set_auto_tune(True)
        elif label != DEFAULT:
            GlobalBackendManager.set_gemm_backend(BackendType[label])

    return functools.partial(ops.gemm, trans_b=True), configure


def selected_backend() -> str:
    """Backend the turbo dispatcher used for the last GEMM, or ``"?"`` if the API does not say."""
    try:
        from primus_turbo.pytorch.kernels.gemm.gemm_impl import last_selected_backend

        choice = last_selected_backend()
    except (AttributeError, ImportError):
        return "?"
    return "?" if choice is None else getattr(choice, "name", str(choice))


def shape_label(shape: GemmShape) -> str:
    """Human-readable shape name for logs."""
    return f"{shape.model} {shape.gemm} mbs{shape.mbs} (M={shape.M}, N={shape.N}, K={shape.K})"


def matmul_op(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The peer: torch.matmul (cuBLAS / hipBLASLt) in the Linear layout."""
    return torch.matmul(a, w.t())


def rel_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """Relative Frobenius error ||actual - reference|| / ||reference||; overwrites ``reference``."""
    norm = torch.linalg.vector_norm(reference)
    return (torch.linalg.vector_norm(reference.sub_(actual)) / norm).item()


def check_turbo(
    op: Op, a: torch.Tensor, w: torch.Tensor, grad_out: torch.Tensor
) -> tuple[str, float, str, str]:
    """Run ``op`` forward + backward once and compare with fp32 torch.matmul.

    Returns ``(PASS|FAIL, worst relative error, failure detail, selected backend)``. The fp32
    references are built one at a time to bound memory on the lm_head shapes.
    """
    out = op(a, w)
    selected = selected_backend()
    out.backward(grad_out)
    a32, w32 = a.detach(), w.detach()
    errors = {
        "out": rel_error(out.detach(), a32.float() @ w32.float().t()),
        "grad_a": rel_error(a.grad, grad_out.float() @ w32.float()),
        "grad_w": rel_error(w.grad, grad_out.float().t() @ a32.float()),
    }
    a.grad = w.grad = None
    worst = max(errors, key=errors.__getitem__)
    if errors[worst] < CHECK_TOL:  # False for NaN too
        return "PASS", errors[worst], "", selected
    return "FAIL", errors[worst], f"{worst} rel err {errors[worst]:.2e} >= {CHECK_TOL:g}", selected


def timing_columns(prefix: str, shape: GemmShape, fwd_ms: float, bwd_ms: float) -> Row:
    """ms and TFLOPS columns; the forward is 2*M*N*K FLOPs and the backward (dgrad + wgrad) twice that."""
    fwd_flops = 2 * shape.M * shape.N * shape.K
    return {
        f"{prefix}Fwd ms": fwd_ms,
        f"{prefix}Fwd TFLOPS": fwd_flops / fwd_ms / 1e9,
        f"{prefix}Bwd ms": bwd_ms,
        f"{prefix}Bwd TFLOPS": 2 * fwd_flops / bwd_ms / 1e9,
    }


def time_against_peer(
    turbo_op: Op, a: torch.Tensor, w: torch.Tensor, grad_out: torch.Tensor, args: argparse.Namespace
) -> tuple[tuple[float, float], tuple[float, float]]:
    """((turbo fwd, bwd), (peer fwd, bwd)) milliseconds: the forward without autograd, the backward
    (dgrad + wgrad) of a graph built once.

    On a GPU peer and turbo calls interleave one by one (``paired_cuda_timer``), so drift in clocks
    and power reaches both alike; on a CPU (smoke test) they run one after the other. In graph mode the
    forwards whose backward is captured run on the capture's side stream too.
    """
    graph = graph_timer(args)
    with timing_stream(graph):
        with torch.no_grad():
            fwd = time_interleaved(
                [lambda: turbo_op(a, w), lambda: matmul_op(a, w)], None, args.device, graph
            )
        turbo_out, peer_out = turbo_op(a, w), matmul_op(a, w)
        bwd = time_interleaved(
            [
                lambda: turbo_out.backward(grad_out, retain_graph=True),
                lambda: peer_out.backward(grad_out, retain_graph=True),
            ],
            [a, w],
            args.device,
            graph,
        )
    a.grad = w.grad = None
    return (fwd[0], bwd[0]), (fwd[1], bwd[1])


def bench_shape(
    shape: GemmShape,
    backends: list[str],
    turbo_op: Op,
    configure: Callable[[str], None],
    args: argparse.Namespace,
    env: Row,
) -> list[Row]:
    """One row per backend label, each timed against torch.matmul in the same interleaved run."""
    a, w, grad_out = make_inputs(shape, DTYPES[args.dtype], args.device)
    rows = []
    for label in backends:
        row: Row = {"Case": shape.model, "GEMM": shape.gemm, "MBS": shape.mbs, "M": shape.M, "N": shape.N}
        row.update(K=shape.K, Dtype=args.dtype, Backend=label, **env)
        try:
            configure(label)
            row["Check"], row["Rel err"], row["Error"], row["Selected"] = check_turbo(
                turbo_op, a, w, grad_out
            )
            (fwd_ms, bwd_ms), (peer_fwd, peer_bwd) = time_against_peer(turbo_op, a, w, grad_out, args)
            row.update(timing_columns("", shape, fwd_ms, bwd_ms))
            row.update(timing_columns("Peer ", shape, peer_fwd, peer_bwd))
            row["Fwd ratio"] = peer_fwd / fwd_ms
            row["Bwd ratio"] = peer_bwd / bwd_ms
        except Exception as exc:  # report the row and keep benchmarking
            row["Check"] = "ERROR"
            row["Error"] = f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]
            a.grad = w.grad = None
        if row["Check"] != "PASS":
            LOG.warning("%s %s: %s %s", shape_label(shape), label, row["Check"], row["Error"])
        rows.append(row)
    return rows


def table_cell(column: str, value: Any) -> Any:
    """Compact console formatting of one cell."""
    if column == "Error":
        return value[:TABLE_ERROR_CHARS]
    if not isinstance(value, float):
        return value
    if column == "Rel err":
        return f"{value:.2e}"
    if "ratio" in column:
        return f"{value:.3f}"
    return f"{value:.4f}" if column.endswith("ms") else f"{value:.1f}"


def summarize(rows: list[Row], backends: list[str]) -> list[list[Any]]:
    """Per backend: geomean Fwd/Bwd ratio over PASS rows, worst ratios and where, count at parity."""
    summary = []
    for label in backends:
        mine = [r for r in rows if r["Backend"] == label]
        ok = [r for r in mine if r["Check"] == "PASS"]
        line: list[Any] = [label, f"{len(ok)}/{len(mine)}"]
        for key in ("Fwd ratio", "Bwd ratio"):
            if ok:
                worst = min(ok, key=lambda r: r[key])
                where = f"{worst['Case']} {worst['GEMM']} mbs{worst['MBS']}"
                line += [
                    f"{statistics.geometric_mean(r[key] for r in ok):.3f}",
                    f"{worst[key]:.3f} ({where})",
                ]
            else:
                line += ["-", "-"]
        line.append(f"{sum(r['Fwd ratio'] >= PARITY for r in ok)}/{len(ok)}")
        summary.append(line)
    return summary


def progress(shapes: list[GemmShape]) -> Iterator[GemmShape]:
    """Iterate with a tqdm bar when tqdm is installed, else log each shape."""
    if tqdm is not None:
        yield from tqdm(shapes, unit="shape")
        return
    for i, shape in enumerate(shapes, 1):
        LOG.info("[%d/%d] %s", i, len(shapes), shape_label(shape))
        yield shape


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", choices=SHAPE_SETS, default="quick", help="shape set from config.py")
    p.add_argument("--dtype", choices=[*sorted(DTYPES), "fp8", "fp4"], default="bf16")
    p.add_argument(
        "--granularity",
        choices=("tensorwise", "rowwise", "blockwise", "mxfp8"),
        default="tensorwise",
        help="FP8 scaling for --dtype fp8 (see bench_gemm_fp8.py)",
    )
    p.add_argument(
        "--backends",
        default="HIPBLASLT,TRITON,AUTO",
        help="comma-separated BackendType names; AUTO = autotune over all eligible backends, "
        "DEFAULT = the selection without a pin or autotune",
    )
    p.add_argument("-o", "--output", default="bench_gemm_turbo.csv", help="CSV path")
    p.add_argument(
        "--skip-csv", default=None, help="skip the shapes an earlier CSV already has (resume a cut-off run)"
    )
    p.add_argument("--num-shards", type=int, default=1, help="split the shape list into this many shards")
    p.add_argument("--shard-id", type=int, default=0, help="shard to run, 0 <= id < --num-shards")
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cpu: smoke test with wall-clock timing"
    )
    add_timer_argument(p)
    args = p.parse_args(argv)
    if not 0 <= args.shard_id < args.num_shards:
        p.error("need 0 <= --shard-id < --num-shards")
    return args


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark, write the CSV and print the result and summary tables."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    backends = [b.strip().upper() for b in args.backends.split(",") if b.strip()]
    turbo_op, configure = load_turbo(backends)
    shapes = gemm_shape_set(args.shapes)
    if args.skip_csv:
        with open(args.skip_csv, newline="") as f:
            done = {(int(r["M"]), int(r["N"]), int(r["K"])) for r in csv.DictReader(f)}
        shapes = [s for s in shapes if (s.M, s.N, s.K) not in done]
    shapes = shapes[args.shard_id :: args.num_shards]
    env = {"Platform": platform_name(args.device), "Torch": torch.__version__, "Triton": triton.__version__}
    if args.dtype in ("fp8", "fp4"):
        from benchmark.ops.training import bench_gemm_fp8

        torch.manual_seed(0)
        bench_gemm_fp8.run(args, shapes, ["TORCH"] if args.dtype == "fp4" else backends, env)
        return
    LOG.info("%d shapes x %d backends on %s, %s", len(shapes), len(backends), env["Platform"], args.dtype)
    torch.manual_seed(0)

    rows: list[Row] = []
    with open(args.output, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for shape in progress(shapes):
            for row in bench_shape(shape, backends, turbo_op, configure, args, env):
                writer.writerow(row)
                rows.append(row)
            f.flush()
            if args.device == "cuda":
                torch.cuda.empty_cache()

    table = [[table_cell(col, r.get(col)) for col in TABLE_COLUMNS.values()] for r in rows]
    print(tabulate(table, headers=list(TABLE_COLUMNS), missingval="-", disable_numparse=True))
    print()
    print(f"Summary over Check=PASS shapes (ratio = turbo TFLOPS / torch.matmul TFLOPS, parity >= {PARITY}):")
    headers = ["Backend", "PASS", "Fwd geomean", "Fwd min", "Bwd geomean", "Bwd min", f"Fwd >= {PARITY}"]
    print(tabulate(summarize(rows, backends), headers=headers, disable_numparse=True))
    LOG.info("wrote %d rows to %s", len(rows), args.output)


if __name__ == "__main__":
    main()
