"""Markdown tables for docs/performance.md from ``bench_grouped_gemm_turbo`` CSVs (bf16 or ``--dtype fp8``).

bf16: per shape, each backend's forward TFLOP/s and its forward and backward ratios against
``torch._grouped_mm``. FP8: per shape, the GEMM's TFLOP/s and ratios against the scaled peer and bf16, and
the step's time against bf16. ``--previous`` adds the same shape's ratios (bf16) or step time (FP8) from
an earlier CSV. Both end with the geomeans per backend and routing.

Example::

    python -m benchmark.ops.training.report_grouped docs/data/grouped_gemm_quick_h200_2026-12-01_gluon.csv \\
        --previous docs/data/grouped_gemm_quick_h200_2026-11-30.csv
"""

from __future__ import annotations

import argparse
import csv
from statistics import geometric_mean

from tabulate import tabulate

KEY = ("Model", "GEMM", "Routing")


def load(path: str) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def passed(row: dict[str, str]) -> bool:
    return row.get("Check", "").startswith("PASS")


def _ratio(row: dict[str, str] | None, column: str) -> str:
    return f"{float(row[column]):.2f}" if row and row.get(column) else "-"


def bf16_table(rows: list[dict[str, str]], previous: list[dict[str, str]], label: str) -> str:
    """One line per shape: every backend's forward TFLOP/s and ratios, then ``label``'s earlier ratios."""
    backends = list(dict.fromkeys(r["Backend"] for r in rows))
    shapes: dict[tuple, dict[str, dict[str, str]]] = {}
    for row in rows:
        shapes.setdefault(tuple(row[k] for k in KEY), {})[row["Backend"]] = row
    before = {(*(r[k] for k in KEY), r["Backend"]): r for r in previous}
    headers = list(KEY)
    for b in backends:
        headers += [f"{b} fwd TFLOP/s", f"{b} fwd vs peer", f"{b} bwd vs peer"]
    if previous:
        headers += [f"earlier {label} fwd", f"earlier {label} bwd"]
    lines = []
    for key, cells in shapes.items():
        line = list(key)
        for b in backends:
            row = cells.get(b)
            ok = row is not None and passed(row)
            line += [f"{float(row['Fwd TFLOPS']):.0f}" if ok else (row["Check"] if row else "-")]
            line += [
                _ratio(row if ok else None, "fwd vs grouped_mm"),
                _ratio(row if ok else None, "bwd vs grouped_mm"),
            ]
        if previous:
            old = before.get((*key, label))
            line += [_ratio(old, "fwd vs grouped_mm"), _ratio(old, "bwd vs grouped_mm")]
        lines.append(line)
    return tabulate(lines, headers=headers, tablefmt="github")


def fp8_table(rows: list[dict[str, str]], previous: list[dict[str, str]]) -> str:
    """One line per shape and backend: GEMM TFLOP/s and ratios, the earlier and this step time."""
    before = {(*(r[k] for k in KEY), r["Backend"]): r for r in previous}
    headers = [*KEY, "Backend", "GEMM TFLOP/s", "vs peer", "GEMM vs bf16"]
    headers += ["earlier step ms"] if previous else []
    headers += ["Step ms", "bf16 step ms", "Step vs bf16"]
    lines = []
    for row in rows:
        line = [*(row[k] for k in KEY), row["Backend"]]
        if not passed(row):
            lines.append(line + [row.get("Check", "-")])
            continue
        line += [
            f"{float(row['GEMM TFLOPS']):.0f}",
            _ratio(row, "Ratio vs peer"),
            _ratio(row, "Ratio vs bf16"),
        ]
        if previous:
            old = before.get((*(row[k] for k in KEY), row["Backend"]))
            line.append(f"{float(old['Step ms']):.2f}" if old and old.get("Step ms") else "-")
        line += [f"{float(row['Step ms']):.2f}", f"{float(row['BF16 Step ms']):.2f}"]
        line.append(_ratio(row, "Step ratio vs bf16"))
        lines.append(line)
    return tabulate(lines, headers=headers, tablefmt="github")


def summary(rows: list[dict[str, str]], columns: list[str]) -> list[str]:
    """Per backend and routing: geomean (min) of each column over the passing rows."""
    out = []
    for backend in dict.fromkeys(r["Backend"] for r in rows):
        for routing in ("balanced", "skewed"):
            ok = [r for r in rows if (r["Backend"], r["Routing"]) == (backend, routing) and passed(r)]
            parts = []
            for column in columns:
                values = [float(r[column]) for r in ok if r.get(column)]
                if values:
                    parts.append(f"{column} geomean {geometric_mean(values):.3f} (min {min(values):.3f})")
            if parts:
                out.append(f"- {backend} {routing}: " + ", ".join(parts))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv")
    p.add_argument("--previous", default="", help="an earlier CSV of the same benchmark")
    p.add_argument("--label", default="TRITON", help="bf16: the backend whose earlier ratios are shown")
    args = p.parse_args(argv)
    rows = load(args.csv)
    previous = load(args.previous) if args.previous else []
    if "Granularity" in rows[0]:
        print(fp8_table(rows, previous))
        columns = ["Ratio vs peer", "Ratio vs bf16", "Step ratio vs bf16"]
    else:
        print(bf16_table(rows, previous, args.label))
        columns = ["fwd vs grouped_mm", "bwd vs grouped_mm"]
    print()
    print("\n".join(summary(rows, columns)))


if __name__ == "__main__":
    main()
