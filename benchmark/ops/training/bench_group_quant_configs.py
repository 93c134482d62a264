"""Time launch choices of the grouped FP8 wgrad-operand quantizers against a same-size copy.

A tuning aid, like ``bench_norm_act_configs``: ``quantize_fp8_group_columns_triton`` (the row-wise
recipe) and ``quantize_fp8_group_blocks_triton`` (the block recipe) read x [T, C] bf16 and write its
token-major FP8 copy, at least 3 * T * C bytes; each candidate runs through the launcher's ``launch``
override (``None`` is its own choice), interleaved with CUDA events (L2 flushed) next to an elementwise
copy moving those bytes. Every candidate's output is checked bit for bit against the default's.

Example::

    python -m benchmark.ops.training.bench_group_quant_configs -o group_quant_configs.csv
"""

from __future__ import annotations

import argparse
import functools

import torch
from tabulate import tabulate

from benchmark.ops.training.bench_utils import copy_ms, platform_name, time_interleaved, write_csv

# (columns per program, rows per step, warps)
COLUMN_CANDIDATES = [None, (128, 64, 8), (16, 128, 4), (16, 256, 4), (32, 128, 8), (16, 64, 2)]
# (columns per program, warps)
BLOCK_CANDIDATES = [None, (128, 8), (64, 4), (16, 4), (32, 8), (32, 2)]
# groups x tokens per group, columns: DeepSeek-V3 and Qwen3-30B-A3B experts at EP 8
SHAPES = [(32, 2048, 7168), (32, 2048, 4096), (16, 2048, 2048), (16, 2048, 768)]
TINY = [(3, 40, 256)]


def _rows(groups: int, tokens: int, cols: int, device: str) -> list[dict]:
    from primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_fp8_impl import (
        group_block_count,
        group_block_layout,
    )
    from primus_turbo.triton.grouped_gemm import (
        quantize_fp8_group_blocks_triton,
        quantize_fp8_group_columns_triton,
    )

    total = groups * tokens
    x = torch.randn(total, cols, device=device, dtype=torch.bfloat16)
    lens = torch.full((groups,), tokens, device=device, dtype=torch.int64)
    offs = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
    block_ends = group_block_layout(offs, 128)[0]
    count = group_block_count(total, groups, 128)
    e4m3 = torch.float8_e4m3fn
    ops = {
        "group columns": (
            COLUMN_CANDIDATES,
            lambda c: functools.partial(quantize_fp8_group_columns_triton, x, offs, e4m3, c),
        ),
        "group blocks": (
            BLOCK_CANDIDATES,
            lambda c: functools.partial(
                quantize_fp8_group_blocks_triton, x, offs, block_ends, e4m3, 128, count, c
            ),
        ),
    }
    nbytes = 3 * total * cols
    copy = copy_ms(nbytes, device, False)
    rows = []
    for op, (candidates, call) in ops.items():
        reference = call(None)()
        same = []
        for c in candidates:
            q, scale = call(c)()
            same.append(
                torch.equal(q.view(torch.uint8), reference[0].view(torch.uint8))
                and torch.equal(scale, reference[1])
            )
        times = time_interleaved([call(c) for c in candidates], None, device)
        for c, ms, ok in zip(candidates, times, same, strict=True):
            rows.append(
                {
                    "Op": op,
                    "Tokens": total,
                    "Columns": cols,
                    "Groups": groups,
                    "Launch": "default" if c is None else "x".join(map(str, c)),
                    "ms": ms,
                    "GB/s": nbytes / ms / 1e6,
                    "vs copy": copy / ms,
                    "Same output": ok,
                    "Platform": platform_name(device),
                }
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("-o", "--output", default="group_quant_configs.csv")
    args = p.parse_args()
    rows = []
    for groups, tokens, cols in TINY if args.device == "cpu" else SHAPES:
        rows += _rows(groups, tokens, cols, args.device)
    write_csv(args.output, rows)
    print(tabulate(rows, headers="keys", floatfmt=".3f"))


if __name__ == "__main__":
    main()
