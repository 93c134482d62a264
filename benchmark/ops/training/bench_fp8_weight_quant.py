"""Time the 128 x 128 FP8 weight quantization that feeds a forward and its input gradient.

A weight (or a stack of expert weights) under 2-D block scaling needs two FP8 copies: one with K
contiguous for the forward and the transposed one for dgrad. ``fused`` is ``quantize_fp8_with_trans``,
which writes both from one read of each tile; ``two passes`` is the previous way, the tile kernel that
reads each tile twice (amax, then cast) followed by an FP8 transpose. Both are timed from CUDA graphs with
inputs rotated past L2, next to an elementwise copy moving the fused kernel's bytes (the bf16 weight read,
two FP8 copies written). Outputs are checked bit for bit. Needs a CUDA GPU.

Example::

    python -m benchmark.ops.training.bench_fp8_weight_quant -o fp8_weight_quant.csv
"""

from __future__ import annotations

import argparse
import functools
import logging

import torch
from tabulate import tabulate

from benchmark.ops.training.bench_utils import (
    copy_ms,
    cycling,
    platform_name,
    rotation_sets,
    time_interleaved,
    timing_stream,
    write_csv,
)
from benchmark.ops.training.config import DENSE_MODELS, MOE_MODELS

LOG = logging.getLogger("bench_fp8_weight_quant")
BLOCK = 128
_FP8 = torch.float8_e4m3fn


def weight_stacks() -> list[tuple[str, str, tuple[int, int, int]]]:
    """(model, weight, (G, N, K)): the experts of the Megatron MoE GPT benchmark (16 x ffn 1408, hidden
    2048), DeepSeek-V3 and Qwen3-30B-A3B at EP 8, and Llama-3-70B's dense gate+up and down."""
    stacks = [
        ("Megatron MoE GPT", "fc1", (16, 2 * 1408, 2048)),
        ("Megatron MoE GPT", "fc2", (16, 2048, 1408)),
    ]
    for name in ("DeepSeek-V3", "Qwen3-30B-A3B"):
        moe = MOE_MODELS[name]
        local = moe.num_experts // 8
        stacks.append((name, "fc1", (local, 2 * moe.moe_intermediate, moe.hidden)))
        stacks.append((name, "fc2", (local, moe.hidden, moe.moe_intermediate)))
    llama = DENSE_MODELS["Llama-3-70B"]
    stacks.append(("Llama-3-70B", "gate+up", (1, 2 * llama.intermediate, llama.hidden)))
    stacks.append(("Llama-3-70B", "down", (1, llama.hidden, llama.intermediate)))
    return stacks


def _fused(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    from primus_turbo.pytorch.core.low_precision import ScalingGranularity, ScalingRecipe
    from primus_turbo.pytorch.ops import quantize_fp8_with_trans

    recipe = ScalingRecipe(use_2d_block=True)
    return quantize_fp8_with_trans(
        w, _FP8, ScalingGranularity.BLOCKWISE, block_size=BLOCK, scaling_recipe=recipe
    )


def _two_passes(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    from primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_fp8_impl import transpose_last_two_impl
    from primus_turbo.triton.quantization import quantize_fp8_groups_triton

    g, n, k = w.shape
    q = torch.empty(w.shape, dtype=_FP8, device=w.device)
    scale = torch.empty((g * n // BLOCK, k // BLOCK), dtype=torch.float32, device=w.device)
    quantize_fp8_groups_triton(w.view(g * n, k), q.view(g * n, k), scale, BLOCK, BLOCK)
    return q, scale.view(g, n // BLOCK, k // BLOCK), transpose_last_two_impl(q)


def _same_bits(fused: tuple[torch.Tensor, ...], two: tuple[torch.Tensor, ...]) -> bool:
    q, scale, q_t, _ = fused
    return (
        torch.equal(q.view(torch.uint8), two[0].view(torch.uint8))
        and torch.equal(scale.view(torch.int32), two[1].view(torch.int32))
        and torch.equal(q_t.view(torch.uint8), two[2].view(torch.uint8))
    )


def rows_for(model: str, weight: str, shape: tuple[int, int, int]) -> dict:
    """Both ways of one weight stack, timed together against a same-size copy."""
    numel = shape[0] * shape[1] * shape[2]
    nbytes = 4 * numel  # bf16 read, two FP8 copies written
    weights = [
        torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 0.02
        for _ in range(rotation_sets(nbytes, True))
    ]
    same = _same_bits(_fused(weights[0]), _two_passes(weights[0]))
    calls = [cycling([functools.partial(fn, w) for w in weights]) for fn in (_fused, _two_passes)]
    with timing_stream(True):
        fused_ms, two_ms = time_interleaved(calls, None, "cuda", True)
    copy = copy_ms(nbytes, "cuda", True)
    row = {"Model": model, "Weight": weight, "G": shape[0], "N": shape[1], "K": shape[2]}
    row.update({"Fused us": fused_ms * 1e3, "Two passes us": two_ms * 1e3, "Speedup": two_ms / fused_ms})
    row.update({"Fused of copy": copy / fused_ms, "Two passes of copy": copy / two_ms, "Same bits": same})
    row["Platform"] = platform_name("cuda")
    LOG.info("%s", row)
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-o", "--output", default="fp8_weight_quant.csv")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8_weight_quant needs a GPU")
    rows = [rows_for(*stack) for stack in weight_stacks()]
    columns = ["Model", "Weight", "G", "N", "K", "Fused us", "Two passes us", "Speedup", "Fused of copy"]
    columns += ["Two passes of copy", "Same bits"]
    print(tabulate([[r[c] for c in columns] for r in rows], headers=columns, floatfmt=".2f"))
    write_csv(args.output, rows)


if __name__ == "__main__":
    main()
