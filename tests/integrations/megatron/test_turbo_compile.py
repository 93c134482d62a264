"""torch.compile over the Turbo Megatron modules: a Llama-style block and a MoE block built from them compile
with ``fullgraph=True`` (bf16 and FP8) and match eager; Megatron's ``TransformerLayer`` built with the
Turbo spec compiles, and none of its graph breaks is in Turbo code."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from primus_turbo.integrations.megatron import (
    PrimusTurboConfig,
    apply_primus_turbo_to_megatron,
    get_gpt_layer_with_turbo_spec,
)
from primus_turbo.integrations.megatron.attention import TurboDotProductAttention
from primus_turbo.integrations.megatron.experts import TurboGroupedMLPWithFusedAct
from primus_turbo.integrations.megatron.linear import (
    TurboLayerNormColumnParallelLinear,
    TurboRowParallelLinear,
)
from primus_turbo.pytorch.ops import fused_group_topk_routing_with_aux_score, moe_permute, moe_unpermute
from tests.integrations.megatron.megatron_harness import (
    MOE_OVERRIDES,
    tiny_config,
)

BACKEND = "inductor" if torch.cuda.is_available() else "aot_eager"


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _init(w: torch.Tensor) -> None:
    nn.init.normal_(w, std=0.05)


class LlamaBlock(nn.Module):
    """Pre-norm attention and SwiGLU MLP, every op a Turbo module (as the Turbo spec builds them)."""

    def __init__(self, config) -> None:
        super().__init__()
        h, ffn = config.hidden_size, config.ffn_hidden_size
        common = dict(config=config, init_method=_init, bias=False, skip_bias_add=False, is_expert=False)
        self.heads = config.num_attention_heads
        self.qkv = TurboLayerNormColumnParallelLinear(h, 3 * h, gather_output=False, **common)
        self.attention = TurboDotProductAttention(config, 1, _causal(), "self")
        self.proj = TurboRowParallelLinear(h, h, input_is_parallel=True, **common)
        self.fc1 = TurboLayerNormColumnParallelLinear(h, 2 * ffn, gather_output=False, **common)
        self.fc2 = TurboRowParallelLinear(ffn, h, input_is_parallel=True, **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        qkv, _ = self.qkv(x)
        q, k, v = qkv.view(s, b, self.heads, 3 * h // self.heads).chunk(3, dim=-1)
        attn, _ = self.proj(self.attention(q, k, v, None, None))
        x = x + attn
        gate, up = self.fc1(x)[0].chunk(2, dim=-1)
        return x + self.fc2(F.silu(gate) * up)[0]


class MoEBlock(nn.Module):
    """RMSNorm-fused router input, Turbo's fused router, permute, Turbo grouped experts, unpermute."""

    def __init__(self, config) -> None:
        super().__init__()
        self.topk = config.moe_router_topk
        self.experts_count = config.num_moe_experts
        self.router = nn.Parameter(torch.randn(config.num_moe_experts, config.hidden_size) * 0.05)
        self.experts = TurboGroupedMLPWithFusedAct(config.num_moe_experts, config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        logits = tokens.float() @ self.router.float().t()
        probs, routing_map, _ = fused_group_topk_routing_with_aux_score(logits, self.topk)
        rows = tokens.shape[0] * self.topk
        permuted, row_id_map, counts, permuted_probs, _ = moe_permute(
            tokens, routing_map, probs, num_local_experts=self.experts_count, num_permuted_tokens=rows
        )
        out, _ = self.experts(permuted, counts, permuted_probs)
        return x + moe_unpermute(out, row_id_map).view_as(x)


def _snr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return (10 * torch.log10(ref.pow(2).sum() / (x.float() - ref).pow(2).sum().clamp_min(1e-30))).item()


def _causal():
    from megatron.core.transformer.enums import AttnMaskType

    return AttnMaskType.causal


@pytest.mark.parametrize("fp8", [None, "tensorwise"], ids=["bf16", "fp8"])
@pytest.mark.parametrize("block", ["llama", "moe"])
def test_turbo_blocks_compile_fullgraph_and_match_eager(megatron, block, fp8):
    overrides = dict(fp8="e4m3", fp8_recipe=fp8) if fp8 else {}
    if block == "moe":
        fields = dict(MOE_OVERRIDES, moe_grouped_gemm=True, **overrides)
        # megatron-core checks Transformer Engine's version for MoE FP8 configs; the patch answers for Turbo
        megatron_args = types.SimpleNamespace(**fields, normalization="RMSNorm")
        patch = apply_primus_turbo_to_megatron(PrimusTurboConfig(enable_primus_turbo=True), megatron_args)
        try:
            config = tiny_config(**fields)
        finally:
            patch.undo()
        model = MoEBlock(config)
    else:
        config = tiny_config(**overrides)
        model = LlamaBlock(config)
    model = model.to(_device(), torch.bfloat16)
    x = torch.randn(8, 2, config.hidden_size, device=_device(), dtype=torch.bfloat16, requires_grad=True)
    eager = model(x)
    eager.float().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    compiled = torch.compile(model, backend=BACKEND, fullgraph=True)
    out = compiled(x)
    out.float().sum().backward()
    for got, want in zip(
        [out] + [p.grad for p in model.parameters()] + [x.grad], [eager] + grads, strict=True
    ):
        if fp8:
            # inductor fuses the bf16 elementwise ops between GEMMs, which moves some FP8 roundings
            assert _snr_db(got, want) >= 25
        else:
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_megatron_layer_with_turbo_spec_has_no_break_in_turbo_code(megatron, moe):
    from megatron.core.transformer.spec_utils import build_module

    config = tiny_config(**(dict(MOE_OVERRIDES, moe_grouped_gemm=True) if moe else {}))
    patch = apply_primus_turbo_to_megatron(
        PrimusTurboConfig(enable_primus_turbo=True), config
    )  # Turbo dispatcher
    try:
        spec = get_gpt_layer_with_turbo_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=moe)
        layer = build_module(spec, config=config, layer_number=1).to(_device())
    finally:
        patch.undo()
    config.moe_token_dispatcher_type = "flex" if moe else config.moe_token_dispatcher_type
    x = torch.randn(8, 2, config.hidden_size, device=_device(), dtype=torch.bfloat16)
    explanation = torch._dynamo.explain(layer)(x, attention_mask=None)
    for reason in explanation.break_reasons:
        frames = [frame.filename for frame in reason.user_stack]
        assert not any("primus_turbo" in f or "integrations/megatron" in f for f in frames), reason.reason
    eager, _ = layer(x, attention_mask=None)
    compiled, _ = torch.compile(layer, backend=BACKEND)(x, attention_mask=None)
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-2)


def test_moe_layer_with_router_losses_compiles_without_a_break_at_the_losses(megatron):
    """Megatron attaches the load-balancing and z losses with an autograd.Function whose backward reads
    a class attribute, which breaks the graph; under the patch the compiled layer traces them, and the
    router's gradients match eager with the loss scale set after the forward (as Megatron's schedule does)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.spec_utils import build_module

    overrides = dict(MOE_OVERRIDES, moe_grouped_gemm=True, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
    config = tiny_config(**dict(overrides, moe_router_load_balancing_type="aux_loss"))
    saved_scale = MoEAuxLossAutoScaler.main_loss_backward_scale
    patch = apply_primus_turbo_to_megatron(PrimusTurboConfig(enable_primus_turbo=True), config)
    try:
        MoEAuxLossAutoScaler.set_loss_scale(torch.ones((), device=_device()))
        spec = get_gpt_layer_with_turbo_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=True)
        layer = build_module(spec, config=config, layer_number=1).to(_device())
        x = torch.randn(8, 2, config.hidden_size, device=_device(), dtype=torch.bfloat16)
        explanation = torch._dynamo.explain(layer)(x, attention_mask=None)
        for reason in explanation.break_reasons:  # where MoEAuxLossAutoScaler broke it: inside moe_utils
            assert not reason.user_stack[-1].filename.endswith("moe_utils.py"), reason.reason
        if torch.cuda.is_available():  # on the CPU, Megatron's router moves its weight to "the GPU"
            assert explanation.graph_break_count == 0, [r.reason for r in explanation.break_reasons]
        torch._dynamo.reset()

        grads = []  # inductor on the CPU too: aot_eager keeps the graph as traced and hides where the
        # partitioner puts the gradient's computation
        for run in (layer, torch.compile(layer, backend="inductor")):
            out, _ = run(x, attention_mask=None)
            MoEAuxLossAutoScaler.set_loss_scale(torch.full((), 0.25, device=_device()))
            (out.float().sum() * 0).backward()  # the router's gradient is then the two losses' alone
            MoEAuxLossAutoScaler.set_loss_scale(torch.ones((), device=_device()))
            grads.append(layer.mlp.router.weight.grad.clone())
            layer.zero_grad(set_to_none=True)
        # inductor sums the bf16 gradient in another order; a scale read at the wrong time is off by 4x
        error = torch.linalg.vector_norm((grads[1] - grads[0]).float())
        reference = torch.linalg.vector_norm(grads[0].float())
        assert reference > 0 and error <= 0.05 * reference
    finally:
        patch.undo()
        MoEAuxLossAutoScaler.main_loss_backward_scale = saved_scale


def test_aux_loss_scale_tracking_is_undone(megatron):
    from megatron.core.transformer.moe import router
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    original = MoEAuxLossAutoScaler.__dict__["set_loss_scale"]
    patch = apply_primus_turbo_to_megatron(PrimusTurboConfig(enable_primus_turbo=True), tiny_config())
    assert router.MoEAuxLossAutoScaler is not MoEAuxLossAutoScaler
    assert MoEAuxLossAutoScaler.__dict__["set_loss_scale"] is not original
    patch.undo()
    assert router.MoEAuxLossAutoScaler is MoEAuxLossAutoScaler
    assert MoEAuxLossAutoScaler.__dict__["set_loss_scale"] is original


@pytest.mark.parametrize("caller_thread", [True, False], ids=["caller-thread", "device-thread"])
def test_backward_thread_is_set_and_undone(megatron, caller_thread):
    """The patch keeps backward on the calling thread (unless told not to) and undo restores autograd's
    setting."""
    config = PrimusTurboConfig(enable_primus_turbo=True, turbo_backward_on_caller_thread=caller_thread)
    with torch.autograd.set_multithreading_enabled(True):
        patch = apply_primus_turbo_to_megatron(config, tiny_config())
        try:
            assert torch._C._is_multithreading_enabled() is not caller_thread
        finally:
            patch.undo()
        assert torch._C._is_multithreading_enabled()


def test_aux_loss_scale_of_the_schedule_shape_after_a_scalar_one(megatron):
    """Megatron's schedule sets a [1] scale; after a 0-dim one (its backward's default, or a caller's) the
    patched setter keeps the held tensor, which captured graphs read, and writes the new value into it."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    saved_scale = MoEAuxLossAutoScaler.main_loss_backward_scale
    patch = apply_primus_turbo_to_megatron(PrimusTurboConfig(enable_primus_turbo=True), tiny_config())
    try:
        MoEAuxLossAutoScaler.main_loss_backward_scale = None
        MoEAuxLossAutoScaler.set_loss_scale(torch.full((), 0.5))
        held = MoEAuxLossAutoScaler.main_loss_backward_scale
        MoEAuxLossAutoScaler.set_loss_scale(torch.full((1,), 0.25))
        assert MoEAuxLossAutoScaler.main_loss_backward_scale is held and held.item() == 0.25
    finally:
        patch.undo()
        MoEAuxLossAutoScaler.main_loss_backward_scale = saved_scale


@pytest.mark.parametrize("scale_shape", [(), (1,)], ids=["scalar", "one-element"])
def test_aux_loss_grad_op(scale_shape):
    """The op under the compiled scaler: Megatron's formula (a one-element scale broadcasts as in its
    ``initialize``), and the custom-op contract."""
    from primus_turbo.integrations.megatron.router import _aux_loss_grad

    grad_output = torch.randn(16, 4, device=_device(), dtype=torch.bfloat16)
    aux_loss = torch.rand((), device=_device())
    scale = torch.full(scale_shape, 0.25, device=_device())
    expected = torch.ones_like(aux_loss) * scale
    torch.testing.assert_close(_aux_loss_grad(grad_output, aux_loss, scale), expected)
    torch.library.opcheck(_aux_loss_grad, (grad_output, aux_loss, scale))


def test_aux_loss_grad_op_rejects_a_scale_of_more_than_one_element():
    from primus_turbo.integrations.megatron.router import _aux_loss_grad

    grad_output, aux_loss = torch.randn(16, 4, device=_device()), torch.rand((), device=_device())
    with pytest.raises(ValueError, match="one element"):
        _aux_loss_grad(grad_output, aux_loss, torch.ones(2, device=_device()))


def test_scaled_aux_loss_compiles_fullgraph_and_reads_the_scale_in_backward(megatron):
    """The compiled scaler and its op alone, ``fullgraph=True`` under inductor, match eager with the scale
    set between forward and backward (Megatron's order). This small graph does not show the partitioner
    moving the gradient into the forward; the MoE-layer test above does."""
    from primus_turbo.integrations.megatron.router import _ScaledAuxLoss

    scale = torch.ones((), device=_device())
    weight = torch.randn(4, 4, device=_device(), requires_grad=True)

    def step(x: torch.Tensor) -> torch.Tensor:
        y = x @ weight
        return _ScaledAuxLoss.apply(y, y.pow(2).mean(), scale).relu()

    x = torch.randn(3, 4, device=_device())
    grads = []
    for run in (step, torch.compile(step, backend="inductor", fullgraph=True)):
        out = run(x)
        scale.fill_(0.25)
        out.sum().backward()
        scale.fill_(1.0)
        grads.append(weight.grad)
        weight.grad = None
    torch.testing.assert_close(grads[1], grads[0])
