"""Gated activations: forward and backward (dx, dprobs) against fp64 references, odd widths, zero rows,
masked rows, the op contract and bad input."""

from __future__ import annotations

import math

import pytest
import torch

from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, Format, ScaleDtype, ScalingGranularity
from primus_turbo.pytorch.kernels.activation import gated_act_impl as impl
from primus_turbo.pytorch.ops import (
    geglu,
    geglu_fp8,
    geglu_with_probs,
    gemm_fp8,
    swiglu,
    swiglu_fp8,
    swiglu_with_probs,
)
from tests.pytorch.test_utils import DEVICES, assert_fused_fp8_output, get_tolerances

DEVICE = DEVICES[0]
ON_GPU = DEVICE == "cuda"
SHAPES = [(7, 2 * 96), (3, 2 * 2880), (2, 2 * 3584), (2, 2 * 1536), (0, 64), (5, 2 * 1)]
if ON_GPU:
    SHAPES += [(8192, 2 * 8192), (4096, 2 * 7168)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _act(a: torch.Tensor, name: str) -> torch.Tensor:
    if name == "swiglu":
        return a * torch.sigmoid(a)
    return 0.5 * a * (1 + torch.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3)))


def _reference(x, probs, mask, name):
    a, b = x.chunk(2, dim=-1)
    out = _act(a, name) * b
    if probs is not None:
        out = out * probs[:, None]
    if mask is not None:
        out = out * mask[:, None]
    return out


def _assert_close(actual, expected, dtype):
    scale = max(expected.abs().max().item(), 1.0) if expected.numel() else 1.0
    torch.testing.assert_close(actual.double() / scale, expected / scale, **get_tolerances(dtype))


OPS = {"swiglu": (swiglu, swiglu_with_probs), "geglu": (geglu, geglu_with_probs)}


@pytest.mark.parametrize("masked", [False, True], ids=["all-rows", "masked"])
@pytest.mark.parametrize("with_probs", [False, True], ids=["plain", "probs"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", ["swiglu", "geglu"])
def test_forward_backward(name, shape, dtype, with_probs, masked):
    if masked and not with_probs:
        pytest.skip("row_mask belongs to the MoE variants")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(DEVICE, dtype).requires_grad_()
    probs = torch.rand(shape[0], generator=gen).to(DEVICE).requires_grad_() if with_probs else None
    mask = (torch.rand(shape[0], generator=gen) > 0.3).to(DEVICE) if masked else None
    grad = torch.randn(shape[0], shape[1] // 2, generator=gen).to(DEVICE, dtype)
    plain, moe = OPS[name]
    out = moe(x, probs, mask) if with_probs else plain(x)
    out.backward(grad)
    x64 = x.detach().double().requires_grad_()
    p64 = probs.detach().double().requires_grad_() if with_probs else None
    expected = _reference(x64, p64, mask.double() if masked else None, name)
    expected.backward(grad.double())
    assert out.shape == expected.shape and out.dtype == dtype
    _assert_close(out, expected.detach(), dtype)
    _assert_close(x.grad, x64.grad, dtype)
    if with_probs:
        _assert_close(probs.grad, p64.grad, torch.float32 if dtype == torch.float32 else dtype)
    if masked:
        dead = ~mask
        assert torch.all(out[dead] == 0) and torch.all(x.grad[dead] == 0) and torch.all(probs.grad[dead] == 0)


def test_all_rows_masked_is_all_zero():
    x = torch.randn(6, 64, device=DEVICE, requires_grad=True)
    probs = torch.rand(6, device=DEVICE, requires_grad=True)
    out = swiglu_with_probs(x, probs, torch.zeros(6, dtype=torch.bool, device=DEVICE))
    out.sum().backward()
    assert torch.all(out == 0) and torch.all(x.grad == 0) and torch.all(probs.grad == 0)


def test_leading_dimensions():
    x = torch.randn(2, 3, 64, device=DEVICE)
    torch.testing.assert_close(swiglu(x), _reference(x, None, None, "swiglu"))


def test_opcheck_and_compile():
    _check_opcheck_and_compile()


def test_torch_reference_under_compile(monkeypatch):
    """The TORCH path (no Triton) runs below the autograd dispatch key under compile: its backward must
    not need autograd."""
    monkeypatch.setattr(impl, "gated_act_uses_triton", lambda x: False)
    _check_opcheck_and_compile()


def _check_opcheck_and_compile():
    x = torch.randn(6, 64, device=DEVICE)
    probs = torch.rand(6, device=DEVICE)
    mask = torch.tensor([True, False, True, True, False, True], device=DEVICE)
    for args in ((x, None, None, impl.SILU), (x, probs, mask, impl.GELU_TANH)):
        torch.library.opcheck(impl.gated_act_fwd_impl, args)
        torch.library.opcheck(impl.gated_act_bwd_impl, (torch.randn(6, 32, device=DEVICE), *args))

    def step(x, probs):
        return swiglu_with_probs(x, probs, mask).square().sum() + geglu(x).sum()

    leaves = [x.clone().requires_grad_(), probs.clone().requires_grad_()]
    torch.compile(step, fullgraph=True, backend="aot_eager")(*leaves).backward()
    eager = [x.clone().requires_grad_(), probs.clone().requires_grad_()]
    step(*eager).backward()
    for a, b in zip(leaves, eager, strict=True):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda x, p, m: swiglu(x[:, :63]), ValueError, "even"),
        (lambda x, p, m: swiglu(x.int()), TypeError, "x.dtype"),
        (lambda x, p, m: swiglu_with_probs(x, p[:-1]), ValueError, "probs must be"),
        (lambda x, p, m: swiglu_with_probs(x, p, m.int()), TypeError, "row_mask.dtype"),
        (lambda x, p, m: swiglu_with_probs(x, p, m[:-1]), ValueError, "row_mask must be"),
        (lambda x, p, m: geglu_with_probs(x[None], p), ValueError, "probs must be"),
    ],
)
def test_bad_input_raises_clear_error(call, error, match):
    x = torch.randn(4, 64, device=DEVICE)
    with pytest.raises(error, match=match):
        call(x, torch.rand(4, device=DEVICE), torch.ones(4, dtype=torch.bool, device=DEVICE))


FP8_BLOCK = 128 if ON_GPU else 32
FUSED_CONFIGS = {
    "tensorwise": Float8QuantConfig(),
    "rowwise": Float8QuantConfig(format=Format.HYBRID, granularity=ScalingGranularity.ROWWISE),
    "blockwise": Float8QuantConfig(
        format=Format.HYBRID, granularity=ScalingGranularity.BLOCKWISE, block_size=FP8_BLOCK
    ),
}
FUSED_SHAPES = [(6, 2 * 96), (5, 2 * 2880), (3, 2 * 1536), (0, 64)] + ([(4096, 2 * 2048)] if ON_GPU else [])


@pytest.mark.parametrize("columnwise", [True, False], ids=["dual", "rows"])
@pytest.mark.parametrize("with_probs", [False, True], ids=["plain", "probs-mask"])
@pytest.mark.parametrize("shape", FUSED_SHAPES, ids=str)
@pytest.mark.parametrize("config_name", list(FUSED_CONFIGS))
@pytest.mark.parametrize("name", ["swiglu", "geglu"])
def test_fused_fp8_output_equals_quantizing_the_unfused_output(
    name, config_name, shape, with_probs, columnwise
):
    if not ON_GPU and name == "geglu" and shape[-1] > 4096:
        pytest.skip("a minute each under the interpreter: SwiGLU covers the wide rows on the CPU")
    config = FUSED_CONFIGS[config_name]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(DEVICE, torch.bfloat16)
    probs = torch.rand(shape[0], generator=gen).to(DEVICE) if with_probs else None
    mask = (torch.rand(shape[0], generator=gen) > 0.3).to(DEVICE) if with_probs else None
    fused_op = swiglu_fp8 if name == "swiglu" else geglu_fp8
    plain, moe = OPS[name]
    fused = fused_op(x, config, probs, mask, columnwise=columnwise)
    out = moe(x, probs, mask) if with_probs else plain(x)
    assert_fused_fp8_output(fused, out, config, columnwise)


def test_fused_fp8_nonfinite_values_get_nan_scales():
    x = torch.randn(6, 2 * 256, device=DEVICE).to(torch.bfloat16)
    x[2, 300] = float("nan")
    for name, config in FUSED_CONFIGS.items():
        fused = swiglu_fp8(x, config)
        assert_fused_fp8_output(fused, swiglu(x), config, True)
        assert fused.scale_inv.isnan().any() and fused.scale_inv_t.isnan().any(), name


@pytest.mark.parametrize("config_name", list(FUSED_CONFIGS))
def test_swiglu_fp8_feeds_gemm_fp8_like_the_unfused_pair(config_name):
    config = FUSED_CONFIGS[config_name]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2 * 128, generator=gen).to(DEVICE, torch.bfloat16).requires_grad_()
    probs = torch.rand(64, generator=gen).to(DEVICE).requires_grad_()
    w = (torch.randn(96, 128, generator=gen) * 0.1).to(DEVICE, torch.bfloat16).requires_grad_()
    grad = torch.randn(64, 96, generator=gen).to(DEVICE, torch.bfloat16)
    results = []
    for fused in (True, False):
        x.grad = probs.grad = w.grad = None
        a = swiglu_fp8(x, config, probs) if fused else swiglu_with_probs(x, probs)
        gemm_fp8(a, w, trans_b=True, config=config).backward(grad)
        results.append((x.grad, probs.grad, w.grad))
    for fused_value, unfused_value in zip(*results, strict=True):
        assert torch.equal(fused_value, unfused_value)


def test_fused_fp8_opcheck_compile_and_bad_input():
    x = torch.randn(6, 64, device=DEVICE)
    probs = torch.rand(6, device=DEVICE)
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    for granularity, block in ((0, 0), (1, 0), (2, 32)):
        for columnwise in (True, False):
            args = (x, probs, None, impl.SILU, torch.float8_e4m3fn, granularity, block, columnwise)
            torch.library.opcheck(impl.gated_act_fp8_fwd_impl, args, test_utils=utils)
    config = FUSED_CONFIGS["rowwise"]
    w = torch.randn(16, 32, device=DEVICE)

    def step(x, probs):
        return gemm_fp8(swiglu_fp8(x, config, probs), w, trans_b=True, config=config).sum()

    leaves = [x.clone().requires_grad_(), probs.clone().requires_grad_()]
    torch.compile(step, fullgraph=True, backend="aot_eager")(*leaves).backward()
    eager = [x.clone().requires_grad_(), probs.clone().requires_grad_()]
    step(*eager).backward()
    for a, b in zip(leaves, eager, strict=True):
        assert torch.equal(a.grad, b.grad)
    mx = Float8QuantConfig(
        granularity=ScalingGranularity.MX_BLOCKWISE, block_size=32, scale_dtype=ScaleDtype.E8M0
    )
    with pytest.raises(ValueError, match="fuses TENSORWISE"):
        swiglu_fp8(x, mx)
    with pytest.raises(TypeError, match="Float8QuantConfig"):
        geglu_fp8(x, "fp8")
    with pytest.raises(TypeError, match="columnwise"):
        swiglu_fp8(x, config, columnwise="yes")


def test_strided_probs_and_mask_are_read_with_their_stride():
    x = torch.randn(6, 64, device=DEVICE)
    probs = torch.rand(6, 2, device=DEVICE)[:, 0]
    mask = torch.stack([torch.tensor([True, False] * 3), torch.ones(6, dtype=torch.bool)], 1).to(DEVICE)[:, 0]
    torch.testing.assert_close(swiglu_with_probs(x, probs, mask), _reference(x, probs, mask, "swiglu"))
