"""FP8 flash attention: forward and backward against the fp64 reference (>= 20 dB), block quantization,
layouts, the op contract and bad configurations."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, Format, ScalingGranularity
from primus_turbo.pytorch.kernels.attention import flash_attn_fp8_impl as impl
from primus_turbo.pytorch.kernels.attention.flash_attn_impl import empty_in_layout
from primus_turbo.pytorch.ops import flash_attn_fp8_func
from primus_turbo.triton.attention import quantize_attention_blocks_triton
from tests.pytorch.ref.attention_ref import attention_ref
from tests.pytorch.test_utils import DEVICES, compute_snr

DEVICE = DEVICES[0]
ON_GPU = DEVICE == "cuda"
SNR_DB = 20.0


def _inputs(b, s_q, s_k, heads, layout="bshd", seed=0):
    h_q, h_kv, d_qk, d_v = heads
    gen = torch.Generator().manual_seed(seed)

    def make(s, h, d):
        dims = {"b": b, "s": s, "h": h, "d": d}
        stored = torch.randn([dims[c] for c in layout], generator=gen).to(DEVICE, torch.bfloat16)
        return stored.permute([layout.index(c) for c in "bshd"]).requires_grad_()

    return make(s_q, h_q, d_qk), make(s_k, h_kv, d_qk), make(s_k, h_kv, d_v)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqs", [(100, 100), (70, 130)] + ([(2048, 2048)] if ON_GPU else []), ids=str)
@pytest.mark.parametrize(
    "heads", [(4, 2, 64, 64), (2, 1, 32, 48)] + ([(16, 16, 192, 128)] if ON_GPU else []), ids=str
)
@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
def test_forward_backward_track_the_reference(layout, heads, seqs, causal):
    q, k, v = _inputs(2, *seqs, heads, layout)
    out = flash_attn_fp8_func(q, k, v, causal=causal)
    order = [sorted(range(4), key=lambda d, t=t: (-t.stride(d), d)) for t in (q, out)]
    assert out.dtype == torch.bfloat16 and order[0] == order[1]
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE, out.dtype)
    out.backward(grad)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = attention_ref(*leaves, heads[2] ** -0.5, causal)
    ref.backward(grad.double())
    assert compute_snr(ref, out) >= SNR_DB
    for mine, theirs in zip((q, k, v), leaves, strict=True):
        assert compute_snr(theirs.grad, mine.grad) >= SNR_DB


@pytest.mark.parametrize("layout,causal", [("sbhd", False), ("bhsd", True)], ids=str)
def test_several_scale_blocks_track_the_reference(layout, causal):
    q, k, v = _inputs(1, 260, 200, (2, 1, 32, 48), layout)
    out = flash_attn_fp8_func(q, k, v, causal=causal)
    assert out.stride() == empty_in_layout(q, out.shape).stride()
    leaves = [t.detach().clone() for t in (q, k, v)]
    assert compute_snr(attention_ref(*leaves, 32**-0.5, causal), out) >= SNR_DB


def test_block_quantization_scales_and_zero_blocks():
    x = torch.randn(2, 300, 3, 32, device=DEVICE).to(torch.bfloat16)
    x[:, 128:256] = 0
    q8, scale_inv = impl.quantize_attention_blocks(x)
    assert q8.dtype == torch.float8_e4m3fn and scale_inv.shape == (2, 3, 3)
    assert torch.equal(scale_inv[:, :, 1], torch.ones_like(scale_inv[:, :, 1]))
    amax = x[:, :128].float().abs().amax(dim=(1, 3))
    torch.testing.assert_close(scale_inv[:, :, 0], amax / 448.0)
    back = impl._dequantize(q8, scale_inv)
    assert compute_snr(x.float(), back) >= 25


@pytest.mark.parametrize("seq_contiguous", [False, True], ids=["head_major", "seq_contiguous"])
@pytest.mark.parametrize("layout", ["bshd", "sbhd", "bhsd"])
def test_triton_block_quantizer_matches_the_reference(layout, seq_contiguous):
    x = _inputs(2, 150, 150, (3, 3, 40, 40), layout)[0].detach()
    x[:, :7] = 0
    ref8, ref_scale = impl.quantize_attention_blocks(x)
    q8, scale_inv = quantize_attention_blocks_triton(x, torch.float8_e4m3fn, seq_contiguous)
    assert q8.shape == x.shape and torch.equal(scale_inv, ref_scale)
    assert torch.equal(q8.float(), ref8.float())
    assert (q8.stride(1) == 1) == seq_contiguous


def test_opcheck_and_compile():
    q, k, v = _inputs(1, 70, 70, (2, 1, 32, 32))
    torch.library.opcheck(impl.flash_attn_fp8_fwd_impl, (q.detach(), k.detach(), v.detach(), 0.2, -1, 0))
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, k, v: flash_attn_fp8_func(q, k, v, causal=True), fullgraph=True, backend="aot_eager"
    )
    compiled(q, k, v).float().sum().backward()
    assert q.grad is not None and v.grad is not None


def test_bad_configuration_raises_clear_error():
    q, k, v = _inputs(1, 8, 8, (2, 2, 16, 16))
    with pytest.raises(ValueError, match="block_size 128"):
        flash_attn_fp8_func(
            q, k, v, fp8_config=Float8QuantConfig(granularity=ScalingGranularity.BLOCKWISE, block_size=64)
        )
    with pytest.raises(ValueError, match="BLOCKWISE"):
        flash_attn_fp8_func(q, k, v, fp8_config=Float8QuantConfig(format=Format.E5M2))
    with pytest.raises(TypeError, match="Float8QuantConfig"):
        flash_attn_fp8_func(q, k, v, fp8_config="fp8")
    with pytest.raises(TypeError, match="fp16 or bf16"):
        flash_attn_fp8_func(q.float(), k.float(), v.float())
