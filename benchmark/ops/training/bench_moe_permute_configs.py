"""Launch candidates of the permutation's row scatter, device time from CUDA-graph replays.

Per MoE model at ``--tokens`` (random top-k routing, bf16 tokens): each ``ScatterLaunch`` candidate of
``scatter_rows_triton`` (the forward of ``moe_permute`` with a fixed row count) next to two references
on the same bytes: ``index_select`` with the source rows precomputed (the gather alone) and a plain
copy of the permuted rows. Effective bandwidth counts T x H read and T x K x H written (the copy: T x K x H
both ways).

Example::

    python -m benchmark.ops.training.bench_moe_permute_configs --tokens 4096 -o permute_configs.csv
"""

from __future__ import annotations

import argparse
import functools
import logging

import torch
from tabulate import tabulate

from benchmark.ops.training.bench_utils import platform_name, time_interleaved, timing_stream, write_csv
from benchmark.ops.training.config import MOE_MODELS

LOG = logging.getLogger("bench_moe_permute_configs")


def candidates(hidden: int) -> list:
    """The default launch first, then block sizes x warps x (fused or split gap programs) x
    (slice or whole-row programs)."""
    from primus_turbo.triton.moe.permute_kernel import ScatterLaunch, scatter_launch

    found = [scatter_launch(hidden)]
    for block_h in (1024, 2048, 4096):
        for warps in (4, 8):
            for split in (False, True):
                for all_cols in (False, True):
                    launch = ScatterLaunch(block_h, warps, split, all_cols)
                    if launch not in found:
                        found.append(launch)
    return found


def main(argv: list[str] | None = None) -> None:
    """Time every candidate per model, print the table and write the CSV."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="4096")
    p.add_argument("--models", default="DeepSeek-V3")
    p.add_argument("-o", "--output", default="bench_moe_permute_configs.csv")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    from primus_turbo.pytorch.kernels.moe.permute_impl import moe_expert_layout_impl
    from primus_turbo.triton.moe.permute_kernel import scatter_rows_triton

    rows = []
    for name in args.models.split(","):
        model = MOE_MODELS[name]
        for tokens in (int(t) for t in args.tokens.split(",")):
            experts, topk, hidden = model.num_experts, model.topk, model.hidden
            top = torch.rand(tokens, experts, device="cuda").topk(topk, dim=-1).indices
            routing_map = torch.zeros(tokens, experts, dtype=torch.bool, device="cuda").scatter(1, top, True)
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            num_rows = tokens * topk
            row_id_map, counts, start = moe_expert_layout_impl(routing_map, 0, num_rows)
            order = routing_map.t().contiguous().nonzero()[:, 1]
            reference = x.index_select(0, order)
            permuted = torch.empty_like(reference)
            launches = candidates(hidden)
            scatter = functools.partial(
                scatter_rows_triton, x, row_id_map, start, counts, None, num_rows, False
            )
            calls = [functools.partial(scatter, launch=launch) for launch in launches]
            for launch, call in zip(launches, calls, strict=True):
                if not torch.equal(call()[0], reference):
                    raise AssertionError(f"{launch} permutes wrongly")
            calls.append(functools.partial(torch.index_select, x, 0, order))
            calls.append(functools.partial(permuted.copy_, reference))
            labels = [str(tuple(launch)) for launch in launches] + ["index_select (rows given)", "copy"]
            with timing_stream(True):
                times = time_interleaved(calls, None, "cuda", graph=True)
            moved = (tokens + num_rows) * hidden * x.element_size()
            for i, (label, ms) in enumerate(zip(labels, times, strict=True)):
                if label == "copy":
                    moved = 2 * num_rows * hidden * x.element_size()
                row = {"Model": name, "Tokens": tokens, "Launch (block_h, warps, split, all_cols)": label}
                row["Default"] = i == 0
                row["us"] = ms * 1e3
                row["TB/s"] = moved / ms / 1e9
                row["Platform"] = platform_name("cuda")
                rows.append(row)
                LOG.info("%s", row)
    columns = ["Model", "Tokens", "Launch (block_h, warps, split, all_cols)", "Default", "us", "TB/s"]
    print(tabulate([[r[c] for c in columns] for r in rows], headers=columns, floatfmt=".3f"))
    write_csv(args.output, rows)


if __name__ == "__main__":
    main()
