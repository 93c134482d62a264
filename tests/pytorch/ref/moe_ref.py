"""fp64 MoE router reference (Megatron-style group-limited top-k), differentiated by autograd."""

from __future__ import annotations

import torch


def router_ref(logits, topk, groups=1, selected_groups=1, score_function="softmax", scaling=1.0, bias=None):
    """(probs, routing_map, scores_for_aux_loss) in fp64; selection does not carry gradients."""
    x = logits.double()
    scores = torch.softmax(x, dim=-1) if score_function == "softmax" else torch.sigmoid(x)
    selection = scores.detach() + (bias.double() if bias is not None else 0.0)
    tokens, experts = x.shape
    if groups > 1:
        per_group = experts // groups
        group_scores = (
            selection.view(tokens, groups, per_group).topk(topk // selected_groups, dim=-1)[0].sum(-1)
        )
        chosen = group_scores.topk(selected_groups, dim=-1)[1]
        group_mask = torch.zeros(tokens, groups, dtype=torch.bool, device=x.device).scatter(1, chosen, True)
        selection = selection.masked_fill(~group_mask.repeat_interleave(per_group, dim=1), float("-inf"))
    top = selection.topk(topk, dim=-1)[1]
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool, device=x.device).scatter(1, top, True)
    picked = scores.gather(1, top)
    if score_function == "sigmoid" and topk > 1:
        picked = picked / (picked.sum(-1, keepdim=True) + 1e-20)
    probs = torch.zeros_like(scores).scatter(1, top, picked) * scaling
    aux = scores if score_function == "softmax" else scores / (scores.sum(-1, keepdim=True) + 1e-20)
    return probs, routing_map, aux
