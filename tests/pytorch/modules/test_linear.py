"""``Linear`` matches ``torch.nn.Linear`` forward and backward, and compiles without graph breaks."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, Format, ScalingGranularity
from primus_turbo.pytorch.modules import Float8Linear, GroupedLinear, Linear
from tests.pytorch.test_utils import DEVICES, compute_snr, get_tolerances

DEVICE = DEVICES[0]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("batch_shape", [(6,), (2, 5), (0,)])
def test_linear_matches_torch(batch_shape, dtype, bias):
    torch.manual_seed(0)
    turbo = Linear(48, 40, bias=bias, device=DEVICE, dtype=dtype)
    ref = torch.nn.Linear(48, 40, bias=bias, device=DEVICE, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(turbo.weight)
        if bias:
            ref.bias.copy_(turbo.bias)
    x = torch.randn(*batch_shape, 48, device=DEVICE, dtype=dtype, requires_grad=True)
    x_ref = x.detach().double().requires_grad_()
    out, out_ref = turbo(x), ref(x_ref)
    grad = torch.randn_like(out)
    out.backward(grad)
    out_ref.backward(grad.double())
    tol = get_tolerances(dtype)
    torch.testing.assert_close(out.double(), out_ref, **tol)
    torch.testing.assert_close(x.grad.double(), x_ref.grad, **tol)
    torch.testing.assert_close(turbo.weight.grad.double(), ref.weight.grad, **tol)
    if bias:
        torch.testing.assert_close(turbo.bias.grad.double(), ref.bias.grad, **tol)


def test_linear_init_and_errors():
    layer = Linear(16, 8)
    assert layer.weight.shape == (8, 16) and layer.bias.shape == (8,)
    assert "in_features=16" in repr(layer)
    with pytest.raises(ValueError, match="last dim of x to be 16"):
        layer(torch.randn(4, 15))
    with pytest.raises(ValueError, match="must be positive"):
        Linear(0, 8)


def test_linear_compiles_fullgraph():
    torch._dynamo.reset()
    torch.manual_seed(1)
    model = torch.nn.Sequential(Linear(32, 64, device=DEVICE), torch.nn.GELU(), Linear(64, 16, device=DEVICE))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(8, 32, device=DEVICE)
    compiled(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for got, want in zip(grads, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(got, want, **get_tolerances(torch.float32))


FP8_BLOCK = 128 if DEVICE == "cuda" else 32
FP8_CONFIGS = [
    Float8QuantConfig(),
    Float8QuantConfig(format=Format.HYBRID, granularity=ScalingGranularity.ROWWISE),
    Float8QuantConfig(format=Format.HYBRID, granularity=ScalingGranularity.BLOCKWISE, block_size=FP8_BLOCK),
]


@pytest.mark.parametrize("config", FP8_CONFIGS, ids=["tensorwise", "rowwise-hybrid", "blockwise-hybrid"])
@pytest.mark.parametrize("batch_shape", [(2, 32), (0,)])
def test_float8_linear_tracks_fp32(config, batch_shape):
    torch.manual_seed(0)
    ref = torch.nn.Linear(128, 96, device=DEVICE, dtype=torch.bfloat16)
    layer = Float8Linear.from_float(ref, config)
    assert layer.weight is ref.weight and layer.bias is ref.bias
    x = torch.randn(*batch_shape, 128, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    out = layer(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    x32 = x.detach().float().requires_grad_()
    w32 = ref.weight.detach().float().requires_grad_()
    out32 = torch.nn.functional.linear(x32, w32, ref.bias.detach().float())
    out32.backward(grad.float())
    assert out.shape == (*batch_shape, 96)
    if out.numel():
        gate = 25 if config.format is Format.E4M3 else 20
        assert compute_snr(out32, out) >= 25
        assert compute_snr(x32.grad, x.grad) >= gate
        assert compute_snr(w32.grad, ref.weight.grad) >= gate


def test_float8_linear_compiles_forward_and_backward():
    torch._dynamo.reset()
    layer = Float8Linear(2 * FP8_BLOCK, 32, device=DEVICE, dtype=torch.bfloat16, config=FP8_CONFIGS[2])
    x = torch.randn(4, 2 * FP8_BLOCK, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    compiled(x).float().sum().backward()
    grad_x, grad_w = x.grad.clone(), layer.weight.grad.clone()
    x.grad = layer.weight.grad = None
    layer(x).float().sum().backward()
    assert torch.equal(grad_x, x.grad) and torch.equal(grad_w, layer.weight.grad)
    # the dgrad contracts over 32 outputs, less than one block: the backends that need whole blocks
    # must decline it rather than return garbage
    ref_grad_x = torch.ones(4, 32, device=DEVICE) @ layer.weight.detach().float()
    assert compute_snr(ref_grad_x, grad_x) >= 20


@pytest.mark.parametrize("granularity", [ScalingGranularity.TENSORWISE, ScalingGranularity.BLOCKWISE])
def test_float8_linear_with_fp8_primary_weight(granularity):
    """``fp8_primary``: FusedAdamW's step writes the weight's FP8 copies, which the forward reads without
    quantizing; the layer computes what the plain FP8 layer computes on the same weights, bit for bit."""
    from primus_turbo.pytorch.ops.fp8_primary import fp8_primary_of
    from primus_turbo.pytorch.optim import FusedAdamW

    block = FP8_BLOCK if granularity is ScalingGranularity.BLOCKWISE else None
    config = Float8QuantConfig(granularity=granularity, block_size=block)
    torch.manual_seed(0)
    layer = Float8Linear(2 * FP8_BLOCK, FP8_BLOCK, device=DEVICE, dtype=torch.bfloat16, config=config,
                         fp8_primary=True)  # fmt: skip
    plain = Float8Linear.from_float(torch.nn.Linear(2 * FP8_BLOCK, FP8_BLOCK), config)
    plain = plain.to(device=DEVICE, dtype=torch.bfloat16)
    opt = FusedAdamW(layer.parameters(), lr=1e-2)
    x = torch.randn(8, 2 * FP8_BLOCK, device=DEVICE, dtype=torch.bfloat16)
    for _ in range(2):
        layer(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    copies, _ = fp8_primary_of(layer.weight)
    assert copies.fresh([layer.weight]) and copies.owner is opt
    with torch.no_grad():
        plain.weight.copy_(layer.weight), plain.bias.copy_(layer.bias)
    assert torch.equal(layer(x), plain(x))
    torch._dynamo.reset()  # compiled, the graph quantizes the weight itself: the same values
    assert torch.equal(torch.compile(layer, fullgraph=True, backend="aot_eager")(x), plain(x))
    with pytest.raises(ValueError, match="fp8_primary needs"):
        Linear(16, 8, fp8_primary=True)
    with pytest.raises(ValueError, match="fp8_primary needs"):
        Float8Linear(
            16, 8, config=Float8QuantConfig(granularity=ScalingGranularity.ROWWISE), fp8_primary=True
        )


def test_float8_linear_errors_and_repr():
    with pytest.raises(TypeError, match="Float8QuantConfig"):
        Linear(16, 8, quant_config="fp8")
    with pytest.raises(TypeError, match="nn.Linear"):
        Float8Linear.from_float(torch.nn.Conv1d(1, 1, 1))
    with pytest.raises(TypeError, match="Float8QuantConfig"):
        Float8Linear.from_float(torch.nn.Linear(4, 4), "fp8")
    assert "fp8=TENSORWISE/E4M3" in repr(Float8Linear(16, 8))


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_linear_matches_per_group_linear(bias):
    torch.manual_seed(0)
    layer = GroupedLinear(3, 32, 24, bias=bias, device=DEVICE)
    lens = torch.tensor([5, 0, 7], dtype=torch.int64, device=DEVICE)
    x = torch.randn(12, 32, device=DEVICE, requires_grad=True)
    out = layer(x, lens)
    bounds = [0, 5, 5, 12]
    expected = torch.cat(
        [
            torch.nn.functional.linear(
                x[bounds[g] : bounds[g + 1]], layer.weight[g], layer.bias[g] if bias else None
            )
            for g in range(3)
        ]
    )
    torch.testing.assert_close(out, expected, **get_tolerances(torch.float32))
    out.sum().backward()
    assert layer.weight.grad.shape == layer.weight.shape and torch.all(layer.weight.grad[1] == 0)
    assert "num_groups=3" in repr(layer)
    with pytest.raises(ValueError, match="positive"):
        GroupedLinear(0, 4, 4)


def test_grouped_linear_in_fp8_tracks_the_high_precision_layer():
    torch.manual_seed(0)
    config = Float8QuantConfig(format=Format.HYBRID, granularity=ScalingGranularity.ROWWISE)
    layer = GroupedLinear(3, 64, 32, device=DEVICE, dtype=torch.bfloat16, config=config)
    lens = torch.tensor([10, 0, 22], dtype=torch.int64, device=DEVICE)
    x = torch.randn(32, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    out = layer(x, lens)
    out.float().sum().backward()
    expected = torch.cat(
        [x[:10].float() @ layer.weight[0].float().t(), x[10:].float() @ layer.weight[2].float().t()]
    )
    assert compute_snr(expected, out) >= 25
    assert "fp8=ROWWISE/HYBRID" in repr(layer)
    with pytest.raises(TypeError, match="Float8QuantConfig"):
        GroupedLinear(2, 4, 4, config="fp8")
