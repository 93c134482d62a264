"""Time launch choices of the Hopper Gluon grouped GEMM kernels (forward / dgrad) against the vendor peer.

A tuning aid like ``bench_group_quant_configs``: for expert shapes of DeepSeek-V3, Qwen3-235B-A22B and
Qwen3-30B-A3B at EP 8 (2048 tokens per expert, balanced and skewed 0.2 + 0.8 * rand routing), every
``Sm90Tiles`` candidate of the bf16 kernel runs next to ``torch._grouped_mm``, and every
``BlockSm90Config`` candidate of the tensorwise FP8 kernel next to ``torch._scaled_grouped_mm`` (where the
installed torch has it), and the bf16 variable-K (wgrad) kernel's candidates next to ``torch._grouped_mm``
over the tokens, interleaved with CUDA events (L2 flushed). Each candidate's output is checked
against the peer's. The skewed rows show whether the tile order (``group_m``) or the tile shape is what
costs the persistent schedule time when group sizes differ.

Example::

    python -m benchmark.ops.training.bench_grouped_sm90_configs -o grouped_sm90_configs.csv
"""

from __future__ import annotations

import argparse
import functools

import torch
from tabulate import tabulate

from benchmark.ops.training.bench_grouped_gemm_turbo import Case, group_lens
from benchmark.ops.training.bench_utils import platform_name, time_interleaved, write_csv

# (block_n, block_k, num_stages, group_m) of the bf16 kernels; the first is the forward's default
TILE_CANDIDATES = [(128, 64, 5, 8), (128, 64, 4, 8), (128, 64, 5, 64), (256, 64, 3, 8), (256, 64, 3, 64)]
# (num_stages, k_unroll, group_m) of the FP8 kernel; the first is its default
# GROUP_M 64 walks every row tile of a group (up to 8192 tokens) down one weight column before the next
FP8_CANDIDATES = [(4, 8, 8), (4, 8, 64), (5, 8, 8), (5, 8, 64)]
CASES = [
    Case("DeepSeek-V3", "fc1", 8, 32, 2048, 4096, 7168, "balanced"),
    Case("DeepSeek-V3", "fc1", 8, 32, 2048, 4096, 7168, "skewed"),
    Case("DeepSeek-V3", "fc2", 8, 32, 2048, 7168, 2048, "skewed"),
    Case("Qwen3-235B-A22B", "fc1", 8, 16, 2048, 3072, 4096, "balanced"),
    Case("Qwen3-235B-A22B", "fc1", 8, 16, 2048, 3072, 4096, "skewed"),
    Case("Qwen3-30B-A3B", "fc2", 8, 16, 2048, 2048, 768, "skewed"),
    Case("GPT-OSS-20B", "fc2", 8, 4, 2048, 2880, 2880, "balanced"),
    Case("GPT-OSS-20B", "fc2", 8, 4, 2048, 2880, 2880, "skewed"),
]


def _row(case: Case, kind: str, label: str, ms: float, peer_ms: float, err: float) -> dict:
    flops = 2 * case.groups * case.tokens * case.n * case.k
    return {
        "Model": case.model,
        "GEMM": case.gemm,
        "Routing": case.routing,
        "Kernel": kind,
        "Config": label,
        "ms": ms,
        "TFLOPS": flops / ms / 1e9,
        "Peer ms": peer_ms,
        "vs peer": peer_ms / ms,
        "Rel err": err,
        "Platform": platform_name("cuda"),
    }


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _sweep(
    case: Case, kind: str, candidates: dict, launch, peer, ref: torch.Tensor, limit: int
) -> list[dict]:
    """Time ``launch(config, out)`` for the first ``limit`` (0: every) ``{label: config}`` candidate next to
    ``peer`` (None: no peer), after checking each output against ``ref``. ``launch`` returns False where
    the kernel does not compile; such candidates (and ones that fail at launch) are reported and skipped."""
    calls, labels, errs = [], [], []
    for label, config in list(candidates.items())[: limit or None]:
        out = torch.empty_like(ref)

        def call(config=config, out=out) -> None:
            if not launch(config, out):
                raise RuntimeError("does not compile")

        try:
            call()
        except Exception as exc:  # report the candidate and keep sweeping
            print(f"{kind} {label}: {type(exc).__name__}: {exc}"[:200])
            continue
        calls.append(call)
        labels.append(label)
        errs.append(_rel_err(out, ref))
    times = time_interleaved([*calls, *([peer] if peer else [])], None, "cuda")
    peer_ms = times[-1] if peer else float("nan")
    return [_row(case, kind, *row, peer_ms, err) for *row, err in zip(labels, times, errs, strict=False)]


def _tiles() -> dict:
    from primus_turbo.triton.grouped_gemm.grouped_gemm_sm90 import Sm90Tiles

    return {
        f"{n}x{k} s{stages} g{group_m}": Sm90Tiles(block_n=n, block_k=k, num_stages=stages, group_m=group_m)
        for n, k, stages, group_m in TILE_CANDIDATES
    }


def offsets(lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 offsets [G + 1], int32 end rows [G]) of the group sizes ``lens``."""
    offs = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
    return offs, offs[1:].to(torch.int32)


def fp8_problem(case: Case, lens: torch.Tensor) -> dict:
    """A tensorwise FP8 grouped forward with group sizes ``lens``: E4M3 ``a`` [T, K] and ``b`` [G, N, K],
    a 0-d scale for ``a`` and one per expert for ``b``, their offsets, and ``peer`` (the same product
    through ``torch._scaled_grouped_mm``; None where the installed torch lacks it)."""
    offs, ends = offsets(lens)
    e4m3 = torch.float8_e4m3fn
    a = torch.randn(int(lens.sum()), case.k, device="cuda").to(e4m3)
    b = (torch.randn(case.groups, case.n, case.k, device="cuda") * 4).to(e4m3)
    sa = torch.full((), 0.5, device="cuda")
    sb = torch.rand(case.groups, device="cuda") + 0.5
    peer = None
    if hasattr(torch, "_scaled_grouped_mm"):
        scale_a = sa.expand(a.shape[0]).contiguous()
        scale_b = sb[:, None].expand(-1, case.n).contiguous()
        operands = (a, b.transpose(1, 2), scale_a, scale_b)
        peer = functools.partial(torch._scaled_grouped_mm, *operands, offs=ends, out_dtype=torch.bfloat16)
    return {"a": a, "b": b, "sa": sa, "sb": sb, "offs": offs, "ends": ends, "peer": peer}


def bf16_rows(case: Case, limit: int = 0) -> list[dict]:
    """Every ``Sm90Tiles`` candidate of the bf16 forward kernel next to ``torch._grouped_mm``."""
    from primus_turbo.triton.grouped_gemm.grouped_gemm_sm90 import grouped_gemm_sm90

    offs, ends = offsets(group_lens(case, "cuda"))
    a = torch.randn(case.groups * case.tokens, case.k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(case.groups, case.n, case.k, device="cuda", dtype=torch.bfloat16) * case.k**-0.5
    peer = functools.partial(torch._grouped_mm, a, b.transpose(1, 2), offs=ends)

    def launch(tiles, out) -> bool:
        return grouped_gemm_sm90(a, b, offs, True, out, tiles)

    return _sweep(case, "bf16", _tiles(), launch, peer, peer(), limit)


def wgrad_rows(case: Case, limit: int = 0) -> list[dict]:
    """Every ``Sm90Tiles`` candidate of the bf16 variable-K kernel next to ``torch._grouped_mm``: the
    weight gradient [G, N, K] of the case's forward."""
    from primus_turbo.triton.grouped_gemm.grouped_gemm_sm90 import grouped_gemm_variable_k_sm90

    offs, ends = offsets(group_lens(case, "cuda"))
    tokens = case.groups * case.tokens
    grad = torch.randn(tokens, case.n, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(tokens, case.k, device="cuda", dtype=torch.bfloat16)
    peer = functools.partial(torch._grouped_mm, grad.t(), a, offs=ends)

    def launch(tiles, out) -> bool:
        return grouped_gemm_variable_k_sm90(grad, a, offs, out, False, tiles)

    return _sweep(case, "bf16 wgrad", _tiles(), launch, peer, peer(), limit)


def fp8_rows(case: Case, limit: int = 0) -> list[dict]:
    """Every ``BlockSm90Config`` candidate of the tensorwise FP8 kernel next to ``_scaled_grouped_mm``."""
    from primus_turbo.triton.gemm.gemm_fp8_block_sm90 import BlockSm90Config
    from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_sm90 import grouped_gemm_fp8_sm90

    lens = group_lens(case, "cuda")
    p = fp8_problem(case, lens)
    a, b, sa, sb = p["a"], p["b"], p["sa"], p["sb"]
    ref = torch._grouped_mm(a.bfloat16(), b.bfloat16().transpose(1, 2), offs=p["ends"]) * sa
    ref = ref * torch.repeat_interleave(sb, lens, output_size=a.shape[0])[:, None]
    candidates = {
        f"s{stages} u{k_unroll} g{group_m}": BlockSm90Config(
            num_stages=stages, k_unroll=k_unroll, group_m=group_m
        )
        for stages, k_unroll, group_m in FP8_CANDIDATES
    }

    def launch(config, out) -> bool:
        return grouped_gemm_fp8_sm90(a, (sa, 0, 0), b, (sb, 1, 0, 0), p["offs"], out, None, config)

    return _sweep(case, "fp8", candidates, launch, p["peer"], ref.bfloat16(), limit)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", default="bf16,wgrad,fp8")
    p.add_argument("--candidates", type=int, default=0, help="time only the first N candidates (1: defaults)")
    p.add_argument("-o", "--output", default="grouped_sm90_configs.csv")
    args = p.parse_args()
    kinds = args.kernels.split(",")
    rows = []
    for case in CASES:
        if "bf16" in kinds:
            rows += bf16_rows(case, args.candidates)
        if "wgrad" in kinds:
            rows += wgrad_rows(case, args.candidates)
        if "fp8" in kinds:
            rows += fp8_rows(case, args.candidates)
        torch.cuda.empty_cache()
    write_csv(args.output, rows)
    print(tabulate(rows, headers="keys", floatfmt=".3f"))


if __name__ == "__main__":
    main()
