"""TurboAttention: the functional op with fixed options, a learned fp32 sink in any module dtype,
packed sequences, and fullgraph compile."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.pytorch.modules import TurboAttention
from primus_turbo.pytorch.ops import flash_attn_func, flash_attn_varlen_func
from tests.pytorch.test_utils import DEVICES

DEVICE = DEVICES[0]


def _qkv(b=2, s=9, heads=(4, 2), d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, heads[0], d, generator=gen).to(DEVICE, torch.bfloat16).requires_grad_()
    k = torch.randn(b, s, heads[1], d, generator=gen).to(DEVICE, torch.bfloat16).requires_grad_()
    v = torch.randn(b, s, heads[1], d, generator=gen).to(DEVICE, torch.bfloat16).requires_grad_()
    return q, k, v


def test_module_equals_the_functional_op_and_learns_its_sink():
    layer = TurboAttention(causal=True, window_size=(5, -1), learnable_sink=True, num_heads=4, device=DEVICE)
    layer.to(torch.bfloat16)
    assert layer.sink.dtype == torch.bfloat16
    q, k, v = _qkv()
    out = layer(q, k, v)
    expected = flash_attn_func(q, k, v, causal=True, window_size=(5, -1), sink=layer.sink.detach().float())
    assert torch.equal(out, expected)
    out.float().sum().backward()
    assert layer.sink.grad is not None and layer.sink.grad.shape == (4,)
    assert "sink[4]" in repr(layer)


def test_packed_sequences_use_the_varlen_op():
    layer = TurboAttention(causal=True)
    q, k, v = (t.detach()[0] for t in _qkv(b=1, s=10))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=DEVICE)
    out = layer(q, k, v, cu_seqlens_q=cu, max_seqlen_q=6)
    assert torch.equal(out, flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=True))


def test_compiles_fullgraph():
    torch._dynamo.reset()
    layer = TurboAttention(causal=True, learnable_sink=True, num_heads=4, device=DEVICE)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    q, k, v = _qkv()
    compiled(q, k, v).float().sum().backward()
    assert layer.sink.grad is not None and q.grad is not None


def test_sink_needs_the_head_count():
    with pytest.raises(ValueError, match="num_heads"):
        TurboAttention(learnable_sink=True)
