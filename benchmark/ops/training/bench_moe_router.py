"""MoE router forward + backward against the unfused PyTorch router, eager and compiled.

Per MoE model of the config (experts, top-k; DeepSeek-V3 also with its 8 groups / 4 selected groups,
sigmoid scores and expert bias) at ``--tokens``: time of ``fused_group_topk_routing_with_aux_score``
forward and forward + backward (gradients from probs and from the aux scores) next to the same routing
in plain PyTorch ops (``router_fwd_reference``) run eagerly and under ``torch.compile``, all interleaved call
by call (``time_interleaved``).

Example::

    python -m benchmark.ops.training.bench_moe_router --tokens 4096,16384 -o router.csv
"""

from __future__ import annotations

import argparse
import functools
import logging

import torch
import torch._dynamo.config
import torch._functorch.config
from tabulate import tabulate

from benchmark.ops.training.bench_utils import (
    graph_timer,
    platform_name,
    time_interleaved,
    timing_stream,
    write_csv,
)
from benchmark.ops.training.config import MOE_MODELS

LOG = logging.getLogger("bench_moe_router")


def _step(call, grads) -> None:
    """Forward, then backward from probs and the aux scores."""
    probs, _, aux = call()
    torch.autograd.backward((probs, aux), grads)


def cases():
    """(label, experts, topk, groups, selected groups, score function, scaling, with bias)."""
    for model in MOE_MODELS.values():
        yield model.name, model.num_experts, model.topk, 1, 1, "softmax", 1.0, False
    ds = MOE_MODELS["DeepSeek-V3"]
    yield "DeepSeek-V3 grouped", ds.num_experts, ds.topk, 8, 4, "sigmoid", 2.5, True


def main(argv: list[str] | None = None) -> None:
    """Time every (case, token count), print the table and write the CSV."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="4096,16384")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument(
        "--timer",
        choices=("events", "graph"),
        default="events",
        help="events: eager calls (host launch cost counts where it exceeds the device time); "
        "graph: CUDA-graph replays (device time only)",
    )
    p.add_argument("-o", "--output", default="bench_moe_router.csv")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    torch._functorch.config.donated_buffer = False
    torch._dynamo.config.recompile_limit = 256
    from primus_turbo.pytorch.kernels.moe.router_impl import router_fwd_reference
    from primus_turbo.pytorch.ops import fused_group_topk_routing_with_aux_score

    rows = []
    for label, experts, topk, groups, selected, function, scaling, with_bias in cases():
        for tokens in (int(t) for t in args.tokens.split(",")):
            logits = torch.randn(tokens, experts, device=args.device, requires_grad=True)
            bias = torch.randn(experts, device=args.device) * 0.1 if with_bias else None
            options = (topk, groups, selected, function, scaling, bias)
            # the peer: the same routing written in plain PyTorch ops (the library's reference path)
            plain = (bias, topk, groups, selected, function == "softmax", scaling)
            calls = {
                "turbo": functools.partial(fused_group_topk_routing_with_aux_score, logits, *options),
                "eager": functools.partial(router_fwd_reference, logits, *plain),
                "compiled": functools.partial(torch.compile(router_fwd_reference), logits, *plain),
            }
            grads = (torch.randn_like(logits), torch.randn_like(logits))
            graph = graph_timer(args)
            try:
                with timing_stream(graph):
                    with torch.no_grad():
                        fwd = time_interleaved(list(calls.values()), None, args.device, graph)
                    steps = [functools.partial(_step, call, grads) for call in calls.values()]
                    both = time_interleaved(steps, [logits], args.device, graph)
            except RuntimeError as exc:  # e.g. a side that cannot be captured in a CUDA graph
                LOG.warning("%s, %d tokens: %s", label, tokens, str(exc).splitlines()[0][:200])
                continue
            row = {"Case": label, "Tokens": tokens, "Experts": experts, "Topk": topk, "Groups": groups}
            row["Timer"] = args.timer
            for name, f, fb in zip(calls, fwd, both, strict=True):
                row[f"{name} fwd us"], row[f"{name} fwd+bwd us"] = f * 1e3, fb * 1e3
            row["fwd+bwd vs eager"] = row["eager fwd+bwd us"] / row["turbo fwd+bwd us"]
            row["fwd+bwd vs compiled"] = row["compiled fwd+bwd us"] / row["turbo fwd+bwd us"]
            row["Platform"] = platform_name(args.device)
            rows.append(row)
            LOG.info("%s", {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
    columns = ["Case", "Tokens", "Experts", "Topk", "Groups", "turbo fwd+bwd us", "eager fwd+bwd us"]
    columns += ["compiled fwd+bwd us", "fwd+bwd vs eager", "fwd+bwd vs compiled"]
    print(tabulate([[r[c] for c in columns] for r in rows], headers=columns, floatfmt=".2f"))
    write_csv(args.output, rows)


if __name__ == "__main__":
    main()
