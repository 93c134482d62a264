"""Loop references for MoE permutation: expert-major rows in token order, zero padding per expert."""

from __future__ import annotations

import torch


def permute_ref(tokens: torch.Tensor, routing_map: torch.Tensor, pad_multiple: int = 0) -> torch.Tensor:
    """[N, H]: expert 0's tokens in token order, zero rows up to a multiple of ``pad_multiple``, then
    expert 1's, and so on."""
    blocks = []
    for e in range(routing_map.shape[1]):
        rows = tokens[routing_map[:, e].nonzero().flatten()]
        if pad_multiple > 1 and rows.shape[0] % pad_multiple:
            rows = torch.cat(
                [rows, rows.new_zeros(pad_multiple - rows.shape[0] % pad_multiple, rows.shape[1])]
            )
        blocks.append(rows)
    return torch.cat(blocks)


def unpermute_ref(
    permuted: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor | None, pad_multiple: int = 0
) -> torch.Tensor:
    """[T, H]: each token's rows of the ``permute_ref`` layout, weighted by ``probs`` [T, E] and summed."""
    tokens, experts = routing_map.shape
    out = [permuted.new_zeros(permuted.shape[1]) for _ in range(tokens)]
    row = 0
    for e in range(experts):
        for t in routing_map[:, e].nonzero().flatten().tolist():
            out[t] = out[t] + permuted[row] * (probs[t, e] if probs is not None else 1.0)
            row += 1
        count = int(routing_map[:, e].sum())
        if pad_multiple > 1 and count % pad_multiple:
            row += pad_multiple - count % pad_multiple
    return torch.stack(out)


def permuted_probs_ref(probs: torch.Tensor, routing_map: torch.Tensor, pad_multiple: int = 0) -> torch.Tensor:
    """[N]: each permuted row's route probability ``probs[t, e]`` (0 for padding), in ``permute_ref``'s
    row order."""
    columns = [probs[routing_map[:, e], e][:, None] for e in range(routing_map.shape[1])]
    per_expert = [permute_ref(c, torch.ones(c.shape[0], 1, dtype=torch.bool), pad_multiple) for c in columns]
    return torch.cat(per_expert)[:, 0]
