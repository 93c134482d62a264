"""``TurboDotProductAttention``: the ``TEDotProductAttention`` slot on Turbo flash attention."""

from __future__ import annotations

import math
from typing import Any

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import is_layer_window_attention
from torch import nn

from primus_turbo.integrations.megatron.linear import _ExtraState
from primus_turbo.pytorch.ops.attention import flash_attn_func, flash_attn_varlen_func

__all__ = ["TurboDotProductAttention"]

_CAUSAL = {
    AttnMaskType.causal: True,
    AttnMaskType.causal_bottom_right: True,
    AttnMaskType.no_mask: False,
    AttnMaskType.padding_causal: True,  # packed sequences: the offsets are the padding
    AttnMaskType.padding: False,
}


class TurboDotProductAttention(_ExtraState, nn.Module):
    """Megatron's core attention with TE's constructor and forward contract.

    Takes sequence-first ``[s, b, heads, dim]`` q/k/v (GQA when k/v have fewer heads) and returns
    ``[s, b, heads * dim_v]``; with ``packed_seq_params`` (THD) ``[t, heads, dim]`` in, ``[t, heads * dim_v]``
    out. Causal and unmasked attention, sliding windows (``config.window_size``), no dropout, no context
    parallelism, no attention bias or arbitrary masks: those raise instead of being ignored.
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str = "p2p",
        **kwargs: Any,
    ) -> None:
        super().__init__()
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"Turbo attention has no dropout; set attention_dropout=0 (got {dropout})")
        if config.context_parallel_size > 1:
            raise ValueError(
                "Turbo attention does not support context parallelism (context_parallel_size > 1)"
            )
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(
                f"Turbo attention supports softmax_type='vanilla' only, got {config.softmax_type!r}"
            )
        self.config, self.layer_number, self.attn_mask_type = config, layer_number, attn_mask_type
        self.attention_type = attention_type
        head_dim = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.window_size = (-1, -1)
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            self.window_size = tuple(config.window_size)
        self.deterministic = bool(config.deterministic_mode)

    def _causal(self, attn_mask_type: AttnMaskType | None) -> bool:
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type not in _CAUSAL:
            raise ValueError(f"Turbo attention supports causal and unmasked attention, got {mask_type}")
        return _CAUSAL[mask_type]

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("Turbo attention does not take an attention_bias")
        causal = self._causal(attn_mask_type)
        options = dict(
            softmax_scale=self.softmax_scale,
            causal=causal,
            window_size=self.window_size,
            deterministic=self.deterministic,
        )
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._packed(query, key, value, packed_seq_params, options)
        if attention_mask is not None and not causal:
            raise ValueError("Turbo attention takes no attention_mask (padding masks): use packed sequences")
        # sbhd memory read as logical [b, s, h, d] through strides; the output keeps q's layout
        out = flash_attn_func(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), **options)
        out = out.transpose(0, 1)
        return out.reshape(out.shape[0], out.shape[1], -1)

    @staticmethod
    def _packed(query, key, value, params, options) -> torch.Tensor:
        for side in ("q", "kv"):
            padded = getattr(params, f"cu_seqlens_{side}_padded", None)
            if padded is not None and padded is not getattr(params, f"cu_seqlens_{side}"):
                raise ValueError(
                    "Turbo attention does not support padded packed sequences (cu_seqlens_*_padded)"
                )
        out = flash_attn_varlen_func(
            query,
            key,
            value,
            params.cu_seqlens_q.to(torch.int32),
            params.cu_seqlens_kv.to(torch.int32),
            int(params.max_seqlen_q),
            int(params.max_seqlen_kv),
            **options,
        )
        return out.reshape(out.shape[0], -1)

    def extra_repr(self) -> str:
        return f"layer={self.layer_number}, mask={self.attn_mask_type.name}, window={self.window_size}"
