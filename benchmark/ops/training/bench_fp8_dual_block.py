"""Time the two implementations of the dual 1 x 128 FP8 emit against a same-size copy.

Both 1 x 128 copies of a producer's output (along K, and along M stored transposed) come either from the
Triton tile kernels or from the C++/CUDA kernel ``fp8_dual_block_emit``. This times both for each
producer: a plain quantization (``quantize_fp8_with_trans``), RMSNorm (the Triton rstd pass included on
both sides) and SwiGLU, from CUDA graphs with inputs rotated past L2, next to an elementwise copy moving
the same bytes (input read, two FP8 copies written). Outputs are checked bit for bit. Needs a CUDA GPU and
the C++ extension. A tuning aid, like ``bench_norm_act_configs``.

Example::

    python -m benchmark.ops.training.bench_fp8_dual_block --tokens 4096,16384 -o fp8_dual_block.csv
"""

from __future__ import annotations

import argparse
import functools
import logging
from collections.abc import Callable

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

LOG = logging.getLogger("bench_fp8_dual_block")

HIDDEN = (4096, 7168, 8192)  # quantization and RMSNorm: Llama-3-8B, DeepSeek-V3, Qwen2.5-72B
WIDTH = (1536, 2048, 3584)  # SwiGLU: Qwen3-235B and DeepSeek-V3 experts, Llama-3-8B / TP 4
_FP8 = torch.float8_e4m3fn


def _buffers(rows: int, cols: int) -> tuple[torch.Tensor, ...]:
    """q, scale, q_t, scale_t as quantize_fp8_with_trans lays them out (block-major scales)."""
    from primus_turbo.pytorch.core.low_precision import ScalingGranularity
    from primus_turbo.pytorch.kernels.quantization.quantization_impl import fp8_producer_empty

    blockwise = ScalingGranularity.BLOCKWISE.value
    return fp8_producer_empty(torch.Size((rows, cols)), _FP8, blockwise, 128, True, torch.device("cuda"))


def _same_bits(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    views = [(torch.int32 if t.dtype == torch.float32 else torch.uint8) for t in a]
    return all(torch.equal(x.view(v), y.view(v)) for x, y, v in zip(a, b, views, strict=True))


def _sides(producer: str, x: torch.Tensor, gamma: torch.Tensor, out: tuple, other: tuple) -> list[Callable]:
    """[Triton, C++] callables writing the producer's two copies of ``x`` into ``out`` / ``other``."""
    from primus_turbo.triton.activation import SILU, gated_act_fp8_triton
    from primus_turbo.triton.normalization import rmsnorm_fp8_triton, rmsnorm_rstd_triton
    from primus_turbo.triton.quantization import EMIT_BLOCK, quantize_fp8_dual_blocks_triton

    op = torch.ops.primus_turbo_cpp_extension.fp8_dual_block_emit
    if producer == "quantize":
        return [
            functools.partial(quantize_fp8_dual_blocks_triton, x, *out, 128, None),
            functools.partial(op, x, None, None, None, None, 0, 0, False, *other),
        ]
    if producer == "rmsnorm":

        def cuda_rmsnorm() -> None:
            rstd = rmsnorm_rstd_triton(x, gamma, 1e-6, False)
            op(x, gamma, rstd, None, None, 2, 0, False, *other)

        return [
            functools.partial(rmsnorm_fp8_triton, x, gamma, 1e-6, False, EMIT_BLOCK, *out, 128),
            cuda_rmsnorm,
        ]
    return [
        functools.partial(gated_act_fp8_triton, x, None, None, SILU, EMIT_BLOCK, *out, 128),
        functools.partial(op, x, None, None, None, None, 1, SILU, False, *other),
    ]


def rows_for(producer: str, tokens: int, hidden: int) -> list[dict]:
    """The Triton and C++ emitters of one producer and shape, timed together against a same-size copy."""
    width = 2 * hidden if producer == "swiglu" else hidden
    nbytes = tokens * (width * 2 + 2 * hidden)
    gamma = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    sets = []
    for _ in range(rotation_sets(nbytes, True)):
        x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
        sets.append((x, _buffers(tokens, hidden), _buffers(tokens, hidden)))
    sides = [_sides(producer, x, gamma, out, other) for x, out, other in sets]
    for fn in sides[0]:
        fn()
    same = _same_bits(sets[0][1], sets[0][2])
    calls = [cycling([s[i] for s in sides]) for i in range(2)]
    with timing_stream(True):
        triton_ms, cuda_ms = time_interleaved(calls, None, "cuda", True)
    copy = copy_ms(nbytes, "cuda", True)
    row = {"Producer": producer, "Tokens": tokens, "Hidden": hidden, "Triton us": triton_ms * 1e3}
    row.update({"C++ us": cuda_ms * 1e3, "Triton of copy": copy / triton_ms, "C++ of copy": copy / cuda_ms})
    row.update({"C++ vs Triton": triton_ms / cuda_ms, "Same bits": same, "Platform": platform_name("cuda")})
    LOG.info("%s", row)
    return [row]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="4096,16384", help="comma-separated token counts")
    p.add_argument("-o", "--output", default="fp8_dual_block.csv")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if not torch.cuda.is_available() or torch.version.hip is not None:
        raise SystemExit("bench_fp8_dual_block needs a CUDA GPU")
    import primus_turbo._C  # noqa: F401  (registers torch.ops.primus_turbo_cpp_extension)

    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for producer, sizes in (("quantize", HIDDEN), ("rmsnorm", HIDDEN), ("swiglu", WIDTH)):
            for hidden in sizes:
                rows += rows_for(producer, tokens, hidden)
    columns = ["Producer", "Tokens", "Hidden", "Triton us", "C++ us", "Triton of copy", "C++ of copy"]
    columns += ["C++ vs Triton", "Same bits"]
    print(tabulate([[r[c] for c in columns] for r in rows], headers=columns, floatfmt=".2f"))
    write_csv(args.output, rows)


if __name__ == "__main__":
    main()
