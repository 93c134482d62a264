"""Time launch choices of the RMSNorm backward and the gated-activation kernels against a same-size copy.

A tuning aid, like ``bench_gemm_triton_configs`` for the GEMMs: each candidate runs through the
launcher's ``launch`` override (``None`` is the launcher's own choice), timed from CUDA graphs with
inputs rotated past L2, next to an elementwise copy moving the same bytes. Outputs of every candidate
are checked against the default's (dx bit for bit).

Example::

    python -m benchmark.ops.training.bench_norm_act_configs --tokens 4096,16384 -o norm_act_configs.csv
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

LOG = logging.getLogger("bench_norm_act_configs")

# rows per block, warps, programs per SM, pipeline stages
RMSNORM_BWD_CANDIDATES = [
    None,
    (1, 8, 1, 3),
    (2, 8, 1, 3),
    (1, 8, 1, 4),
    (1, 16, 1, 3),
    (1, 8, 2, 3),
    (1, 4, 2, 3),
    (1, 8, 1, 2),
]
# the flat forward: elements per program, warps
GATED_FWD_CANDIDATES = [None, (2048, 8), (4096, 8), (8192, 8)]
# the backward: rows per program, BLOCK_H, warps (512-wide chunks divide 1536 and 3584 exactly)
GATED_BWD_CANDIDATES = [None, (2, 2048, 8), (1, 2048, 4), (1, 1024, 4), (2, 512, 4), (4, 512, 4)]
HIDDEN = (4096, 7168, 8192)  # RMSNorm: Llama-3-8B, DeepSeek-V3, Qwen2.5-72B
WIDTH = (1536, 2048, 3584)  # activations: Qwen3-235B and DeepSeek-V3 experts, Llama-3-8B / TP 4


def _sets(make: Callable[[], tuple], nbytes: int, graph: bool) -> list[tuple]:
    """Input sets that together move at least ``ROTATION_BYTES`` per round (one without graphs)."""
    return [make() for _ in range(rotation_sets(nbytes, graph))]


def _rmsnorm_bwd_rows(tokens: int, hidden: int, device: str, graph: bool) -> list[dict]:
    from primus_turbo.triton.normalization import rmsnorm_bwd_triton

    rows = []
    gamma = torch.randn(hidden, device=device, dtype=torch.bfloat16)
    for with_ds in (False, True):
        tensors = 4 if with_ds else 3  # dy, s (, ds) read, dx written

        def make(with_ds=with_ds):
            t = [torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16) for _ in range(3)]
            return t[0], t[1], t[2] if with_ds else None, torch.rand(tokens, device=device) + 0.5

        nbytes = tensors * tokens * hidden * 2
        sets = _sets(make, nbytes, graph)
        calls = [
            cycling(
                [
                    functools.partial(rmsnorm_bwd_triton, dy, s, gamma, r, False, ds, c)
                    for dy, s, ds, r in sets
                ]
            )
            for c in RMSNORM_BWD_CANDIDATES
        ]
        dy, s, ds, r = sets[0]
        reference = rmsnorm_bwd_triton(dy, s, gamma, r, False, ds)[0]
        same = [
            torch.equal(rmsnorm_bwd_triton(dy, s, gamma, r, False, ds, c)[0], reference)
            for c in RMSNORM_BWD_CANDIDATES
        ]
        op = "rmsnorm_residual bwd" if with_ds else "rmsnorm bwd"
        rows += _timed(op, tokens, hidden, nbytes, calls, RMSNORM_BWD_CANDIDATES, same, device, graph)
    return rows


def _gated_rows(tokens: int, width: int, device: str, graph: bool) -> list[dict]:
    from primus_turbo.triton.activation.gated_act_kernel import (
        SILU,
        gated_act_bwd_triton,
        gated_act_fwd_triton,
    )

    rows = []
    for with_probs in (False, True):

        def make(with_probs=with_probs):
            x = torch.randn(tokens, 2 * width, device=device, dtype=torch.bfloat16)
            dy = torch.randn(tokens, width, device=device, dtype=torch.bfloat16)
            return x, dy, torch.rand(tokens, device=device) if with_probs else None

        name = "swiglu_with_probs" if with_probs else "swiglu"
        fwd_bytes, bwd_bytes = 3 * tokens * width * 2, 5 * tokens * width * 2
        sets = _sets(make, fwd_bytes, graph)
        x, dy, p = sets[0]
        forward = functools.partial(gated_act_fwd_triton, act=SILU)
        ref = forward(x, p, None)
        same = [torch.equal(forward(x, p, None, launch=c), ref) for c in GATED_FWD_CANDIDATES]
        calls = [
            cycling([functools.partial(forward, x, p, None, launch=c) for x, _, p in sets])
            for c in GATED_FWD_CANDIDATES
        ]
        rows += _timed(
            f"{name} fwd", tokens, width, fwd_bytes, calls, GATED_FWD_CANDIDATES, same, device, graph
        )
        ref = gated_act_bwd_triton(dy, x, p, None, SILU)[0]
        same = [
            torch.equal(gated_act_bwd_triton(dy, x, p, None, SILU, c)[0], ref) for c in GATED_BWD_CANDIDATES
        ]
        calls = [
            cycling([functools.partial(gated_act_bwd_triton, dy, x, p, None, SILU, c) for x, dy, p in sets])
            for c in GATED_BWD_CANDIDATES
        ]
        rows += _timed(
            f"{name} bwd", tokens, width, bwd_bytes, calls, GATED_BWD_CANDIDATES, same, device, graph
        )
    return rows


def _timed(op, tokens, hidden, nbytes, calls, candidates, same, device, graph) -> list[dict]:
    """One row per candidate: its time, interleaved with the others, against a same-size copy."""
    with timing_stream(graph):
        times = time_interleaved(calls, None, device, graph)
    copy = copy_ms(nbytes, device, graph) if device == "cuda" else float("nan")
    rows = []
    for candidate, ms, equal in zip(candidates, times, same, strict=True):
        row = {"Op": op, "Tokens": tokens, "Hidden": hidden, "Launch": str(candidate or "default")}
        row.update({"us": ms * 1e3, "of same-size copy": copy / ms, "Same as default": equal})
        rows.append(row)
        LOG.info("%s", row)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="4096,16384", help="comma-separated token counts")
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cpu: TRITON_INTERPRET=1 smoke run"
    )
    p.add_argument("--tiny", action="store_true", help="hidden 256 and width 128 only (smoke runs)")
    p.add_argument("-o", "--output", default="norm_act_configs.csv")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    graph = args.device == "cuda"
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for hidden in (256,) if args.tiny else HIDDEN:
            rows += _rmsnorm_bwd_rows(tokens, hidden, args.device, graph)
        for width in (128,) if args.tiny else WIDTH:
            rows += _gated_rows(tokens, width, args.device, graph)
    for row in rows:
        row["Platform"] = platform_name(args.device)
    columns = ["Op", "Tokens", "Hidden", "Launch", "us", "of same-size copy", "Same as default"]
    print(tabulate([[r[c] for c in columns] for r in rows], headers=columns, floatfmt=".2f"))
    write_csv(args.output, rows)


if __name__ == "__main__":
    main()
