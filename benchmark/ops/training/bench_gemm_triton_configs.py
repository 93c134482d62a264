"""Time every Triton GEMM config on chosen shapes and layouts, next to torch.matmul.

A tuning aid: it shows which tile shapes win where, so the autotune config lists stay short and
complete. Each config runs outside the autotuner (``gemm_triton(..., config=...)``).

Example::

    python -m benchmark.ops.training.bench_gemm_triton_configs --mnk 4096x576x7168 --layouts NT,NN
"""

from __future__ import annotations

import argparse
import csv
import logging

import torch
import triton
import triton.testing
from tabulate import tabulate

from benchmark.ops.training.bench_gemm_layouts import LAYOUTS, operands
from benchmark.ops.training.config import SHAPE_SETS, gemm_shape_set

LOG = logging.getLogger("bench_gemm_triton_configs")


def config_label(config: triton.Config) -> str:
    """Compact ``BMxBNxBK gG sS wW`` label plus any extra switches of a config."""
    kw = dict(config.kwargs)
    label = f"{kw.pop('BLOCK_M')}x{kw.pop('BLOCK_N')}x{kw.pop('BLOCK_K')} g{kw.pop('GROUP_M')}"
    label += f" s{config.num_stages} w{config.num_warps}"
    return label + "".join(f" {k}={v}" for k, v in kw.items())


def median_ms(fn) -> float:
    """Median milliseconds of ``fn`` (CUDA events, L2 flushed before each call)."""
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def parse_mnk(text: str) -> list[tuple[str, int, int, int]]:
    """``MxNxK`` items separated by commas."""
    shapes = []
    for item in text.split(","):
        m, n, k = (int(v) for v in item.lower().split("x"))
        shapes.append((item, m, n, k))
    return shapes


def main(argv: list[str] | None = None) -> None:
    """Sweep configs per (shape, layout) and print the ranking with the peer's time."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", choices=SHAPE_SETS, default=None, help="a named shape set")
    p.add_argument("--mnk", default=None, help="explicit shapes, e.g. 4096x576x7168,8192x4096x4096")
    p.add_argument("--layouts", default="NT")
    p.add_argument("--pointer", action="store_true", help="sweep the pointer kernel instead of TMA")
    p.add_argument("-o", "--output", default="bench_gemm_triton_configs.csv")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    from primus_turbo.triton.gemm.gemm_kernel import gemm_triton, kernel_configs

    shapes = parse_mnk(args.mnk) if args.mnk else []
    if args.shapes:
        shapes += [(f"{s.model} {s.gemm}", s.M, s.N, s.K) for s in gemm_shape_set(args.shapes)]
    use_tma = not args.pointer
    rows = []
    for name, m, n, k in shapes:
        for layout in args.layouts.split(","):
            trans_a, trans_b = LAYOUTS[layout]
            a, b = operands(m, n, k, trans_a, trans_b)
            lhs, rhs = (a.t() if trans_a else a), (b.t() if trans_b else b)
            reference = torch.matmul(lhs.float(), rhs.float())
            out = torch.empty(m, n, dtype=a.dtype, device=a.device)
            flops = 2 * m * n * k
            peer_ms = median_ms(lambda lhs=lhs, rhs=rhs: torch.matmul(lhs, rhs))
            candidates = [("autotuned", None)] + [(config_label(c), c) for c in kernel_configs(use_tma)]
            for label, config in candidates:
                row = {"Shape": name, "M": m, "N": n, "K": k, "Layout": layout, "Config": label}

                def run(config=config, a=a, b=b, ta=trans_a, tb=trans_b, out=out):
                    return gemm_triton(a, b, ta, tb, out, use_tma=use_tma, config=config)

                try:
                    run()
                    error = ((out.float() - reference).norm() / reference.norm()).item()
                    ms = median_ms(run)
                except Exception as exc:  # a config that does not fit this device
                    LOG.info("%s %s %s: %s", name, layout, label, str(exc).splitlines()[0][:100])
                    continue
                row.update(Check="PASS" if error < 1e-2 else f"FAIL {error:.1e}", us=ms * 1e3)
                row.update(TFLOPS=flops / ms / 1e9, Peer_TFLOPS=flops / peer_ms / 1e9, Ratio=peer_ms / ms)
                rows.append(row)
            ranked = [r for r in rows if r["Shape"] == name and r["Layout"] == layout]
            best = max(ranked, key=lambda r: r["Ratio"])
            LOG.info("%s %s best %s ratio %.3f", name, layout, best["Config"], best["Ratio"])
    print(tabulate(rows, headers="keys", floatfmt=".3f"))
    if rows:
        with open(args.output, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
