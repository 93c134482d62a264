"""FP8 rows of ``bench_grouped_gemm_turbo --dtype fp8``: the grouped GEMM alone and the training step.

Per case (the same expert shapes and routings as bf16) and backend label:

- **GEMM**: ``primus_turbo::grouped_gemm_fp8`` on operands quantized beforehand (through the dispatcher),
  against ``torch._scaled_grouped_mm`` on the same operands (row-wise scales; tensorwise scales passed
  as constant row vectors; no peer for block scaling) and against bf16 ``torch._grouped_mm``.
- **Forward**: ``grouped_gemm_fp8(a, b, lens, trans_b=True)`` from bf16 tensors (the tokens' and the
  weights' quantization included) against the bf16 ``torch._grouped_mm``.
- **Step**: forward + backward of ``grouped_gemm_fp8(a, b, lens, trans_b=True)`` from bf16 tensors (every
  quantization included) against the bf16 ``torch._grouped_mm`` forward + backward.

Every group of calls interleaves call by call (``time_interleaved``).
"""

from __future__ import annotations

import argparse
from statistics import geometric_mean as geomean
from typing import Any

import torch
from tabulate import tabulate

from benchmark.ops.training.bench_gemm_fp8 import BLOCK, quant_config
from benchmark.ops.training.bench_utils import graph_timer, platform_name, time_interleaved, timing_stream

Row = dict[str, Any]


def _scaled_peer(qa, sa, qb, sb, offs32, name: str):
    """``torch._scaled_grouped_mm`` on the forward operands, or None (block scaling, or no kernel)."""
    if name == "blockwise" or not hasattr(torch, "_scaled_grouped_mm"):
        return None
    groups, n = qb.shape[0], qb.shape[1]
    scale_a = sa.float().reshape(-1).expand(qa.shape[0]).contiguous()
    scale_b = sb.float().reshape(groups, -1).expand(groups, n).contiguous()
    return lambda: torch._scaled_grouped_mm(
        qa, qb.transpose(1, 2), scale_a, scale_b, offs=offs32, out_dtype=torch.bfloat16
    )


def bench_case(case, lens: torch.Tensor, labels: list[str], args: argparse.Namespace) -> list[Row]:
    """One row per backend label for ``case``."""
    from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager, PrecisionType
    from primus_turbo.pytorch.core.custom_op import call_op
    from primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_fp8_impl import (
        GroupedGemmFp8Dispatcher,
        grouped_gemm_fp8_impl,
    )
    from primus_turbo.pytorch.ops import grouped_gemm_fp8
    from primus_turbo.pytorch.ops.grouped_gemm_fp8 import _block, _quantize_experts, _quantize_tokens

    device = args.device
    graph = graph_timer(args)
    config = quant_config(args.granularity)
    if args.granularity == "blockwise" and (case.k % BLOCK or case.n % BLOCK):
        skip = f"SKIP: K ({case.k}) and N ({case.n}) must be multiples of {BLOCK}"
        base = {"Model": case.model, "GEMM": case.gemm, "EP": case.ep, "Experts": case.groups}
        base.update(
            Tokens=case.tokens, N=case.n, K=case.k, Routing=case.routing, Granularity=args.granularity
        )
        return [
            {**base, "Backend": label, "Check": skip, "Platform": platform_name(device)} for label in labels
        ]
    tokens = int(lens.sum())
    offs = torch.cat([lens.new_zeros(1), torch.cumsum(lens, 0)])
    offs32 = offs[1:].to(torch.int32)
    a = torch.randn(tokens, case.k, device=device, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(case.groups, case.n, case.k, device=device, dtype=torch.bfloat16) * case.k**-0.5
    b.requires_grad_()
    grad = torch.randn(tokens, case.n, device=device, dtype=torch.bfloat16)
    flops = 2 * tokens * case.n * case.k
    fwd_dtype = torch.float8_e4m3fn
    qa, sa = _quantize_tokens(a.detach(), fwd_dtype, config)
    (qb, sb), _ = _quantize_experts(b.detach(), fwd_dtype, config, trans_b=True, dgrad=False)
    block = _block(config)
    peer = _scaled_peer(qa, sa, qb, sb, offs32, args.granularity)
    try:
        if peer is not None:
            peer()
    except (RuntimeError, NotImplementedError):  # no kernel for this case in the installed torch
        peer = None

    def bf16_gemm():
        return torch._grouped_mm(a.detach(), b.detach().transpose(1, 2), offs=offs32)

    bounds = [0, *torch.cumsum(lens.cpu(), 0).tolist()]
    a32, b32 = a.detach().float(), b.detach().float()
    reference = torch.cat([a32[bounds[g] : bounds[g + 1]] @ b32[g].t() for g in range(case.groups)])

    def bf16_step():
        torch._grouped_mm(a, b.transpose(1, 2), offs=offs32).backward(grad)

    def forward():
        return grouped_gemm_fp8(a.detach(), b.detach(), lens, trans_b=True, config=config)

    def step():
        grouped_gemm_fp8(a, b, lens, trans_b=True, config=config).backward(grad)

    rows = []
    for label in labels:
        GlobalBackendManager.reset()
        if label != "DEFAULT":
            GlobalBackendManager.set_grouped_gemm_backend(BackendType[label], PrecisionType.FP8)
        row: Row = {"Model": case.model, "GEMM": case.gemm, "EP": case.ep, "Experts": case.groups}
        row.update(Tokens=case.tokens, N=case.n, K=case.k, Routing=case.routing)
        row.update(Granularity=args.granularity, Backend=label)
        try:

            def gemm():
                return call_op(grouped_gemm_fp8_impl, qa, sa, qb, sb, offs, True, torch.bfloat16, block)

            out = gemm()
            row["Selected"] = GroupedGemmFp8Dispatcher.last_selected().name
            noise = (reference - out.float()).pow(2).sum()
            row["SNR dB"] = (10 * torch.log10(reference.pow(2).sum() / noise)).item()
            row["Check"] = "PASS" if row["SNR dB"] >= 25 else "FAIL"  # against the fp32 product
            calls = [gemm, bf16_gemm] + ([peer] if peer is not None else [])
            with timing_stream(graph):
                gemm_ms, bf16_ms, *peer_ms = time_interleaved(calls, None, device, graph)
                fwd_ms = time_interleaved([forward, bf16_gemm], None, device, graph)
                step_ms = time_interleaved([step, bf16_step], [a, b], device, graph)
            row["GEMM ms"], row["BF16 ms"] = gemm_ms, bf16_ms
            row["GEMM TFLOPS"] = flops / gemm_ms / 1e9
            row["Ratio vs bf16"] = bf16_ms / gemm_ms
            if peer_ms:
                row["Peer ms"], row["Peer TFLOPS"] = peer_ms[0], flops / peer_ms[0] / 1e9
                row["Ratio vs peer"] = peer_ms[0] / gemm_ms
            row["Fwd ms"], row["BF16 Fwd ms"] = fwd_ms
            row["Fwd ratio vs bf16"] = row["BF16 Fwd ms"] / row["Fwd ms"]
            row["Step ms"], row["BF16 Step ms"] = step_ms
            row["Step ratio vs bf16"] = row["BF16 Step ms"] / row["Step ms"]
        except Exception as exc:  # report the row and keep benchmarking
            row["Check"] = f"ERROR {type(exc).__name__}: {exc}"[:200]
        row["Platform"] = platform_name(device)
        rows.append(row)
    GlobalBackendManager.reset()
    return rows


def summarize(rows: list[Row], labels: list[str]) -> list[list[Any]]:
    """Per label and routing: geomean GEMM ratio vs the scaled peer and vs bf16, the forward's (with
    quantization) and the step's ratio vs bf16."""
    keys = ("Ratio vs peer", "Ratio vs bf16", "Fwd ratio vs bf16", "Step ratio vs bf16")
    lines = []
    for label in labels:
        for routing in ("balanced", "skewed"):
            ok = [r for r in rows if (r["Backend"], r["Routing"], r["Check"]) == (label, routing, "PASS")]
            means = [[r[key] for r in ok if key in r] for key in keys]
            lines.append([label, routing, len(ok)] + [f"{geomean(v):.3f}" if v else "-" for v in means])
    return lines


def print_tables(rows: list[Row], labels: list[str]) -> None:
    columns = ["Model", "GEMM", "Tokens", "Routing", "Backend", "Selected", "Check", "GEMM TFLOPS"]
    columns += ["Peer TFLOPS", "Ratio vs peer", "Ratio vs bf16", "Fwd ratio vs bf16", "Step ratio vs bf16"]
    print(tabulate([[r.get(c, "-") for c in columns] for r in rows], headers=columns, floatfmt=".3f"))
    print()
    headers = ["Backend", "Routing", "PASS", "GEMM vs scaled peer", "GEMM vs bf16", "Fwd vs bf16"]
    headers.append("Step vs bf16")
    print(tabulate(summarize(rows, labels), headers=headers, disable_numparse=True))
