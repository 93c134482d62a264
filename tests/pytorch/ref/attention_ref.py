"""fp64 attention reference: masked softmax with an optional sink column, differentiated by autograd."""

from __future__ import annotations

import torch


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, Sq, Hq, Dv] in fp64 from logical [B, S, H, D] inputs (GQA by repeating key/value heads).

    Query i sees key j when i + Sk - Sq - left <= j <= i + Sk - Sq + right (causal: right = 0); a query
    that sees nothing outputs zeros.
    """
    s_q, s_k = q.shape[1], k.shape[1]
    group = q.shape[2] // k.shape[2]
    qh = q.double().permute(0, 2, 1, 3)
    kh = k.double().permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    vh = v.double().permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    scores = qh @ kh.transpose(-1, -2) * scale
    i = torch.arange(s_q, device=q.device)[:, None] + (s_k - s_q)
    j = torch.arange(s_k, device=q.device)[None, :]
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    allowed = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device)
    if right >= 0:
        allowed &= j <= i + right
    if left >= 0:
        allowed &= j >= i - left
    # rows without any key keep finite scores here and get zero weights below, so autograd stays finite
    dead = ~allowed.any(dim=-1, keepdim=True) if sink is None else torch.zeros_like(allowed[:, :1])
    scores = scores.masked_fill(~allowed & ~dead, float("-inf"))
    if sink is not None:
        sink_col = sink.double()[None, :, None, None].expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sink_col], dim=-1)
    weights = torch.softmax(scores, dim=-1)
    if sink is not None:
        weights = weights[..., :-1]
    weights = weights.masked_fill(dead, 0.0)
    return (weights @ vh).permute(0, 2, 1, 3)
