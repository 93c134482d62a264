"""``Linear`` matches ``torch.nn.Linear`` forward and backward, and compiles without graph breaks."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.pytorch.modules import Linear
from tests.pytorch.test_utils import DEVICES, get_tolerances

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
