"""Time the optimizer step of FP8 primary weights: one fused kernel per weight (AdamW on the fp32 master,
the bf16 weight, both FP8 layouts and their scales) against what a mixed-precision step does without it:
``torch.optim.AdamW(fused=True)`` on the fp32 master, the copy into the bf16 weight, and the FP8
quantization of both layouts the next forward would run (one read, ``quantize_fp8_weight`` /
``quantize_fp8_experts``).

Expert stacks [G, N, K] are G parameters (Megatron's per-expert weights) stepped by one kernel, as
``FusedAdamW`` steps a layer's experts; gradients are fp32 (Megatron's ``main_grad``). Time per step from
CUDA events with an L2 flush, next to a copy moving the bytes the fused step must move (32 bytes per
parameter).

    python -m benchmark.ops.training.bench_adamw_fp8 -o adamw_fp8.csv
"""

from __future__ import annotations

import argparse

import torch
from tabulate import tabulate

from benchmark.ops.training.bench_fp8_weight_quant import WEIGHTS
from benchmark.ops.training.bench_utils import copy_ms, platform_name, time_interleaved, write_csv

HYPER = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
# master, grad, moments read; master, moments, bf16 weight, two FP8 copies written
BYTES_PER_PARAM = 4 * 4 + 4 * 3 + 2 + 2


def _config(granularity: str):
    from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, ScalingGranularity

    if granularity == "tensorwise":
        return Float8QuantConfig()
    return Float8QuantConfig(granularity=ScalingGranularity.BLOCKWISE, block_size=128)


def _sides(granularity: str, experts: int, n: int, k: int):
    """(fused step, unfused step) over the same kind of state, each its own copy."""
    from primus_turbo.pytorch.ops import (
        Fp8PrimaryWeight,
        adamw_fp8_step_,
        quantize_fp8_experts,
        quantize_fp8_weight,
    )

    config = _config(granularity)
    master = torch.randn(experts, n, k, device="cuda").mul_(k**-0.5)
    grad = torch.randn(experts, n, k, device="cuda").mul_(1e-3)
    weights = list(master.to(torch.bfloat16).unbind())
    Fp8PrimaryWeight(weights, config, experts=experts > 1)
    # as FusedAdamW lays out a layer's experts' state: slices of one allocation, so one kernel steps them
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    state = [list(t.unbind()) for t in (grad, exp_avg, exp_avg_sq, master)]
    step = [0]

    def fused():
        step[0] += 1
        adamw_fp8_step_(weights, *state[:3], step=step[0], masters=state[3], **HYPER)

    peer_master = torch.nn.Parameter(master.clone())
    peer_master.grad = grad.clone()
    peer_weight = master.to(torch.bfloat16)
    opt = torch.optim.AdamW([peer_master], fused=True, **HYPER)

    def unfused():
        opt.step()
        peer_weight.copy_(peer_master.detach())
        if experts > 1:
            return quantize_fp8_experts(peer_weight, config, trans_b=True)
        return quantize_fp8_weight(peer_weight[0], config)

    return fused, unfused


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-o", "--output", default="adamw_fp8.csv")
    args = parser.parse_args()
    rows = []
    for model, name, experts, n, k in WEIGHTS:
        params = experts * n * k
        copy = copy_ms(params * BYTES_PER_PARAM, "cuda", graph=False)
        for granularity in ("tensorwise", "blockwise"):
            fused, unfused = _sides(granularity, experts, n, k)
            fused_ms, unfused_ms = time_interleaved([fused, unfused])
            rows.append(
                dict(
                    model=model,
                    weight=name,
                    shape=f"{experts}x{n}x{k}",
                    scaling=granularity,
                    fused_ms=round(fused_ms, 3),
                    adamw_copy_quant_ms=round(unfused_ms, 3),
                    speedup=round(unfused_ms / fused_ms, 2),
                    copy_ms=round(copy, 3),
                    of_copy=round(copy / fused_ms, 2),
                )
            )
            del fused, unfused
            torch.cuda.empty_cache()
    print(platform_name("cuda"))
    print(tabulate(rows, headers="keys"))
    write_csv(args.output, rows)


if __name__ == "__main__":
    main()
