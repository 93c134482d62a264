"""Time the per-step quantization of FP8 weights: both layouts (the forward's copy and the input
gradient's, transposed) from one read of each tile, against quantizing and then transposing the FP8
copy (two kernels, the path before), for real models' expert and dense weights.

Expert stacks [G, N, K] with one scale per expert (``tensorwise``, ``quantize_fp8_experts``) or
128 x 128 blocks (``blockwise``); outputs are checked bit for bit. Time per call from CUDA events with
an L2 flush, next to a copy moving the same bytes (bf16 read once, both FP8 copies written).

    python -m benchmark.ops.training.bench_fp8_weight_quant -o fp8_weight_quant.csv
"""

from __future__ import annotations

import argparse

import torch
from tabulate import tabulate

from benchmark.ops.training.bench_utils import copy_ms, platform_name, time_interleaved, write_csv

# (model, weight, experts on one GPU, N, K): Mixtral-8x7B and Qwen3-235B-A22B experts (EP 1 and 8),
# DeepSeek-V3 experts at EP 8, Llama-3-70B's gate+up as one dense weight
WEIGHTS = [
    ("Mixtral-8x7B", "fc1", 8, 28672, 4096),
    ("Mixtral-8x7B", "fc2", 8, 4096, 14336),
    ("DeepSeek-V3", "fc1", 32, 4096, 7168),
    ("DeepSeek-V3", "fc2", 32, 7168, 2048),
    ("Qwen3-235B-A22B", "fc1", 16, 3072, 4096),
    ("Llama-3-70B", "gate+up", 1, 57344, 8192),
]
_FP8 = torch.float8_e4m3fn


def _sides(granularity: str, w: torch.Tensor):
    """(one-read callable, two-kernel callable) returning (q, q_t, scale) each."""
    from primus_turbo.pytorch.core.low_precision import ScalingGranularity, ScalingRecipe
    from primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_fp8_impl import (
        quantize_fp8_experts_tensorwise_impl,
    )
    from primus_turbo.pytorch.kernels.quantization.quantization_impl import quantize_fp8_impl
    from primus_turbo.pytorch.ops import quantize_fp8_with_trans
    from primus_turbo.triton.utils.transpose import transpose_triton

    g = ScalingGranularity
    if granularity == "tensorwise":

        def fused():
            return quantize_fp8_experts_tensorwise_impl(w, _FP8)

        def two_kernels():
            q, scale = quantize_fp8_impl(w.reshape(w.shape[0], -1), _FP8, g.ROWWISE.value, 0, 1, False)
            q = q.view(w.shape)
            return q, transpose_triton(q), scale.view(-1, 1, 1)

        return fused, two_kernels

    def fused():
        q, scale, q_t, _ = quantize_fp8_with_trans(
            w, _FP8, g.BLOCKWISE, block_size=128, scaling_recipe=ScalingRecipe(use_2d_block=True)
        )
        return q, q_t, scale

    def two_kernels():
        flat = w.reshape(-1, w.shape[-1])
        q, scale = quantize_fp8_impl(flat, _FP8, g.BLOCKWISE.value, 128, 1, True)
        q = q.view(w.shape)
        return q, transpose_triton(q), scale.view(w.shape[0], w.shape[1] // 128, -1)

    return fused, two_kernels


def _same_bits(a, b) -> bool:
    views = [torch.int32 if t.dtype == torch.float32 else torch.uint8 for t in a]
    return all(torch.equal(x.view(v), y.view(v)) for x, y, v in zip(a, b, views, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-o", "--output", default="fp8_weight_quant.csv")
    args = parser.parse_args()
    rows = []
    for model, name, experts, n, k in WEIGHTS:
        w = torch.randn(experts, n, k, dtype=torch.bfloat16, device="cuda").mul_(k**-0.5)
        copy = copy_ms(w.numel() * 4, "cuda", graph=False)  # 2 bytes read, 2 written per element
        for granularity in ("tensorwise", "blockwise"):
            fused, two = _sides(granularity, w)
            assert _same_bits(fused(), two()), f"{model} {name} {granularity}: outputs differ"
            fused_ms, two_ms = time_interleaved([fused, two])
            rows.append(
                dict(
                    model=model,
                    weight=name,
                    shape=f"{experts}x{n}x{k}",
                    scaling=granularity,
                    one_read_ms=round(fused_ms, 3),
                    two_kernels_ms=round(two_ms, 3),
                    speedup=round(two_ms / fused_ms, 2),
                    copy_ms=round(copy, 3),
                    of_copy=round(copy / fused_ms, 2),
                )
            )
        del w
    print(platform_name("cuda"))
    print(tabulate(rows, headers="keys"))
    write_csv(args.output, rows)


if __name__ == "__main__":
    main()
