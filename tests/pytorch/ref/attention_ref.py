"""fp64 attention reference: masked softmax with an optional sink column, differentiated by autograd; and
the gradients as a flash-attention backward defines them (``attention_grads_ref``)."""

from __future__ import annotations

import torch


def _heads_first(t: torch.Tensor, group: int = 1) -> torch.Tensor:
    """fp64 [B, H * group, S, D] of a logical [B, S, H, D] tensor, each head repeated ``group`` times."""
    return t.double().permute(0, 2, 1, 3).repeat_interleave(group, dim=1)


def _weights(q, k, scale, causal, window, sink) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(softmax weights [B, Hq, Sq, Sk], the sink's weight [B, Hq, Sq] or None) in fp64.

    Query i sees key j when i + Sk - Sq - left <= j <= i + Sk - Sq + right (causal: right = 0); a query
    that sees nothing gets zero weights.
    """
    s_q, s_k = q.shape[1], k.shape[1]
    scores = _heads_first(q) @ _heads_first(k, q.shape[2] // k.shape[2]).transpose(-1, -2) * scale
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
    sink_weight = weights[..., -1] if sink is not None else None
    if sink is not None:
        weights = weights[..., :-1]
    return weights.masked_fill(dead, 0.0), sink_weight


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, Sq, Hq, Dv] in fp64 from logical [B, S, H, D] inputs (GQA by repeating key/value heads)."""
    weights, _ = _weights(q, k, scale, causal, window, sink)
    return (weights @ _heads_first(v, q.shape[2] // k.shape[2])).permute(0, 2, 1, 3)


def attention_grads_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    window: tuple[int, int],
    sink: torch.Tensor | None,
    grad_out: torch.Tensor,
    out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """fp64 (dq, dk, dv, dsink) as a flash-attention backward defines them: dS = P (dP - delta) with
    delta = rowsum(dO * out) taken from the given ``out``, the kernel's own rounded output, where the exact
    gradient uses the exact output. The two differ where dP - delta cancels (a row whose weight sits mostly
    on one key beside a sink), by the output's rounding relative to that difference."""
    group = q.shape[2] // k.shape[2]
    weights, sink_weight = _weights(q, k, scale, causal, window, sink)
    do, o = _heads_first(grad_out), _heads_first(out)
    delta = (do * o).sum(-1, keepdim=True)
    ds = weights * (do @ _heads_first(v, group).transpose(-1, -2) - delta)

    def to_kv_heads(
        t: torch.Tensor,
    ) -> torch.Tensor:  # [B, Hq, S, D] summed over each group -> [B, S, Hkv, D]
        b, _, s, d = t.shape
        return t.reshape(b, -1, group, s, d).sum(2).permute(0, 2, 1, 3)

    dq = (ds @ _heads_first(k, group) * scale).permute(0, 2, 1, 3)
    dk = to_kv_heads(ds.transpose(-1, -2) @ _heads_first(q) * scale)
    dv = to_kv_heads(weights.transpose(-1, -2) @ do)
    dsink = -(sink_weight * delta[..., 0]).sum(dim=(0, 2)) if sink is not None else None
    return dq, dk, dv, dsink
