"""FP8 and MXFP4 rows of ``bench_gemm_turbo --dtype fp8|fp4``: GEMM, quantization and training step.

``--dtype fp4`` times ``gemm_fp4`` (MXFP4 on exactly dequantized bf16 operands: Hopper has no FP4
tensor cores) the same way, with bf16 ``torch.matmul`` as the only peer.

Per shape and backend label:

- **GEMM**: the FP8 GEMM alone on operands quantized beforehand (``primus_turbo::gemm_fp8`` through
  the dispatcher), against ``torch._scaled_mm`` on the same operands (tensorwise, row-wise, and
  1 x 128 / 128 x 128 blocks; MX has no peer on Hopper) and against bf16 ``torch.matmul``.
- **Quant**: quantizing the activation and the weight for the forward (``quantize_fp8``), reported
  separately as the targets ask.
- **Step**: forward + backward of ``gemm_fp8(a, w, trans_b=True)`` from bf16 inputs (every
  quantization included) against the bf16 ``torch.matmul`` forward + backward.
- **Check**: SNR of the FP8 forward against the fp32 product; PASS at >= 25 dB.

The GEMM, its peers and bf16 interleave call by call, and so do the two steps (``time_interleaved``).
"""

from __future__ import annotations

import argparse
import csv
import logging
import statistics
from collections.abc import Callable
from typing import Any

import torch
import triton
from tabulate import tabulate

from benchmark.ops.training.bench_utils import graph_timer, make_inputs, time_interleaved, timing_stream
from benchmark.ops.training.config import GemmShape

LOG = logging.getLogger("bench_gemm_fp8")
AUTO = "AUTO"
DEFAULT = "DEFAULT"  # no pin and no autotune: what a user gets out of the box
SNR_PASS_DB = 25.0
FP4_PASS_DB = 10.0
BLOCK = 128
GRANULARITY_NAMES = ("tensorwise", "rowwise", "blockwise", "mxfp8")
CSV_COLUMNS = [
    "Case", "GEMM", "MBS", "M", "N", "K", "Granularity", "Backend", "Selected", "Check", "SNR dB",
    "GEMM ms", "GEMM TFLOPS", "Peer", "Peer ms", "Peer TFLOPS", "Ratio vs peer",
    "BF16 ms", "BF16 TFLOPS", "Ratio vs bf16", "Quant ms", "Step ms", "BF16 Step ms", "Step ratio vs bf16",
    "Error", "Platform", "Torch", "Triton",
]  # fmt: skip
Row = dict[str, Any]


def quant_config(name: str):
    """The ``Float8QuantConfig`` of a ``--granularity`` name (E4M3 forward, E5M2 gradients)."""
    from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, Format, ScaleDtype
    from primus_turbo.pytorch.core.low_precision import ScalingGranularity as G

    if name == "blockwise":
        return Float8QuantConfig(format=Format.HYBRID, granularity=G.BLOCKWISE, block_size=BLOCK)
    if name == "mxfp8":
        return Float8QuantConfig(
            format=Format.HYBRID, granularity=G.MX_BLOCKWISE, block_size=32, scale_dtype=ScaleDtype.E8M0
        )
    granularity = G.ROWWISE if name == "rowwise" else G.TENSORWISE
    return Float8QuantConfig(format=Format.HYBRID, granularity=granularity)


def quantize_operands(a: torch.Tensor, w: torch.Tensor, config) -> tuple[torch.Tensor, ...]:
    """``(qa, sa, qw, sw, w_2d)`` quantized along K the way ``gemm_fp8``'s forward does it."""
    from primus_turbo.pytorch.core.low_precision import ScalingGranularity as G
    from primus_turbo.pytorch.core.low_precision import ScalingRecipe, float8_e4m3
    from primus_turbo.pytorch.ops import quantize_fp8

    granularity = config.granularity
    axis = None if granularity is G.TENSORWISE else 1
    qa, sa = quantize_fp8(a, float8_e4m3, granularity, block_size=config.block_size, axis=axis)
    w_2d = granularity is G.BLOCKWISE
    recipe = ScalingRecipe(use_2d_block=True) if w_2d else None
    qw, sw = quantize_fp8(
        w,
        float8_e4m3,
        granularity,
        block_size=config.block_size,
        axis=None if w_2d else axis,
        scaling_recipe=recipe,
    )
    return qa, sa, qw, sw, w_2d


def scaled_mm_peer(qa, sa, qw, sw, config) -> Callable[[], torch.Tensor] | None:
    """``torch._scaled_mm`` on the same operands, or None where it has no kernel (MX on Hopper)."""
    from primus_turbo.pytorch.core.low_precision import ScalingGranularity as G

    granularity = config.granularity
    if granularity is G.MX_BLOCKWISE:
        return None
    if granularity is G.ROWWISE:
        scale_a, scale_b = sa, sw.t()
    elif granularity is G.BLOCKWISE:
        scale_a, scale_b = sa.t().contiguous().t(), sw.t()
    else:
        scale_a, scale_b = sa, sw
    return lambda: torch._scaled_mm(qa, qw.t(), scale_a, scale_b, out_dtype=torch.bfloat16)


class _LowPrecisionCase:
    """What one benchmark row quantizes and multiplies: FP8 with a config, or MXFP4."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.fp4 = args.dtype == "fp4"
        self.config = None if self.fp4 else quant_config(args.granularity)
        self.granularity = "mxfp4" if self.fp4 else args.granularity

    def quantize(self, a: torch.Tensor, w: torch.Tensor) -> tuple:
        if self.fp4:
            from primus_turbo.pytorch.ops import quantize_fp4

            return (*quantize_fp4(a), *quantize_fp4(w))
        return quantize_operands(a, w, self.config)

    def gemm(self, operands: tuple) -> Callable[[], torch.Tensor]:
        from primus_turbo.pytorch.core.custom_op import call_op

        if self.fp4:
            from primus_turbo.pytorch.kernels.gemm.gemm_fp4_impl import gemm_fp4_impl

            return lambda: call_op(gemm_fp4_impl, *operands, torch.bfloat16)
        from primus_turbo.pytorch.kernels.gemm.gemm_fp8_impl import gemm_fp8_impl

        qa, sa, qw, sw, w_2d = operands
        gran, block = self.config.granularity.value, self.config.block_size or 0
        return lambda: call_op(gemm_fp8_impl, qa, sa, qw, sw, torch.bfloat16, gran, block, False, w_2d)

    def peer(self, operands: tuple) -> Callable[[], torch.Tensor] | None:
        return None if self.fp4 else scaled_mm_peer(*operands[:4], self.config)

    def selected(self) -> str:
        if self.fp4:
            return "DEQUANT"
        from primus_turbo.pytorch.kernels.gemm.gemm_fp8_impl import GemmFp8Dispatcher

        return GemmFp8Dispatcher.last_selected().name

    def forward(self, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        from primus_turbo.pytorch.ops import gemm_fp4, gemm_fp8

        if self.fp4:
            return gemm_fp4(a, w, trans_b=True)
        return gemm_fp8(a, w, trans_b=True, config=self.config)


def bench_shape(shape: GemmShape, labels: list[str], args: argparse.Namespace, env: Row) -> list[Row]:
    """One row per backend label for ``shape``."""
    from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager, PrecisionType

    case = _LowPrecisionCase(args)
    a, w, grad = make_inputs(shape, torch.bfloat16, args.device)
    flops = 2 * shape.M * shape.N * shape.K
    reference = a.detach().float() @ w.detach().float().t()
    rows = []
    for label in labels:
        row: Row = {"Case": shape.model, "GEMM": shape.gemm, "MBS": shape.mbs, "M": shape.M, "N": shape.N}
        row.update(K=shape.K, Granularity=case.granularity, Backend=label, **env)
        GlobalBackendManager.reset()
        if label == AUTO:
            GlobalBackendManager.set_auto_tune(True)
        elif label != DEFAULT:
            GlobalBackendManager.set_gemm_backend(BackendType[label], PrecisionType.FP8)
        try:
            operands = case.quantize(a.detach(), w.detach())
            low_precision_gemm = case.gemm(operands)
            out = low_precision_gemm()
            row["Selected"] = case.selected()
            noise = (reference - out.float()).pow(2).sum()
            row["SNR dB"] = (10 * torch.log10(reference.pow(2).sum() / noise)).item()
            row["Check"] = "PASS" if row["SNR dB"] >= (FP4_PASS_DB if case.fp4 else SNR_PASS_DB) else "FAIL"
            peer = case.peer(operands)
            row["Peer"] = "torch._scaled_mm" if peer else "-"
            try:
                if peer is not None:
                    peer()
            except (RuntimeError, ValueError) as exc:  # this torch build has no kernel for the case
                row["Peer"], peer = f"torch._scaled_mm unavailable: {str(exc).splitlines()[0]}"[:80], None
            graph = graph_timer(args)
            calls = [low_precision_gemm, lambda: torch.matmul(a.detach(), w.detach().t())]
            with timing_stream(graph):
                gemm_ms, bf16_ms, *peer_ms = time_interleaved(
                    calls + ([peer] if peer is not None else []), None, args.device, graph
                )
                row["Quant ms"] = time_interleaved(
                    [lambda: case.quantize(a.detach(), w.detach())], None, args.device, graph
                )[0]

                def step():
                    case.forward(a, w).backward(grad)

                def bf16_step():
                    torch.matmul(a, w.t()).backward(grad)

                row["Step ms"], row["BF16 Step ms"] = time_interleaved(
                    [step, bf16_step], [a, w], args.device, graph
                )
            row["GEMM ms"], row["BF16 ms"] = gemm_ms, bf16_ms
            row["GEMM TFLOPS"] = flops / gemm_ms / 1e9
            row["BF16 TFLOPS"] = flops / bf16_ms / 1e9
            row["Ratio vs bf16"] = bf16_ms / gemm_ms
            if peer_ms:
                row["Peer ms"] = peer_ms[0]
                row["Peer TFLOPS"] = flops / peer_ms[0] / 1e9
                row["Ratio vs peer"] = peer_ms[0] / gemm_ms
            row["Step ratio vs bf16"] = row["BF16 Step ms"] / row["Step ms"]
        except Exception as exc:  # report the row and keep benchmarking
            row["Check"] = "ERROR"
            row["Error"] = f"{type(exc).__name__}: {exc}"[:200]
            LOG.warning("%s %s %s: %s", shape.model, shape.gemm, label, row["Error"])
        a.grad = w.grad = None
        rows.append(row)
    GlobalBackendManager.reset()
    return rows


def summarize(rows: list[Row], labels: list[str]) -> list[list[Any]]:
    """Per label over PASS rows: geomean GEMM ratio vs the peer and vs bf16, worst peer ratio, step ratio."""
    lines = []
    for label in labels:
        ok = [r for r in rows if r["Backend"] == label and r["Check"] == "PASS"]
        line: list[Any] = [label, f"{len(ok)}/{sum(r['Backend'] == label for r in rows)}"]
        with_peer = [r for r in ok if "Ratio vs peer" in r]
        for key, pool in (("Ratio vs peer", with_peer), ("Ratio vs bf16", ok), ("Step ratio vs bf16", ok)):
            line.append(f"{statistics.geometric_mean(r[key] for r in pool):.3f}" if pool else "-")
        worst = min(with_peer, key=lambda r: r["Ratio vs peer"], default=None)
        line.append(f"{worst['Ratio vs peer']:.3f} ({worst['Case']} {worst['GEMM']})" if worst else "-")
        line.append(f"{sum(r['Ratio vs peer'] >= 1.0 for r in with_peer)}/{len(with_peer)}")
        lines.append(line)
    return lines


def run(args: argparse.Namespace, shapes: list[GemmShape], labels: list[str], env: Row) -> None:
    """Benchmark ``shapes``, write the CSV progressively and print the tables."""
    rows: list[Row] = []
    with open(args.output, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for shape in shapes:
            for row in bench_shape(shape, labels, args, env):
                writer.writerow(row)
                rows.append(row)
            f.flush()
            if args.device == "cuda":
                torch.cuda.empty_cache()
    columns = ["Case", "GEMM", "M", "N", "K", "Backend", "Selected", "Check", "GEMM TFLOPS", "Peer TFLOPS"]
    columns += ["Ratio vs peer", "Ratio vs bf16", "Quant ms", "Step ratio vs bf16"]
    table = [[_cell(r.get(c)) for c in columns] for r in rows]
    print(tabulate(table, headers=columns, missingval="-", disable_numparse=True))
    print()
    headers = [
        "Backend",
        "PASS",
        "GEMM vs peer",
        "GEMM vs bf16",
        "Step vs bf16",
        "worst vs peer",
        ">= 1.0 peer",
    ]
    print(tabulate(summarize(rows, labels), headers=headers, disable_numparse=True))
    LOG.info("wrote %d rows to %s (triton %s)", len(rows), args.output, triton.__version__)


def _cell(value: Any) -> Any:
    return f"{value:.3f}" if isinstance(value, float) else value
