"""Time every Triton GEMM config on chosen shapes and layouts, next to torch.matmul.

A tuning aid: it shows which tile shapes win where, so the autotune config lists stay short and
complete. Each config runs outside the autotuner (``gemm_triton(..., config=...)``). With ``--fp8`` it
sweeps the FP8 GEMM kernel (its autotune configs plus ``FP8_CANDIDATES``) on operands quantized as
``gemm_fp8``'s forward quantizes them, next to ``torch._scaled_mm`` on the same operands.

Example::

    python -m benchmark.ops.training.bench_gemm_triton_configs --mnk 4096x576x7168 --layouts NT,NN
    python -m benchmark.ops.training.bench_gemm_triton_configs --mnk 8192x8192x8192 --fp8 blockwise
"""

from __future__ import annotations

import argparse
import functools
import logging

import torch
import triton
import triton.testing
from tabulate import tabulate

from benchmark.ops.training.bench_gemm_layouts import LAYOUTS, operands
from benchmark.ops.training.bench_utils import write_csv
from benchmark.ops.training.config import SHAPE_SETS, gemm_shape_set

LOG = logging.getLogger("bench_gemm_triton_configs")

# FP8 tiles worth timing beyond the autotune list: (BLOCK_M, BLOCK_N, stages, warps), BLOCK_K 128
# the Hopper Gluon kernel for block scaling: stages, K-blocks per loop iteration, GROUP_M
SM90_CANDIDATES = [(3, 4, 8), (4, 4, 8), (5, 4, 8), (6, 4, 8), (4, 2, 8), (4, 6, 8), (4, 8, 8), (5, 8, 8)]
SM90_CANDIDATES += [(4, 4, 16), (5, 4, 16), (4, 4, 4)]
# BLOCK_M, BLOCK_N, stages, warps, programs per SM, GROUP_M
FP8_CANDIDATES = [
    (64, 128, 3, 4, 2, 4),
    (64, 128, 3, 4, 2, 16),
    (64, 128, 2, 4, 3, 8),
    (128, 64, 3, 4, 2, 8),
    (128, 128, 3, 8, 1, 8),
    (128, 128, 5, 8, 1, 8),
    (256, 128, 3, 8, 1, 8),
]


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


def fp8_candidates(granularity: str) -> list[tuple[str, object]]:
    """("autotuned", None), then the FP8 kernel's configs and ``FP8_CANDIDATES``, labelled; for block
    scaling also the Hopper Gluon kernel's ``SM90_CANDIDATES``."""
    from primus_turbo.triton.gemm.gemm_fp8_kernel import kernel_configs

    configs = kernel_configs() + [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 128, "GROUP_M": gm, "CTAS_PER_SM": ctas},
            num_stages=s,
            num_warps=w,
        )
        for bm, bn, s, w, ctas, gm in FP8_CANDIDATES
    ]
    seen, labelled = set(), [("autotuned", None)]
    for config in configs:
        label = config_label(config)
        if label not in seen:
            seen.add(label)
            labelled.append((label, config))
    if granularity == "blockwise":
        from primus_turbo.triton.gemm.gemm_fp8_block_sm90 import BlockSm90Config

        labelled += [
            (f"gluon sm90 s{s} u{u} g{g}", BlockSm90Config(num_stages=s, k_unroll=u, group_m=g))
            for s, u, g in SM90_CANDIDATES
        ]
    return labelled


def fp8_runs(m: int, n: int, k: int, granularity: str, device: str = "cuda"):
    """(reference, peer call, run(config) -> out) for an FP8 NT GEMM quantized like ``gemm_fp8``."""
    from benchmark.ops.training.bench_gemm_fp8 import quant_config, quantize_operands, scaled_mm_peer
    from primus_turbo.pytorch.kernels.gemm.gemm_fp8_impl import _triton_mode
    from primus_turbo.triton.gemm.gemm_fp8_block_sm90 import BlockSm90Config, gemm_fp8_block_sm90
    from primus_turbo.triton.gemm.gemm_fp8_kernel import gemm_fp8_triton

    config = quant_config(granularity)
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * k**-0.5
    qa, sa, qw, sw, w_2d = quantize_operands(a, w, config)
    reference = a.float() @ w.float().t()
    peer = scaled_mm_peer(qa, sa, qw, sw, config)
    gran = config.granularity.value
    a_mode, b_mode = _triton_mode(gran, False), _triton_mode(gran, w_2d)
    block = config.block_size if granularity == "blockwise" else 0
    out = torch.empty(m, n, device=device, dtype=torch.bfloat16)

    def run(kernel_config):
        if isinstance(kernel_config, BlockSm90Config):
            if not gemm_fp8_block_sm90(qa, sa.float(), qw, sw.float(), out, kernel_config):
                raise RuntimeError("the Gluon kernel does not compile here")
            return out
        return gemm_fp8_triton(
            qa, sa.float(), a_mode, qw, sw.float(), b_mode, out, block, config=kernel_config
        )

    return reference, peer, run


def sweep_fp8(shapes, granularity: str) -> list[dict]:
    """One row per (shape, FP8 config): time, TFLOP/s, SNR check and the ratio to torch._scaled_mm."""
    rows = []
    for name, m, n, k in shapes:
        reference, peer, run = fp8_runs(m, n, k, granularity)
        flops = 2 * m * n * k
        peer_ms = median_ms(peer) if peer is not None else float("nan")
        for label, config in fp8_candidates(granularity):
            try:
                out = run(config)
                snr = 10 * torch.log10(reference.pow(2).sum() / (reference - out.float()).pow(2).sum()).item()
                ms = median_ms(functools.partial(run, config))
            except Exception as exc:  # a config that does not fit this device
                LOG.info("%s %s: %s", name, label, str(exc).splitlines()[0][:100])
                continue
            row = {"Shape": name, "M": m, "N": n, "K": k, "Granularity": granularity, "Config": label}
            row.update(Check="PASS" if snr >= 25 else f"FAIL {snr:.1f} dB", us=ms * 1e3)
            row.update(TFLOPS=flops / ms / 1e9, Peer_TFLOPS=flops / peer_ms / 1e9, Ratio=peer_ms / ms)
            rows.append(row)
        best = max((r for r in rows if r["Shape"] == name), key=lambda r: r["TFLOPS"], default=None)
        if best:
            LOG.info(
                "%s best %s %.0f TFLOP/s, ratio %.3f", name, best["Config"], best["TFLOPS"], best["Ratio"]
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    """Sweep configs per (shape, layout) and print the ranking with the peer's time."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", choices=SHAPE_SETS, default=None, help="a named shape set")
    p.add_argument("--mnk", default=None, help="explicit shapes, e.g. 4096x576x7168,8192x4096x4096")
    p.add_argument("--layouts", default="NT")
    p.add_argument("--pointer", action="store_true", help="sweep the pointer kernel instead of TMA")
    p.add_argument(
        "--fp8",
        choices=("tensorwise", "rowwise", "blockwise"),
        default=None,
        help="sweep the FP8 GEMM kernel with this scaling instead (NT layout)",
    )
    p.add_argument("-o", "--output", default="bench_gemm_triton_configs.csv")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    from primus_turbo.triton.gemm.gemm_kernel import gemm_triton, kernel_configs

    shapes = parse_mnk(args.mnk) if args.mnk else []
    if args.shapes:
        shapes += [(f"{s.model} {s.gemm}", s.M, s.N, s.K) for s in gemm_shape_set(args.shapes)]
    use_tma = not args.pointer
    rows = sweep_fp8(shapes, args.fp8) if args.fp8 else []
    for name, m, n, k in [] if args.fp8 else shapes:
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
        write_csv(args.output, rows)


if __name__ == "__main__":
    main()
