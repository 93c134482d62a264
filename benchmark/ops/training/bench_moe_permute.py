"""MoE permute and unpermute against the unfused PyTorch path, effective bandwidth.

Per MoE model of the config at ``--tokens``: random top-k routing over the model's experts; times of
``moe_permute`` and ``moe_unpermute`` (forward) next to the unfused PyTorch path (permute: ``index_select``
of the tokens in expert-major order; unpermute: probability-weighted ``index_add_``), interleaved call by
call, forward alone and forward + backward (gradients of the tokens and of the probabilities). Effective
bandwidth counts the bytes each must move: permute reads T x H and writes T x K x H, unpermute reads
T x K x H and writes T x H (bf16); forward + backward counts them twice. On a GPU the library's calls are
also timed from CUDA-graph replays (device time alone, warm L2; the unfused path syncs with the host
and cannot be captured).

Example::

    python -m benchmark.ops.training.bench_moe_permute --tokens 4096 -o permute.csv
"""

from __future__ import annotations

import argparse
import functools
import logging
from collections.abc import Callable

import torch
from tabulate import tabulate

from benchmark.ops.training.bench_utils import platform_name, time_interleaved, timing_stream, write_csv
from benchmark.ops.training.config import MOE_MODELS

LOG = logging.getLogger("bench_moe_permute")


def torch_permute(tokens: torch.Tensor, routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert-major rows by ``index_select`` (the unfused path); also returns the source token per row."""
    order = routing_map.t().contiguous().nonzero()[:, 1]
    return tokens.index_select(0, order), order


def torch_unpermute(
    permuted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, tokens: int
) -> torch.Tensor:
    """Probability-weighted sum back to the tokens by ``index_add_`` (the unfused path)."""
    out = torch.zeros(tokens, permuted.shape[1], dtype=torch.float32, device=permuted.device)
    out.index_add_(0, order, permuted.float() * weights[:, None])
    return out.to(permuted.dtype)


def _first(fn: Callable[..., tuple], *args: object, **kwargs: object) -> torch.Tensor:
    return fn(*args, **kwargs)[0]


def _step(fn: Callable[[], torch.Tensor], grad: torch.Tensor) -> Callable[[], None]:
    """``fn`` forward, then backward from ``grad``."""
    return lambda: fn().backward(grad)


def main(argv: list[str] | None = None) -> None:
    """Time permute and unpermute per model, print the table and write the CSV."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="4096")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("-o", "--output", default="bench_moe_permute.csv")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    from primus_turbo.pytorch.ops import moe_permute, moe_unpermute

    rows = []
    for model in MOE_MODELS.values():
        for tokens in (int(t) for t in args.tokens.split(",")):
            experts, topk, hidden = model.num_experts, model.topk, model.hidden
            scores = torch.rand(tokens, experts, device=args.device)
            top = scores.topk(topk, dim=-1).indices
            routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top, True)
            probs = torch.rand(tokens, experts, device=args.device) * routing_map
            x = torch.randn(tokens, hidden, device=args.device, dtype=torch.bfloat16)
            permuted, row_id_map, _, _, _ = moe_permute(x, routing_map, num_local_experts=experts)
            reference, order = torch_permute(x, routing_map)
            weights = probs.t()[routing_map.t()]
            merged = moe_unpermute(permuted, row_id_map, probs).float()
            merged_ref = torch_unpermute(reference, order, weights, tokens).float()
            same = torch.equal(permuted, reference)
            same = same and torch.allclose(merged, merged_ref, rtol=1e-2, atol=1e-2)
            check = "PASS" if same else "FAIL"
            turbo_permute = functools.partial(
                moe_permute, x, routing_map, num_local_experts=experts, num_permuted_tokens=tokens * topk
            )
            x_leaf = x.clone().requires_grad_()
            grad_rows = torch.randn_like(permuted)
            grad_tokens = torch.randn_like(x)
            rows_leaf = permuted.clone().requires_grad_()
            probs_leaf, weights_leaf = probs.clone().requires_grad_(), weights.clone().requires_grad_()

            forward = [
                turbo_permute,
                functools.partial(torch_permute, x, routing_map),
                functools.partial(moe_unpermute, permuted, row_id_map, probs),
                functools.partial(torch_unpermute, reference, order, weights, tokens),
            ]
            with torch.no_grad():
                times = time_interleaved(forward, None, args.device)
            leaves = [x_leaf, rows_leaf, probs_leaf, weights_leaf]
            steps = [
                _step(
                    functools.partial(
                        _first, moe_permute, x_leaf, routing_map,
                        num_local_experts=experts, num_permuted_tokens=tokens * topk,
                    ),
                    grad_rows,
                ),
                _step(functools.partial(_first, torch_permute, x_leaf, routing_map), grad_rows),
                _step(functools.partial(moe_unpermute, rows_leaf, row_id_map, probs_leaf), grad_tokens),
                _step(
                    functools.partial(torch_unpermute, rows_leaf, order, weights_leaf, tokens), grad_tokens
                ),
            ]  # fmt: skip
            step_times = time_interleaved(steps, leaves, args.device)
            moved = (tokens + tokens * topk) * hidden * x.element_size()
            row = {"Model": model.name, "Tokens": tokens, "Hidden": hidden, "Experts": experts, "Topk": topk}
            row["Check"] = check
            names = ("permute", "torch permute", "unpermute", "torch unpermute")
            for name, ms, step_ms in zip(names, times, step_times, strict=True):
                row[f"{name} us"] = ms * 1e3
                row[f"{name} TB/s"] = moved / ms / 1e9
                row[f"{name} fwd+bwd us"] = step_ms * 1e3
                row[f"{name} fwd+bwd TB/s"] = 2 * moved / step_ms / 1e9
            if args.device == "cuda":
                # device time alone: the unfused path syncs with the host and cannot be captured
                with timing_stream(True):
                    with torch.no_grad():
                        graph_fwd = time_interleaved([forward[0], forward[2]], None, "cuda", graph=True)
                    graph_step = time_interleaved([steps[0], steps[2]], leaves, "cuda", graph=True)
                for i, name in enumerate(("permute", "unpermute")):
                    row[f"{name} graph us"] = graph_fwd[i] * 1e3
                    row[f"{name} graph TB/s"] = moved / graph_fwd[i] / 1e9
                    row[f"{name} fwd+bwd graph us"] = graph_step[i] * 1e3
                    row[f"{name} fwd+bwd graph TB/s"] = 2 * moved / graph_step[i] / 1e9
            row["permute vs torch"] = times[1] / times[0]
            row["unpermute vs torch"] = times[3] / times[2]
            row["permute fwd+bwd vs torch"] = step_times[1] / step_times[0]
            row["unpermute fwd+bwd vs torch"] = step_times[3] / step_times[2]
            row["Platform"] = platform_name(args.device)
            rows.append(row)
            LOG.info("%s", {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
    columns = ["Model", "Tokens", "Check", "permute TB/s", "torch permute TB/s", "unpermute TB/s"]
    columns += ["torch unpermute TB/s", "permute vs torch", "unpermute vs torch"]
    columns += ["permute fwd+bwd TB/s", "unpermute fwd+bwd TB/s", "permute fwd+bwd vs torch"]
    columns += ["unpermute fwd+bwd vs torch"]
    if args.device == "cuda":
        columns += ["permute graph TB/s", "unpermute graph TB/s"]
        columns += ["permute fwd+bwd graph TB/s", "unpermute fwd+bwd graph TB/s"]
    print(tabulate([[r[c] for c in columns] for r in rows], headers=columns, floatfmt=".3f"))
    write_csv(args.output, rows)


if __name__ == "__main__":
    main()
