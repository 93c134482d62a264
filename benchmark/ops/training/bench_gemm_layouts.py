"""Forward GEMM per layout (NN, NT, TN, TT) and backend against torch.matmul on the same views.

The training GEMMs use three layouts: forward NT (``x @ w.T``), dgrad NN (``dy @ w``) and wgrad TN
(``dy.T @ x``). This diagnostic isolates each one, so a slow backward can be traced to its layout.

Example::

    python -m benchmark.ops.training.bench_gemm_layouts --shapes quick --backends HIPBLASLT,TRITON
"""

from __future__ import annotations

import argparse
import csv
import logging
import statistics

import torch
import triton
import triton.testing
from tabulate import tabulate

from benchmark.ops.training.config import SHAPE_SETS, gemm_shape_set

LOG = logging.getLogger("bench_gemm_layouts")
LAYOUTS = {"NN": (False, False), "NT": (False, True), "TN": (True, False), "TT": (True, True)}
COLUMNS = ["Case", "GEMM", "M", "N", "K", "Layout", "Backend", "Check", "TFLOPS", "Peer TFLOPS", "Ratio"]


def operands(m: int, n: int, k: int, trans_a: bool, trans_b: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bf16 operands stored as the layout says, scaled so the product is ~ N(0, 1)."""
    a = torch.randn((k, m) if trans_a else (m, k), device="cuda", dtype=torch.bfloat16)
    b = torch.randn((n, k) if trans_b else (k, n), device="cuda", dtype=torch.bfloat16).mul_(k**-0.5)
    return a, b


def median_ms(fn) -> float:
    """Median milliseconds of ``fn`` (CUDA events, L2 flushed before each call)."""
    return triton.testing.do_bench(fn, warmup=25, rep=60, return_mode="median")


def main(argv: list[str] | None = None) -> None:
    """Time every (shape, layout, backend) forward against torch.matmul in alternating rounds."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", choices=SHAPE_SETS, default="quick")
    p.add_argument("--layouts", default="NN,NT,TN,TT")
    p.add_argument("--backends", default="HIPBLASLT,TRITON")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("-o", "--output", default="bench_gemm_layouts.csv")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager
    from primus_turbo.pytorch.ops import gemm

    rows = []
    for shape in gemm_shape_set(args.shapes):
        for layout in args.layouts.split(","):
            trans_a, trans_b = LAYOUTS[layout]
            a, b = operands(shape.M, shape.N, shape.K, trans_a, trans_b)
            lhs, rhs = (a.t() if trans_a else a), (b.t() if trans_b else b)
            reference = torch.matmul(lhs.float(), rhs.float())
            flops = 2 * shape.M * shape.N * shape.K
            for backend in args.backends.split(","):
                GlobalBackendManager.reset()
                GlobalBackendManager.set_gemm_backend(BackendType[backend])
                row = {"Case": shape.model, "GEMM": shape.gemm, "M": shape.M, "N": shape.N, "K": shape.K}
                row.update(Layout=layout, Backend=backend)
                out = gemm(a, b, trans_a, trans_b)
                error = ((out.float() - reference).norm() / reference.norm()).item()
                row["Check"] = "PASS" if error < 1e-2 else f"FAIL {error:.1e}"
                turbo, peer = [], []
                for _ in range(args.rounds):
                    peer.append(median_ms(lambda lhs=lhs, rhs=rhs: torch.matmul(lhs, rhs)))
                    turbo.append(median_ms(lambda a=a, b=b, ta=trans_a, tb=trans_b: gemm(a, b, ta, tb)))
                row["TFLOPS"] = flops / statistics.median(turbo) / 1e9
                row["Peer TFLOPS"] = flops / statistics.median(peer) / 1e9
                row["Ratio"] = row["TFLOPS"] / row["Peer TFLOPS"]
                rows.append(row)
                LOG.info("%s", row)
            del a, b, lhs, rhs, reference
            torch.cuda.empty_cache()
    GlobalBackendManager.reset()
    with open(args.output, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    table = [
        [
            f"{r[c]:.3f}" if c == "Ratio" else f"{r[c]:.1f}" if isinstance(r[c], float) else r[c]
            for c in COLUMNS
        ]
        for r in rows
    ]
    print(tabulate(table, headers=COLUMNS, disable_numparse=True))
    for backend in args.backends.split(","):
        for layout in args.layouts.split(","):
            ratios = [r["Ratio"] for r in rows if r["Backend"] == backend and r["Layout"] == layout]
            if ratios:
                geomean = statistics.geometric_mean(ratios)
                print(f"{backend} {layout}: geomean ratio {geomean:.3f} over {len(ratios)} shapes")


if __name__ == "__main__":
    main()
