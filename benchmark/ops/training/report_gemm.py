"""Markdown tables for docs/performance.md from ``bench_gemm_turbo`` CSVs (shards may be combined).

Example::

    python -m benchmark.ops.training.report_gemm docs/data/gemm_bf16_full_h200_2026-11-30.csv
"""

from __future__ import annotations

import argparse
import csv
from typing import Any

from tabulate import tabulate

from benchmark.ops.training.bench_gemm_turbo import summarize
from benchmark.ops.training.config import SHAPE_SETS, gemm_shape_set

INTEGERS = ("M", "N", "K", "MBS")
FLOATS = ("Fwd TFLOPS", "Bwd TFLOPS", "Peer Fwd TFLOPS", "Peer Bwd TFLOPS", "Fwd ratio", "Bwd ratio")


def load_rows(paths: list[str]) -> list[dict[str, Any]]:
    """CSV rows with numbers parsed (timings only where the check passed), in the order of the full
    shape set of config.py."""
    rows = []
    for path in paths:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                row.update({key: int(row[key]) for key in INTEGERS})
                if row["Check"] == "PASS":
                    row.update({key: float(row[key]) for key in FLOATS})
                rows.append(row)
    order = {(s.M, s.N, s.K): i for i, s in enumerate(gemm_shape_set("full"))}
    return sorted(rows, key=lambda r: order.get((r["M"], r["N"], r["K"]), len(order)))


def missing_shapes(rows: list[dict[str, Any]], shape_set: str) -> list[str]:
    """Shapes of ``shape_set`` that no row covers."""
    seen = {(r["M"], r["N"], r["K"]) for r in rows}
    return [
        f"{s.model} {s.gemm} mbs{s.mbs} ({s.M}x{s.N}x{s.K})"
        for s in gemm_shape_set(shape_set)
        if (s.M, s.N, s.K) not in seen
    ]


def shape_table(rows: list[dict[str, Any]], backends: list[str]) -> str:
    """One line per shape: the peer's TFLOP/s and each backend's TFLOP/s with its ratio in brackets."""
    by_shape: dict[tuple, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_shape.setdefault((row["Case"], row["GEMM"], row["MBS"], row["M"], row["N"], row["K"]), {})[
            row["Backend"]
        ] = row
    headers = ["model", "GEMM", "mbs", "M", "N", "K", "torch.matmul fwd"]
    headers += [f"{b} fwd" for b in backends] + ["torch.matmul bwd"] + [f"{b} bwd" for b in backends]
    lines = []
    for (case, gemm, mbs, m, n, k), cells in by_shape.items():
        first = next(iter(cells.values()))
        if first["Check"] != "PASS":
            continue
        line = [case, gemm, mbs, m, n, k]
        line.append(f"{first['Peer Fwd TFLOPS']:.0f}")
        for direction in ("Fwd", "Bwd"):
            if direction == "Bwd":
                line.append(f"{first['Peer Bwd TFLOPS']:.0f}")
            for backend in backends:
                row = cells.get(backend)
                if row is None or row["Check"] != "PASS":
                    line.append(row["Check"] if row else "-")
                    continue
                picked = f", {row['Selected']}" if backend == "AUTO" and direction == "Fwd" else ""
                line.append(f"{row[f'{direction} TFLOPS']:.0f} ({row[f'{direction} ratio']:.2f}{picked})")
        lines.append(line)
    return tabulate(lines, headers=headers, tablefmt="github")


def main(argv: list[str] | None = None) -> None:
    """Print the per-shape table and the per-backend summary."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", nargs="+")
    p.add_argument("--shapes", choices=SHAPE_SETS, default="full", help="the set the run was meant to cover")
    args = p.parse_args(argv)
    rows = load_rows(args.csv)
    backends = list(dict.fromkeys(row["Backend"] for row in rows))
    print(shape_table(rows, backends))
    print()
    headers = ["backend", "PASS", "fwd geomean", "worst fwd", "bwd geomean", "worst bwd", "fwd >= 0.99"]
    print(tabulate(summarize(rows, backends), headers=headers, tablefmt="github"))
    missing = missing_shapes(rows, args.shapes)
    if missing:
        print(f"\nNot measured ({len(missing)}): " + "; ".join(missing))


if __name__ == "__main__":
    main()
