"""The Turbo modules behind Megatron's Transformer-Engine slots, one at a time: constructor and return
contracts, tensor-parallel sizing, fused weight-gradient accumulation, FP8 weight caching across
micro-batches, the attention module's masks and packed sequences, and the clear errors."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.integrations.megatron import PrimusTurboConfig, apply_primus_turbo_to_megatron
from primus_turbo.integrations.megatron.attention import TurboDotProductAttention
from primus_turbo.integrations.megatron.experts import (
    TurboColumnParallelGroupedLinear,
    TurboGroupedLinear,
    TurboGroupedMLP,
)
from primus_turbo.integrations.megatron.linear import (
    TurboColumnParallelLinear,
    TurboLayerNormColumnParallelLinear,
    TurboLinear,
    TurboRowParallelLinear,
)
from primus_turbo.integrations.megatron.norm import TurboNorm, TurboRMSNorm
from tests.integrations.megatron.megatron_harness import (
    tiny_config,
    tiny_moe_config,
)
from tests.pytorch.test_utils import compute_snr


def _init(w: torch.Tensor) -> None:
    torch.nn.init.normal_(w, std=0.02)


def _column(config, **kw) -> TurboColumnParallelLinear:
    args = dict(config=config, init_method=_init, gather_output=False, bias=False, skip_bias_add=False)
    return TurboColumnParallelLinear(64, 96, **{**args, "is_expert": False, **kw})


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def test_linear_contract_and_names(megatron):
    config = tiny_config(add_bias_linear=True)
    layer = _column(
        config, bias=True, skip_bias_add=True, tp_comm_buffer_name="qkv", name="x", pg_collection=None
    )
    layer = layer.to(_device())
    x = torch.randn(5, 2, 64, dtype=torch.bfloat16, device=_device())
    out, bias = layer(x)
    assert out.shape == (5, 2, 96) and bias is layer.bias
    ref = x.float() @ layer.weight.float().t()
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
    layer.skip_bias_add = False
    out, bias = layer(x)
    assert bias is None
    torch.testing.assert_close(out.float(), ref + layer.bias.float(), rtol=1e-2, atol=1e-2)
    assert set(layer.state_dict()) == {"weight", "bias", "_extra_state"}


def test_layernorm_linear_matches_norm_then_linear(megatron):
    config = tiny_config()
    layer = TurboLayerNormColumnParallelLinear(
        64,
        96,
        config=config,
        init_method=_init,
        gather_output=False,
        bias=False,
        skip_bias_add=False,
        is_expert=False,
    ).to(_device())
    with torch.no_grad():
        layer.layer_norm_weight.uniform_(0.5, 1.5)
    x = torch.randn(7, 64, dtype=torch.bfloat16, device=_device(), requires_grad=True)
    out, _ = layer(x)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + config.layernorm_epsilon)
    ref = (normed * layer.layer_norm_weight.float()) @ layer.weight.float().t()
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
    assert set(layer.state_dict()) == {"weight", "layer_norm_weight", "_extra_state"}
    out.float().sum().backward()
    assert layer.layer_norm_weight.grad is not None and x.grad is not None


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
@pytest.mark.parametrize("fp8", ["e4m3", "hybrid"])
def test_fp8_layernorm_linear_writes_the_fp8_operand_from_the_norm(megatron, recipe, fp8):
    """With FP8 and no input gather, the norm writes the GEMM's FP8 operand (rmsnorm_fp8) instead of a bf16
    activation that the GEMM quantizes again; output and every gradient against the fp32 reference."""
    config = tiny_config(fp8=fp8, fp8_recipe=recipe)
    common = dict(config=config, init_method=_init, gather_output=False, bias=False, skip_bias_add=False)
    layer = TurboLayerNormColumnParallelLinear(256, 128, is_expert=False, **common).to(_device())
    assert layer._fuses_norm_into_fp8()
    with torch.no_grad():
        layer.layer_norm_weight.uniform_(0.5, 1.5)
    x = torch.randn(16, 2, 256, dtype=torch.bfloat16, device=_device(), requires_grad=True)
    g = torch.randn(16, 2, 128, dtype=torch.bfloat16, device=_device())
    out, _ = layer(x)
    out.backward(g)

    xf = x.detach().float().requires_grad_()
    gamma = layer.layer_norm_weight.detach().float().requires_grad_()
    weight = layer.weight.detach().float().requires_grad_()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + config.layernorm_epsilon) * gamma
    ref = normed @ weight.t()
    ref.backward(g.float())
    backward_db = 20 if fp8 == "hybrid" else 25  # E5M2 gradients under HYBRID
    assert compute_snr(ref.detach(), out) >= 25
    assert compute_snr(xf.grad, x.grad) >= backward_db
    assert compute_snr(gamma.grad, layer.layer_norm_weight.grad) >= backward_db
    assert compute_snr(weight.grad, layer.weight.grad) >= backward_db


def test_fp8_layernorm_linear_keeps_the_bf16_norm_where_it_cannot_fuse(megatron):
    layer = TurboLayerNormColumnParallelLinear(
        256, 128, config=tiny_config(fp8="e4m3", fp8_recipe="mxfp8"), init_method=_init,
        gather_output=False, bias=False, skip_bias_add=False, is_expert=False,
    )  # fmt: skip
    assert not layer._fuses_norm_into_fp8()  # MX blocks: no fused producer
    assert not TurboLayerNormColumnParallelLinear(
        256, 128, config=tiny_config(), init_method=_init,
        gather_output=False, bias=False, skip_bias_add=False, is_expert=False,
    )._fuses_norm_into_fp8()  # fmt: skip


def test_bad_constructor_arguments_raise(megatron):
    config = tiny_config()
    with pytest.raises(ValueError, match="gather_output"):
        _column(config, gather_output=True)
    with pytest.raises(ValueError, match="input_is_parallel"):
        TurboRowParallelLinear(
            64,
            64,
            config=config,
            init_method=_init,
            bias=False,
            input_is_parallel=False,
            skip_bias_add=False,
            is_expert=False,
        )
    with pytest.raises(ValueError, match="skip_weight_param_allocation"):
        _column(config, skip_weight_param_allocation=True)
    with pytest.raises(ValueError, match="parallel_mode"):
        TurboLinear(
            64,
            64,
            parallel_mode="diagonal",
            config=config,
            init_method=_init,
            bias=False,
            skip_bias_add=False,
        )
    with pytest.raises(ValueError, match="dropout"):
        TurboDotProductAttention(tiny_config(attention_dropout=0.1), 1, _causal(), "self")


def test_fused_wgrad_accumulates_into_main_grad(megatron):
    layer = _column(tiny_config(gradient_accumulation_fusion=True)).to(_device())
    layer.weight.main_grad = torch.zeros(layer.weight.shape, dtype=torch.float32, device=_device())
    x = torch.randn(6, 64, dtype=torch.bfloat16, device=_device())
    g = torch.randn(6, 96, dtype=torch.bfloat16, device=_device())
    for _ in range(2):
        out, _ = layer(x)
        out.backward(g)
    assert layer.weight.grad_added_to_main_grad
    expected = 2 * (g.float().t() @ x.float())
    torch.testing.assert_close(layer.weight.main_grad, expected, rtol=1e-2, atol=1e-2)


def test_fp8_cached_weight_accumulates_into_main_grad(megatron):
    layer = _column(tiny_config(fp8="e4m3", fp8_recipe="tensorwise", gradient_accumulation_fusion=True))
    layer = layer.to(_device())
    layer.weight.main_grad = torch.zeros(layer.weight.shape, dtype=torch.float32, device=_device())
    x = torch.randn(16, 64, dtype=torch.bfloat16, device=_device())
    g = torch.randn(16, 96, dtype=torch.bfloat16, device=_device())
    for _ in range(2):  # the second micro-batch reads the cached FP8 weight
        out, _ = layer(x)
        out.backward(g)
    expected = 2 * (g.float().t() @ x.float())
    snr = 10 * torch.log10(expected.pow(2).sum() / (layer.weight.main_grad - expected).pow(2).sum())
    assert layer.weight.grad_added_to_main_grad and snr > 25


def test_fp8_weight_is_quantized_once_per_weight_update(megatron):
    layer = _column(tiny_config(fp8="e4m3", fp8_recipe="tensorwise")).to(_device())
    x = torch.randn(8, 64, dtype=torch.bfloat16, device=_device())
    layer(x)
    first = layer._weight_cache.value
    layer(x)
    assert layer._weight_cache.value is first  # a later micro-batch reuses the FP8 weight
    with torch.no_grad():
        layer.weight.mul_(2)  # an optimizer step changes the weight in place
    out, _ = layer(x)
    assert layer._weight_cache.value is not first
    ref = x.float() @ layer.weight.float().t()
    snr = 10 * torch.log10(ref.pow(2).sum() / (out.float() - ref).pow(2).sum())
    assert snr > 25
    layer.is_first_microbatch = True
    layer(x)
    assert layer._weight_cache.value is not first


@pytest.mark.parametrize("fp8", [None, "e4m3"], ids=["bf16", "fp8"])
def test_compiled_linear_does_not_recompile_after_the_first_microbatch(megatron, fp8):
    """``is_first_microbatch`` is the eager FP8 cache's flag: a compiled call neither reads nor writes it
    (a guard on it recompiled the graph at the second step)."""
    layer = _column(tiny_config(fp8=fp8, fp8_recipe="tensorwise")).to(_device())
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    x = torch.randn(8, 64, dtype=torch.bfloat16, device=_device())
    compiled(x)
    layer.is_first_microbatch = False  # what an eager call, or Megatron between micro-batches, leaves
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled(x)
    assert layer.is_first_microbatch is False


def test_norm_factory(megatron):
    assert isinstance(TurboNorm(tiny_config(), 64), TurboRMSNorm)
    assert isinstance(TurboNorm(tiny_config(normalization="LayerNorm"), 64), torch.nn.LayerNorm)
    with pytest.raises(ValueError, match="fused_residual_rmsnorm"):
        config = tiny_config()
        config.fused_residual_rmsnorm = True
        TurboNorm(config, 64, has_residual=True)


def _causal():
    from megatron.core.transformer.enums import AttnMaskType

    return AttnMaskType.causal


def _reference_attention(q, k, v, causal):
    """[s, b, h, d] fp32 softmax attention -> [s, b, h * d]."""
    q, k, v = (t.float().permute(1, 2, 0, 3) for t in (q, k, v))
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    out = scores.softmax(-1) @ v
    return out.permute(2, 0, 1, 3).reshape(q.shape[2], q.shape[0], -1)


def test_attention_sbhd_gqa(megatron):
    config = tiny_config(num_query_groups=2)
    attention = TurboDotProductAttention(config, 1, _causal(), "self")
    s, b, d = 12, 2, 16
    q = torch.randn(s, b, 4, d, dtype=torch.bfloat16, device=_device())
    k, v = (torch.randn(s, b, 2, d, dtype=torch.bfloat16, device=_device()) for _ in range(2))
    out = attention(q, k, v, None, None)
    assert out.shape == (s, b, 4 * d)
    torch.testing.assert_close(out.float(), _reference_attention(q, k, v, True), rtol=1e-2, atol=1e-2)


def test_attention_packed_sequences(megatron):
    from megatron.core.packed_seq_params import PackedSeqParams

    attention = TurboDotProductAttention(tiny_config(), 1, _causal(), "self")
    lens, h, d = [5, 9], 4, 16
    total = sum(lens)
    q, k, v = (torch.randn(total, h, d, dtype=torch.bfloat16, device=_device()) for _ in range(3))
    cu = torch.tensor([0, lens[0], total], dtype=torch.int32, device=_device())
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens), max_seqlen_kv=max(lens)
    )
    out = attention(q, k, v, None, None, packed_seq_params=params)
    assert out.shape == (total, h * d)
    pieces = [
        _reference_attention(*(t[a:e, None] for t in (q, k, v)), True)[:, 0]
        for a, e in ((0, lens[0]), (lens[0], total))
    ]
    torch.testing.assert_close(out.float(), torch.cat(pieces), rtol=1e-2, atol=1e-2)


def test_attention_rejects_what_it_cannot_do(megatron):
    from megatron.core.transformer.enums import AttnMaskType

    attention = TurboDotProductAttention(tiny_config(), 1, AttnMaskType.padding, "self")
    q = torch.randn(4, 1, 4, 16, dtype=torch.bfloat16, device=_device())
    with pytest.raises(ValueError, match="attention_mask"):
        attention(q, q, q, torch.zeros(1, 1, 4, 4, dtype=torch.bool, device=_device()), None)
    with pytest.raises(ValueError, match="attention_bias"):
        attention(q, q, q, None, None, attention_bias=torch.zeros(1, device=_device()))
    with pytest.raises(ValueError, match="causal and unmasked"):
        attention(q, q, q, None, AttnMaskType.arbitrary)


def test_grouped_linear_names_and_device_counts(megatron):
    config = tiny_moe_config(moe_grouped_gemm=True)
    fc1 = TurboColumnParallelGroupedLinear(
        3,
        64,
        32,
        config=config,
        init_method=_init,
        bias=False,
        skip_bias_add=False,
        is_expert=True,
        name="fc1",
    ).to(_device())
    assert set(fc1.state_dict()) == {"weight0", "weight1", "weight2", "_extra_state"}
    x = torch.randn(10, 64, dtype=torch.bfloat16, device=_device())
    counts = torch.tensor([3, 0, 7], device=_device())
    out, bias = fc1(x, counts)
    assert bias is None
    ref = torch.cat([x[:3].float() @ fc1.weight0.float().t(), x[3:].float() @ fc1.weight2.float().t()])
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
    out_list, _ = fc1(x, [3, 0, 7])  # Megatron's host list form
    torch.testing.assert_close(out_list, out)


def test_grouped_mlp_applies_probs(megatron):
    config = tiny_moe_config(moe_grouped_gemm=True)
    experts = TurboGroupedMLP(2, config).to(_device())
    x = torch.randn(6, 64, dtype=torch.bfloat16, device=_device())
    probs = torch.rand(6, device=_device())
    out, bias = experts(x, torch.tensor([4, 2]), probs)
    assert out.shape == (6, 64) and bias is None
    double, _ = experts(x, torch.tensor([4, 2]), 2 * probs)
    torch.testing.assert_close(double.float(), 2 * out.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_fused_act_writes_fc2_input_in_fp8(moe_fp8, recipe, monkeypatch):
    """Under tensorwise FP8 the fused SwiGLU-with-probs writes fc2's input straight in FP8 (no bf16
    activation, no quantization pass in fc2): output and gradients are bit for bit those of the bf16
    activation quantized in fc2. Block scaling keeps the bf16 activation (its wgrad quantizes per expert)."""
    from primus_turbo.integrations.megatron.experts import TurboGroupedMLPWithFusedAct
    from primus_turbo.pytorch.ops import QuantizedTensor

    config = tiny_moe_config(
        moe_grouped_gemm=True, fp8="e4m3", fp8_recipe=recipe, hidden_size=128, moe_ffn_hidden_size=128
    )
    torch.manual_seed(0)
    experts = TurboGroupedMLPWithFusedAct(2, config).to(_device())
    x = torch.randn(12, 128, dtype=torch.bfloat16, device=_device())
    probs = torch.rand(12, device=_device())
    grad = torch.randn(12, 128, dtype=torch.bfloat16, device=_device())
    inputs = []
    forward = experts.linear_fc2.forward
    monkeypatch.setattr(experts.linear_fc2, "forward", lambda a, m: (inputs.append(a), forward(a, m))[1])

    def run():
        experts.zero_grad(set_to_none=True)
        x_, p_ = x.clone().requires_grad_(), probs.clone().requires_grad_()
        out, _ = experts(x_, torch.tensor([5, 7]), p_)
        out.backward(grad)
        return [out, x_.grad, p_.grad] + [p.grad for p in experts.parameters()]

    fused = run()
    assert isinstance(inputs[-1], QuantizedTensor) == (recipe == "tensorwise")
    monkeypatch.setattr(experts.linear_fc2, "fp8_input", lambda tokens: None)
    plain = run()
    assert not isinstance(inputs[-1], QuantizedTensor)
    for a, b in zip(fused, plain, strict=True):
        assert torch.equal(a, b)


def _grouped_fc1(bias: bool = False, **overrides) -> TurboColumnParallelGroupedLinear:
    config = tiny_moe_config(moe_grouped_gemm=True, add_bias_linear=bias, **overrides)
    return TurboColumnParallelGroupedLinear(
        3, 64, 32, config=config, init_method=_init, bias=bias, skip_bias_add=False, is_expert=True
    ).to(_device())


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_linear_reads_its_experts_without_a_copy(megatron, bias):
    """Built back to back, the experts' weights are one [G, out, in] view (no stack copy); re-homed ones
    (here: separate tensors) take the copy; both give the same output and per-expert gradients."""
    fc1 = _grouped_fc1(bias)
    stacked = fc1._stacked("weight")
    assert stacked.data_ptr() == fc1.weight0.data_ptr() and stacked.shape == (3, 32, 64)
    x = torch.randn(10, 64, dtype=torch.bfloat16, device=_device())
    counts = torch.tensor([3, 0, 7], device=_device())
    grad_out = torch.randn(10, 32, dtype=torch.bfloat16, device=_device())

    def run() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        fc1.zero_grad(set_to_none=True)
        out, _ = fc1(x, counts)
        out.backward(grad_out)
        return out.detach(), {name: p.grad.clone() for name, p in fc1.named_parameters()}

    out_view, grads_view = run()
    for param in fc1.parameters():
        param.data = param.data.clone()  # what a distributed optimizer's parameter buffer does
    assert fc1._stacked("weight").data_ptr() != fc1.weight0.data_ptr()
    out_copy, grads_copy = run()
    torch.testing.assert_close(out_view, out_copy, rtol=0, atol=0)
    assert grads_view.keys() == grads_copy.keys()
    for name, view in grads_view.items():
        torch.testing.assert_close(view, grads_copy[name], rtol=0, atol=0)
    assert grads_view["weight1"].abs().sum() == 0  # expert 1 has no tokens


@pytest.mark.parametrize("rehomed", [False, True], ids=["view", "copy"])
@pytest.mark.parametrize("layout", ["forward", "reverse", "apart"])
def test_grouped_wgrad_accumulates_into_main_grad(megatron, layout, rehomed):
    """With gradient_accumulation_fusion, experts whose main_grads DDP's buffer holds back to back (in
    expert order, or reversed as DDP lays parameters out) get their weight gradients added there in one
    step, flagged ``grad_added_to_main_grad`` (Megatron's hook then skips its add); main_grads lying apart
    leave the gradients to autograd and the hook. Two backwards accumulate."""
    fc1 = _grouped_fc1(gradient_accumulation_fusion=True)
    ref = _grouped_fc1()
    ref.load_state_dict(fc1.state_dict())
    params = fc1._experts("weight")
    if rehomed:  # weights apart (a distributed optimizer's buffer): stacked by a copy
        for param in params:
            param.data = param.data.clone()
    step, count = params[0].numel(), len(params)
    buffer = torch.zeros(count * step, dtype=torch.float32, device=_device())
    for i, param in enumerate(params):
        slot = count - 1 - i if layout == "reverse" else i
        grad = buffer[slot * step : (slot + 1) * step].view(param.shape)
        param.main_grad = grad.clone() if layout == "apart" else grad
        param.grad_added_to_main_grad = False
    x = torch.randn(10, 64, dtype=torch.bfloat16, device=_device())
    counts = torch.tensor([3, 0, 7], device=_device())
    grad_out = torch.randn(10, 32, dtype=torch.bfloat16, device=_device())
    for _ in range(2):
        fc1(x, counts)[0].backward(grad_out)
        ref(x, counts)[0].backward(grad_out)
    for param, expected in zip(params, ref._experts("weight"), strict=True):
        if layout == "apart":
            assert not param.grad_added_to_main_grad and not param.main_grad.any()
            torch.testing.assert_close(param.grad, expected.grad, rtol=0, atol=0)
        else:
            assert param.grad_added_to_main_grad
            torch.testing.assert_close(param.main_grad, expected.grad.float(), rtol=1e-2, atol=1e-2)


def test_grouped_linear_keeps_experts_consecutive_through_to(megatron):
    """``.to()`` converts each parameter on its own; the layer lays its experts back to back again."""
    fc1 = _grouped_fc1(bias=True)
    before = fc1._stacked("weight").detach().clone()
    fc1.float()
    for name in ("weight", "bias"):
        stacked = fc1._stacked(name)
        assert stacked.dtype == torch.float32 and stacked.data_ptr() == getattr(fc1, f"{name}0").data_ptr()
    torch.testing.assert_close(fc1._stacked("weight").detach(), before.float(), rtol=0, atol=0)


def test_grouped_linear_keeps_experts_consecutive_through_state_dict_load(megatron):
    fc1 = _grouped_fc1()
    other = _grouped_fc1()
    other.load_state_dict(fc1.state_dict())
    assert other._stacked("weight").data_ptr() == other.weight0.data_ptr()
    torch.testing.assert_close(other._stacked("weight"), fc1._stacked("weight"), rtol=0, atol=0)


@pytest.fixture
def moe_fp8(megatron, monkeypatch):
    """Megatron's MoE FP8 configs ask for Transformer Engine; the Turbo patch's gate answers instead."""
    from megatron.core.transformer import transformer_config

    from primus_turbo.integrations.megatron.patch import _te_gate_without_te

    monkeypatch.setattr(transformer_config, "is_te_min_version", _te_gate_without_te())


def _fp8_grouped_fc1(**overrides) -> TurboColumnParallelGroupedLinear:
    return _grouped_fc1(fp8="e4m3", fp8_recipe="tensorwise", **overrides)


def test_fp8_grouped_weights_are_quantized_once_per_weight_update(moe_fp8):
    """The experts' FP8 copies are made on the first micro-batch and after a weight update only; a later
    micro-batch reads them and gets the same output and gradients, bit for bit, as quantizing again."""
    fc1 = _fp8_grouped_fc1()
    x = torch.randn(10, 64, dtype=torch.bfloat16, device=_device())
    counts = torch.tensor([3, 0, 7], device=_device())
    grad_out = torch.randn(10, 32, dtype=torch.bfloat16, device=_device())

    def step() -> tuple[torch.Tensor, list[torch.Tensor]]:
        fc1.zero_grad(set_to_none=True)
        out, _ = fc1(x, counts)
        out.backward(grad_out)
        return out.detach(), [p.grad.clone() for p in fc1.parameters()]

    fresh = step()
    first = fc1._weight_cache.value
    assert first is not None and not fc1.is_first_microbatch
    cached = step()
    assert fc1._weight_cache.value is first  # a later micro-batch reuses the FP8 weights
    for a, b in zip((fresh[0], *fresh[1]), (cached[0], *cached[1]), strict=True):
        assert torch.equal(a, b)
    with torch.no_grad():
        fc1.weight2.mul_(2)  # an optimizer step changes the weights in place
    out, _ = fc1(x, counts)
    assert fc1._weight_cache.value is not first
    ref = torch.cat([x[:3].float() @ fc1.weight0.float().t(), x[3:].float() @ fc1.weight2.float().t()])
    assert compute_snr(ref, out.float()) > 25
    second = fc1._weight_cache.value
    fc1.is_first_microbatch = True  # Megatron's schedule at the start of a step
    fc1(x, counts)
    assert fc1._weight_cache.value is not second


def test_fp8_grouped_linear_can_take_its_wgrad_in_high_precision(moe_fp8, monkeypatch):
    """Built while ``fp8_wgrad`` is off (``--no-turbo-fp8-expert-wgrad``), the experts' weight gradients
    are the bf16 layer's bit for bit; the output and input gradient stay the FP8 layer's."""
    monkeypatch.setattr(TurboGroupedLinear, "fp8_wgrad", False)
    high = _fp8_grouped_fc1()
    monkeypatch.setattr(TurboGroupedLinear, "fp8_wgrad", True)
    fp8, bf16 = _fp8_grouped_fc1(), _grouped_fc1()
    assert "fp8_wgrad=False" in repr(high) and "fp8_wgrad" not in repr(fp8)
    x = torch.randn(10, 64, dtype=torch.bfloat16, device=_device())
    counts = torch.tensor([3, 0, 7], device=_device())
    grad_out = torch.randn(10, 32, dtype=torch.bfloat16, device=_device())

    def run(layer: TurboGroupedLinear) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        layer.load_state_dict(high.state_dict())
        x_ = x.clone().requires_grad_()
        out, _ = layer(x_, counts)
        out.backward(grad_out)
        return out, x_.grad, [p.grad for p in layer.parameters()]

    high_out, high_dx, high_dw = run(high)
    fp8_out, fp8_dx, fp8_dw = run(fp8)
    _, _, bf16_dw = run(bf16)
    assert torch.equal(high_out, fp8_out) and torch.equal(high_dx, fp8_dx)
    assert all(
        torch.equal(high_grad, bf16_grad) for high_grad, bf16_grad in zip(high_dw, bf16_dw, strict=True)
    )
    assert not torch.equal(high_dw[0], fp8_dw[0])  # the FP8 wgrad differs where an expert has tokens


def test_patch_sets_the_experts_wgrad_precision(moe_fp8):
    config = tiny_moe_config(moe_grouped_gemm=True, fp8="e4m3", fp8_recipe="tensorwise")
    turbo = PrimusTurboConfig(enable_primus_turbo=True, turbo_fp8_expert_wgrad=False)
    patch = apply_primus_turbo_to_megatron(turbo, config)
    try:
        assert TurboGroupedLinear.fp8_wgrad is False and not _fp8_grouped_fc1().fp8_wgrad
    finally:
        patch.undo()
    assert TurboGroupedLinear.fp8_wgrad is True


@pytest.mark.parametrize("off", ["flag", "config"])
def test_fp8_weight_cache_is_off_where_megatron_turns_it_off(moe_fp8, off):
    overrides = {"disable_parameter_transpose_cache": True} if off == "config" else {}
    fc1 = _fp8_grouped_fc1(**overrides)
    linear = _column(tiny_config(fp8="e4m3", fp8_recipe="tensorwise", **overrides)).to(_device())
    if off == "flag":
        fc1.is_first_microbatch = linear.is_first_microbatch = None
    fc1(torch.randn(4, 64, dtype=torch.bfloat16, device=_device()), torch.tensor([1, 2, 1]))
    linear(torch.randn(4, 64, dtype=torch.bfloat16, device=_device()))
    assert fc1._weight_cache.value is None and linear._weight_cache.value is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("module", ["linear", "grouped"])
def test_cuda_graph_of_an_fp8_layer_quantizes_the_updated_weights(moe_fp8, module):
    """A captured graph holds the weight quantization: replayed after an optimizer step it reads the new
    weights (a cache hit at capture time would have frozen the old FP8 copies into the graph)."""
    layer = (
        _fp8_grouped_fc1()
        if module == "grouped"
        else _column(tiny_config(fp8="e4m3", fp8_recipe="tensorwise"))
    )
    layer = layer.to(_device())
    x = torch.randn(10, 64, dtype=torch.bfloat16, device=_device())
    args = (x, torch.tensor([3, 0, 7], device=_device())) if module == "grouped" else (x,)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # the second eager call hits the cache
            layer(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = layer(*args)
    with torch.no_grad():
        for param in layer.parameters():
            param.mul_(-3)
    graph.replay()
    expected, _ = layer(*args)
    assert torch.equal(out, expected)


def _force(monkeypatch, use_fp8: bool, fp8_wgrad: bool = True) -> list[dict]:
    """Make the cost model answer ``use_fp8`` (tiny test shapes would always come out bf16); the calls it
    saw are returned."""
    from primus_turbo.integrations.megatron import fp8_choice
    from primus_turbo.pytorch.core.fp8_filter import Fp8Decision

    calls: list[dict] = []

    def decide(tokens, in_features, out_features, config, **kwargs):
        calls.append(dict(tokens=tokens, in_features=in_features, out_features=out_features, **kwargs))
        return Fp8Decision(use_fp8, fp8_wgrad, 1.0, 2.0, "forced")

    monkeypatch.setattr(fp8_choice, "fp8_linear_decision", decide)
    return calls


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_fp8_auto_filter_keeps_small_linears_in_bf16(megatron, monkeypatch, caplog, mode):
    """Under the auto-filter a layer whose shape the cost model finds slower in FP8 runs the bf16 GEMMs
    (output and gradients equal the bf16 layer's bit for bit, no FP8 weight made), and says so once."""
    monkeypatch.setattr(TurboLinear, "fp8_auto_filter", mode)
    common = dict(config=tiny_config(fp8="e4m3", fp8_recipe="tensorwise"), init_method=_init)
    common.update(gather_output=False, bias=False, skip_bias_add=False, is_expert=False)
    filtered = TurboLayerNormColumnParallelLinear(256, 128, tp_comm_buffer_name="qkv", **common).to(_device())
    monkeypatch.setattr(TurboLinear, "fp8_auto_filter", None)
    plain = TurboLayerNormColumnParallelLinear(256, 128, **{**common, "config": tiny_config()}).to(_device())
    plain.load_state_dict(filtered.state_dict())
    x = torch.randn(16, 2, 256, dtype=torch.bfloat16, device=_device())
    g = torch.randn(16, 2, 128, dtype=torch.bfloat16, device=_device())
    results = []
    with caplog.at_level("INFO", logger="primus_turbo.integrations.megatron.fp8_choice"):
        for layer in (filtered, filtered, plain):
            x_ = x.clone().requires_grad_()
            layer.zero_grad(set_to_none=True)
            out, _ = layer(x_)
            out.backward(g)
            results.append((out, x_.grad, layer.weight.grad, layer.layer_norm_weight.grad))
    for a, b in zip(results[0], results[2], strict=True):
        assert torch.equal(a, b)
    assert filtered._weight_cache.value is None
    logged = [r.getMessage() for r in caplog.records if "auto-filter" in r.getMessage()]
    assert len(logged) == 1 and "(qkv) [32 tokens x 256 -> 128]: bf16" in logged[0]


def test_fp8_auto_filter_runs_fp8_where_the_model_says_so(megatron, monkeypatch):
    """Where the model picks FP8 the layer is the FP8 layer bit for bit, fused norm included; the model
    is asked once per power-of-two bucket of token counts, with the layer's features."""
    calls = _force(monkeypatch, use_fp8=True)
    common = dict(config=tiny_config(fp8="e4m3", fp8_recipe="blockwise"), init_method=_init)
    common.update(gather_output=False, bias=False, skip_bias_add=False, is_expert=False)
    monkeypatch.setattr(TurboLinear, "fp8_auto_filter", "graph")
    filtered = TurboLayerNormColumnParallelLinear(256, 128, **common).to(_device())
    monkeypatch.setattr(TurboLinear, "fp8_auto_filter", None)
    fp8 = TurboLayerNormColumnParallelLinear(256, 128, **common).to(_device())
    fp8.load_state_dict(filtered.state_dict())
    x = torch.randn(16, 2, 256, dtype=torch.bfloat16, device=_device())
    assert torch.equal(filtered(x)[0], fp8(x)[0])
    filtered(x[:12])  # 24 tokens: the 16-31 bucket
    filtered(x[:10])  # 20 tokens: the same bucket, no new decision
    filtered(x[:4])  # 8 tokens: a new bucket
    assert [c["tokens"] for c in calls] == [32, 16, 8]
    assert calls[0]["input_fp8"] and not calls[0]["count_host"] and calls[0]["in_features"] == 256


@pytest.mark.parametrize("fp8_wgrad", [False, True])
def test_fp8_auto_filter_picks_the_experts_precision(moe_fp8, monkeypatch, fp8_wgrad):
    """Grouped layers: the model's FP8 choice with its wgrad precision is the layer built that way (bit for
    bit); a bf16 choice is the bf16 layer; ``--no-turbo-fp8-expert-wgrad`` fixes the wgrad for the model."""
    x = torch.randn(10, 64, dtype=torch.bfloat16, device=_device())
    counts = torch.tensor([3, 0, 7], device=_device())
    grad_out = torch.randn(10, 32, dtype=torch.bfloat16, device=_device())

    def run(layer: TurboGroupedLinear, source: TurboGroupedLinear) -> list[torch.Tensor]:
        layer.load_state_dict(source.state_dict())
        x_ = x.clone().requires_grad_()
        out, _ = layer(x_, counts)
        out.backward(grad_out)
        return [out, x_.grad, *(p.grad for p in layer.parameters())]

    monkeypatch.setattr(TurboGroupedLinear, "fp8_wgrad", fp8_wgrad)
    reference = _fp8_grouped_fc1()
    monkeypatch.setattr(TurboGroupedLinear, "fp8_wgrad", True)
    monkeypatch.setattr(TurboGroupedLinear, "fp8_auto_filter", "eager")
    calls = _force(monkeypatch, use_fp8=True, fp8_wgrad=fp8_wgrad)
    chosen = _fp8_grouped_fc1()
    assert all(
        torch.equal(a, b) for a, b in zip(run(chosen, reference), run(reference, reference), strict=True)
    )
    assert calls[0]["groups"] == 3 and calls[0]["fp8_wgrad"] is None and calls[0]["count_host"]
    _force(monkeypatch, use_fp8=False)
    bf16_choice, bf16 = _fp8_grouped_fc1(), _grouped_fc1()
    assert all(torch.equal(a, b) for a, b in zip(run(bf16_choice, bf16), run(bf16, bf16), strict=True))
    assert bf16_choice._weight_cache.value is None
    calls = _force(monkeypatch, use_fp8=True, fp8_wgrad=False)
    monkeypatch.setattr(TurboGroupedLinear, "fp8_wgrad", False)
    run(_fp8_grouped_fc1(), reference)
    assert calls[0]["fp8_wgrad"] is False


def test_patch_sets_the_fp8_auto_filter(moe_fp8):
    config = tiny_moe_config(moe_grouped_gemm=True, fp8="e4m3", fp8_recipe="tensorwise")
    turbo = PrimusTurboConfig(enable_primus_turbo=True, turbo_fp8_auto_filter="auto")
    patch = apply_primus_turbo_to_megatron(turbo, config)
    try:
        assert TurboLinear.fp8_auto_filter == TurboGroupedLinear.fp8_auto_filter == "eager"
        assert _fp8_grouped_fc1().fp8_auto_filter == "eager"
    finally:
        patch.undo()
    assert TurboLinear.fp8_auto_filter is None and TurboGroupedLinear.fp8_auto_filter is None


def test_fp8_auto_filter_compiles_without_graph_breaks(moe_fp8, monkeypatch, caplog):
    """Under torch.compile the decision runs while the graph is traced (logged there, once) and is a
    constant of the graph: fullgraph compiles, no recompile on the next call, eager results."""
    monkeypatch.setattr(TurboLinear, "fp8_auto_filter", "graph")
    monkeypatch.setattr(TurboGroupedLinear, "fp8_auto_filter", "graph")
    layer = _column(tiny_config(fp8="e4m3", fp8_recipe="tensorwise")).to(_device())
    fc1 = _fp8_grouped_fc1()
    x = torch.randn(8, 64, dtype=torch.bfloat16, device=_device())
    counts = torch.tensor([3, 0, 5], device=_device())
    with caplog.at_level("INFO", logger="primus_turbo.integrations.megatron.fp8_choice"):
        for module, args in ((layer, (x,)), (fc1, (x, counts))):
            compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
            out = compiled(*args)[0]
            with torch._dynamo.config.patch(error_on_recompile=True):
                compiled(*args)
            assert torch.equal(out, module(*args)[0])
    logged = [r.getMessage() for r in caplog.records if "auto-filter" in r.getMessage()]
    assert len(logged) == 2 and all("bf16" in line for line in logged)


def _primary_pair(recipe: str, grouped: bool):
    """(a layer with FP8 primary weights, the same layer without): 128-multiples, as blocks need."""
    from primus_turbo.pytorch.ops.fp8_primary import fp8_primary_of

    layers = []
    for fp8_param in (True, False):
        torch.manual_seed(0)
        config = tiny_moe_config(
            moe_grouped_gemm=True, fp8="e4m3", fp8_recipe=recipe, fp8_param=fp8_param, hidden_size=128
        )
        args = dict(config=config, init_method=_init, bias=False, skip_bias_add=False, is_expert=grouped)
        if grouped:
            layer = TurboColumnParallelGroupedLinear(2, 128, 256, **args)
        else:
            layer = TurboColumnParallelLinear(128, 256, gather_output=False, **args)
        layers.append(layer.to(_device()))
    return (*layers, fp8_primary_of)


@pytest.mark.parametrize("grouped", [False, True], ids=["linear", "grouped"])
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_fp8_param_reads_the_copies_the_optimizer_writes(moe_fp8, recipe, grouped):
    """``fp8_param``: the layer's FP8 copies are made on its first forward, then written by FusedAdamW's
    step and read as they are (no quantization in the forward); outputs and gradients are bit for bit
    those of quantizing the weights in the call. Any other in-place change is noticed and quantized."""
    from primus_turbo.pytorch.optim import FusedAdamW

    primary, plain, fp8_primary_of = _primary_pair(recipe, grouped)
    x = torch.randn(12, 128, dtype=torch.bfloat16, device=_device())
    args = (x, torch.tensor([5, 7], device=_device())) if grouped else (x,)
    grad_out = torch.randn(12, 256, dtype=torch.bfloat16, device=_device())

    def run(layer):
        layer.zero_grad(set_to_none=True)
        out, _ = layer(*args)
        out.backward(grad_out)
        return [out.detach()] + [p.grad.clone() for p in layer.parameters()]

    def same():
        with torch.no_grad():
            for a, b in zip(primary.parameters(), plain.parameters(), strict=True):
                assert torch.equal(a, b)
        for a, b in zip(run(primary), run(plain), strict=True):
            assert torch.equal(a, b)

    same()
    weights = list(primary.parameters())
    copies, _ = fp8_primary_of(weights[0])
    opts = FusedAdamW(primary.parameters(), lr=1e-2), torch.optim.AdamW(plain.parameters(), lr=1e-2)
    run(primary), run(plain)
    for opt in opts:
        opt.step()
    assert copies.fresh(weights) and copies.owner is opts[0]
    refreshes = []
    refresh = copies.refresh
    copies.refresh = lambda ws: (refreshes.append(1), refresh(ws))
    for a, b in zip(primary.parameters(), plain.parameters(), strict=True):
        with torch.no_grad():
            b.copy_(a)  # the step's rounding differs from torch's by an ulp here and there
    same()
    assert not refreshes  # read as the optimizer wrote them
    with torch.no_grad():
        for a, b in zip(primary.parameters(), plain.parameters(), strict=True):
            a.mul_(-2), b.mul_(-2)
    assert not copies.fresh(weights)
    same()
    assert refreshes == [1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("grouped", [False, True], ids=["linear", "grouped"])
def test_cuda_graph_reads_fp8_primary_copies_the_optimizer_rewrites(moe_fp8, grouped):
    """Captured after FusedAdamW's first step, a graph reads the FP8 copies instead of quantizing the
    weights; each later step rewrites them in place, so a replay sees the updated weights."""
    from primus_turbo.pytorch.optim import FusedAdamW

    primary, plain, _ = _primary_pair("blockwise", grouped)
    x = torch.randn(12, 128, dtype=torch.bfloat16, device=_device())
    args = (x, torch.tensor([5, 7], device=_device())) if grouped else (x,)
    opt = FusedAdamW(primary.parameters(), lr=1e-2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out, _ = primary(*args)
        out.float().sum().backward()
        opt.step()
        primary(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        captured, _ = primary(*args)
    opt.step()  # the same gradients again: new weights, new copies
    graph.replay()
    with torch.no_grad():
        for a, b in zip(primary.parameters(), plain.parameters(), strict=True):
            b.copy_(a)
        expected, _ = plain(*args)
    assert torch.equal(captured, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Megatron's distributed optimizer needs a GPU")
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_fp8_param_trains_under_megatrons_distributed_optimizer(moe_fp8, recipe):
    """Megatron's DDP and distributed optimizer (which writes the parameter buffer without the version
    counters seeing it) with ``fp8_param``: the layer quantizes its copies again on each step's first
    micro-batch, so training follows the run without ``fp8_param`` step for step."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import MegatronModule

    class Model(MegatronModule):
        def __init__(self, config):
            super().__init__(config)
            self.linear = TurboColumnParallelLinear(
                128, 256, config=config, init_method=_init, gather_output=False, bias=False,
                skip_bias_add=False, is_expert=False,
            )  # fmt: skip

        def forward(self, x):
            return self.linear(x)[0]

    x = torch.randn(16, 128, dtype=torch.bfloat16, device=_device())
    runs = []
    for fp8_param in (False, True):
        torch.manual_seed(0)
        config = tiny_config(fp8="e4m3", fp8_recipe=recipe, fp8_param=fp8_param, hidden_size=128)
        model = Model(config).to(_device())
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
        ddp = DistributedDataParallel(config, ddp_config, model)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True, use_distributed_optimizer=True), [ddp]
        )
        losses = []
        for _ in range(4):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            model.linear.is_first_microbatch = True  # as Megatron's schedule sets it each step
            loss = ddp(x).float().pow(2).mean()
            loss.backward()
            ddp.finish_grad_sync()
            optimizer.step()
            losses.append(loss.item())
        runs.append(losses)
    assert runs[0] == runs[1] and runs[0][-1] < runs[0][0]


def test_fp8_auto_filter_weighs_fc2_with_its_fp8_input(moe_fp8, monkeypatch):
    """Under the auto-filter the fused activation's FP8 output is part of fc2's choice: fc2 is asked with
    its input arriving in FP8 (the cost model leaves that quantization out), and then reads it so."""
    from primus_turbo.integrations.megatron.experts import TurboGroupedMLPWithFusedAct
    from primus_turbo.pytorch.ops import QuantizedTensor

    monkeypatch.setattr(TurboGroupedLinear, "fp8_auto_filter", "eager")
    calls = _force(monkeypatch, use_fp8=True, fp8_wgrad=True)
    config = tiny_moe_config(
        moe_grouped_gemm=True, fp8="e4m3", fp8_recipe="tensorwise", moe_ffn_hidden_size=64
    )
    experts = TurboGroupedMLPWithFusedAct(2, config).to(_device())
    inputs = []
    forward = experts.linear_fc2.forward
    monkeypatch.setattr(experts.linear_fc2, "forward", lambda a, m: (inputs.append(a), forward(a, m))[1])
    x = torch.randn(12, 64, dtype=torch.bfloat16, device=_device())
    experts(x, torch.tensor([5, 7]), torch.rand(12, device=_device()))
    assert isinstance(inputs[0], QuantizedTensor)
    fc2_calls = [c for c in calls if c["in_features"] == 64 and c["out_features"] == 64]
    assert fc2_calls and all(c["input_fp8"] for c in fc2_calls)
