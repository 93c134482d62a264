"""``TurboAttention``: the attention core (softmax(q k^T) v) of a transformer layer on Turbo kernels."""

from __future__ import annotations

import torch
from torch import nn

from primus_turbo.pytorch.ops.attention import flash_attn_func, flash_attn_varlen_func

__all__ = ["TurboAttention"]


class TurboAttention(nn.Module):
    """``flash_attn_func`` (or ``flash_attn_varlen_func`` when ``cu_seqlens_q`` is given) with fixed
    options, and an optional learned per-head sink initialised to zeros (``num_heads`` query heads).

    The sink stays an fp32 logit in the op whatever dtype the module is cast to.
    """

    def __init__(
        self,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        learnable_sink: bool = False,
        num_heads: int | None = None,
        deterministic: bool = False,
        return_lse: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.softmax_scale, self.causal, self.window_size = softmax_scale, causal, tuple(window_size)
        self.deterministic, self.return_lse = deterministic, return_lse
        if learnable_sink:
            if not isinstance(num_heads, int) or num_heads <= 0:
                raise ValueError(f"a learnable sink needs num_heads (query heads), got {num_heads!r}")
            self.sink = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32, device=device))
        else:
            self.register_parameter("sink", None)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_k: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_k: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logical [B, S, H, D] inputs (bshd, sbhd or bhsd), or packed [T, H, D] with the offsets."""
        sink = self.sink.float() if self.sink is not None else None
        options = dict(
            softmax_scale=self.softmax_scale,
            causal=self.causal,
            window_size=self.window_size,
            sink=sink,
            deterministic=self.deterministic,
            return_lse=self.return_lse,
        )
        if cu_seqlens_q is None:
            return flash_attn_func(q, k, v, **options)
        cu_seqlens_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
        max_seqlen_k = max_seqlen_q if max_seqlen_k is None else max_seqlen_k
        return flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options
        )

    def extra_repr(self) -> str:
        sink = f", sink[{self.sink.numel()}]" if self.sink is not None else ""
        return f"causal={self.causal}, window_size={self.window_size}{sink}"
