"""RMSNorm and the fused residual variant: forward and backward against the fp64 reference, odd and
real hidden sizes, strided rows, zero rows, determinism, the op contract and bad input."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, Format, ScaleDtype, ScalingGranularity
from primus_turbo.pytorch.kernels.normalization import rmsnorm_impl as impl
from primus_turbo.pytorch.modules import RMSNorm
from primus_turbo.pytorch.ops import (
    gemm_fp8,
    rmsnorm,
    rmsnorm_fp8,
    rmsnorm_residual,
)
from tests.pytorch.test_utils import DEVICES, assert_fused_fp8_output, get_tolerances

DEVICE = DEVICES[0]
ON_GPU = DEVICE == "cuda"
SHAPES = [(5, 96), (3, 2880), (2, 7, 64), (0, 64), (1, 5120)]
if ON_GPU:
    SHAPES += [(4096, 8192), (1024, 16384), (8192, 7168)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _reference(x, gamma, eps, zero_centered, residual=None):
    s = x.double() if residual is None else x.double() + residual.double()
    w = gamma.double() + 1 if zero_centered else gamma.double()
    return s * torch.rsqrt(s.square().mean(-1, keepdim=True) + eps) * w, s


def _tensors(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(DEVICE, dtype).requires_grad_()
    gamma = (torch.rand(shape[-1], generator=gen) + 0.5).to(DEVICE, dtype).requires_grad_()
    grad = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    return x, gamma, grad


def _assert_close(actual, expected, dtype):
    tol = get_tolerances(dtype)
    # gamma's gradient sums over every row: compare relative to the reference's scale
    scale = max(expected.abs().max().item(), 1.0) if expected.numel() else 1.0
    torch.testing.assert_close(actual.double() / scale, expected / scale, **tol)


@pytest.mark.parametrize("zero_centered", [False, True], ids=["w", "1+w"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rmsnorm_forward_backward(shape, dtype, zero_centered):
    x, gamma, grad = _tensors(shape, dtype)
    y = rmsnorm(x, gamma, 1e-6, zero_centered)
    y.backward(grad)
    x64, g64 = x.detach().double().requires_grad_(), gamma.detach().double().requires_grad_()
    expected, _ = _reference(x64, g64, 1e-6, zero_centered)
    expected.backward(grad.double())
    assert y.shape == x.shape and y.dtype == dtype
    _assert_close(y, expected.detach(), dtype)
    _assert_close(x.grad, x64.grad, dtype)
    _assert_close(gamma.grad, g64.grad, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES[:3], ids=str)
def test_rmsnorm_residual_forward_backward(shape, dtype):
    x, gamma, grad = _tensors(shape, dtype)
    residual = _tensors(shape, dtype, seed=1)[0]
    y, s = rmsnorm_residual(x, residual, gamma)
    (y.float() * grad.float()).sum().add((s.float() * 2).sum()).backward()
    leaves = [t.detach().double().requires_grad_() for t in (x, residual, gamma)]
    expected_y, expected_s = _reference(*leaves[:1], leaves[2], 1e-6, False, leaves[1])
    (expected_y * grad.double()).sum().add((expected_s * 2).sum()).backward()
    _assert_close(y, expected_y.detach(), dtype)
    _assert_close(s, expected_s.detach(), dtype)
    for actual, leaf in zip((x, residual, gamma), leaves, strict=True):
        _assert_close(actual.grad, leaf.grad, dtype)


@pytest.mark.parametrize("used", ["y", "s"])
def test_rmsnorm_residual_with_one_output_unused(used):
    x, gamma, grad = _tensors((5, 96), torch.float32)
    residual = _tensors((5, 96), torch.float32, seed=1)[0]
    y, s = rmsnorm_residual(x, residual, gamma)
    ((y if used == "y" else s) * grad).sum().backward()
    leaves = [t.detach().double().requires_grad_() for t in (x, residual, gamma)]
    expected_y, expected_s = _reference(*leaves[:1], leaves[2], 1e-6, False, leaves[1])
    ((expected_y if used == "y" else expected_s) * grad.double()).sum().backward()
    _assert_close(x.grad, leaves[0].grad, torch.float32)
    _assert_close(residual.grad, leaves[1].grad, torch.float32)
    assert (gamma.grad is None) == (used == "s")


def test_strided_rows_need_no_copy():
    wide = torch.randn(6, 160, device=DEVICE)
    x = wide[:, :96]
    gamma = torch.rand(96, device=DEVICE) + 0.5
    expected, _ = _reference(x, gamma, 1e-6, False)
    _assert_close(rmsnorm(x, gamma), expected, torch.float32)


def test_module_matches_torch_rmsnorm():
    layer = RMSNorm(64, eps=1e-5, device=DEVICE)
    ref = torch.nn.RMSNorm(64, eps=1e-5, device=DEVICE)
    x = torch.randn(3, 4, 64, device=DEVICE)
    torch.testing.assert_close(layer(x), ref(x), **get_tolerances(torch.float32))
    assert "zero_centered=False" in repr(layer)
    assert torch.all(RMSNorm(8, zero_centered=True).weight == 0)


@pytest.mark.deterministic
def test_rmsnorm_backward_is_deterministic():
    x, gamma, grad = _tensors((257, 320), torch.bfloat16)
    results = []
    for _ in range(10):
        x.grad = gamma.grad = None
        rmsnorm(x, gamma).backward(grad)
        results.append((x.grad.clone(), gamma.grad.clone()))
    for dx, dgamma in results[1:]:
        assert torch.equal(dx, results[0][0]) and torch.equal(dgamma, results[0][1])


def test_opcheck_and_compile():
    x = torch.randn(6, 96, device=DEVICE)
    gamma = torch.rand(96, device=DEVICE) + 0.5
    torch.library.opcheck(impl.rmsnorm_fwd_impl, (x, gamma, 1e-6, False))
    torch.library.opcheck(impl.rmsnorm_residual_fwd_impl, (x, x.flip(0), gamma, 1e-6, True))
    y, rstd = impl.rmsnorm_fwd_impl(x, gamma, 1e-6, False)
    torch.library.opcheck(impl.rmsnorm_bwd_impl, (torch.randn_like(y), x, gamma, rstd, False))
    torch.library.opcheck(impl.rmsnorm_bwd_impl, (torch.randn_like(y), x, gamma, rstd, False, x.flip(1)))

    def step(x, r, gamma):
        y, s = rmsnorm_residual(x, r, gamma)
        return rmsnorm(y, gamma).sum() + s.sum()

    leaves = [t.clone().requires_grad_() for t in (x, x.flip(0), gamma)]
    torch.compile(step, fullgraph=True, backend="aot_eager")(*leaves).backward()
    eager = [t.clone().requires_grad_() for t in (x, x.flip(0), gamma)]
    step(*eager).backward()
    for a, b in zip(leaves, eager, strict=True):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda x, g: rmsnorm(x, g[:-1]), ValueError, "last dimension"),
        (lambda x, g: rmsnorm(x.int(), g), TypeError, "x.dtype"),
        (lambda x, g: rmsnorm(x, g[None]), ValueError, "1-D"),
        (lambda x, g: rmsnorm(x, g, eps=-1.0), ValueError, "eps"),
        (lambda x, g: rmsnorm(x, g, zero_centered=1), TypeError, "zero_centered"),
        (lambda x, g: rmsnorm_residual(x, x[:-1], g), ValueError, "residual must match"),
        (lambda x, g: rmsnorm_residual(x, x.double(), g), ValueError, "residual must match"),
    ],
)
def test_bad_input_raises_clear_error(call, error, match):
    with pytest.raises(error, match=match):
        call(torch.randn(4, 32, device=DEVICE), torch.ones(32, device=DEVICE))


FP8_BLOCK = 128 if ON_GPU else 32
FUSED_CONFIGS = {
    "tensorwise": Float8QuantConfig(),
    "rowwise": Float8QuantConfig(format=Format.HYBRID, granularity=ScalingGranularity.ROWWISE),
    "blockwise": Float8QuantConfig(
        format=Format.HYBRID, granularity=ScalingGranularity.BLOCKWISE, block_size=FP8_BLOCK
    ),
}


@pytest.mark.parametrize("columnwise", [True, False], ids=["dual", "rows"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "shape", [(6, 96), (5, 2880), (0, 64)] + ([(4096, 7168), (4096, 4096)] if ON_GPU else []), ids=str
)
@pytest.mark.parametrize("name", list(FUSED_CONFIGS))
def test_rmsnorm_fp8_equals_quantizing_the_unfused_output(name, shape, dtype, columnwise):
    if not ON_GPU and dtype == torch.float32 and shape[-1] > 1024:
        pytest.skip("a minute each under the interpreter: bf16 covers the wide rows on the CPU")
    config = FUSED_CONFIGS[name]
    x, gamma, _ = _tensors(shape, dtype)
    fused = rmsnorm_fp8(x, gamma, config, columnwise=columnwise)
    # the fused kernels may sum a row in another order than the unfused one (last-bit differences)
    assert_fused_fp8_output(fused, rmsnorm(x, gamma).detach(), config, columnwise, exact=False)


def test_rmsnorm_fp8_nonfinite_rows_get_nan_scales():
    x, gamma, _ = _tensors((6, 256), torch.bfloat16)
    x = x.detach().clone()
    x[2, 5] = float("inf")
    for name, config in FUSED_CONFIGS.items():
        fused = rmsnorm_fp8(x, gamma, config)
        assert_fused_fp8_output(fused, rmsnorm(x, gamma).detach(), config, True, exact=False)
        assert fused.scale_inv.isnan().any(), name


@pytest.mark.parametrize("name", list(FUSED_CONFIGS))
def test_rmsnorm_fp8_feeds_gemm_fp8_like_the_unfused_pair(name):
    config = FUSED_CONFIGS[name]
    x, gamma, _ = _tensors((64, 128), torch.bfloat16)
    w = (torch.randn(96, 128, device=DEVICE) * 0.1).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(64, 96, device=DEVICE).to(torch.bfloat16)
    results = []
    for fused in (True, False):
        x.grad = gamma.grad = w.grad = None
        a = rmsnorm_fp8(x, gamma, config) if fused else rmsnorm(x, gamma)
        out = gemm_fp8(a, w, trans_b=True, config=config)
        out.backward(grad)
        results.append((out, x.grad, gamma.grad, w.grad))
    for fused_value, unfused_value in zip(*results, strict=True):
        assert torch.equal(fused_value, unfused_value)


def test_rmsnorm_fp8_rows_only_serves_a_frozen_weight():
    config = FUSED_CONFIGS["rowwise"]
    x, gamma, _ = _tensors((64, 128), torch.bfloat16)
    w = (torch.randn(96, 128, device=DEVICE) * 0.1).to(torch.bfloat16)
    grad = torch.randn(64, 96, device=DEVICE).to(torch.bfloat16)
    results = []
    for a in (rmsnorm_fp8(x, gamma, config, columnwise=False), rmsnorm(x, gamma)):
        out = gemm_fp8(a, w, trans_b=True, config=config)
        results.append((out, *torch.autograd.grad(out, (x, gamma), grad)))
    (out, *grads), (unfused_out, *unfused_grads) = results
    # the forward operands may differ by an FP8 ulp (row sums); the gradients do not depend on them
    torch.testing.assert_close(out, unfused_out, **get_tolerances(torch.bfloat16))
    for fused_value, unfused_value in zip(grads, unfused_grads, strict=True):
        assert torch.equal(fused_value, unfused_value)


def test_rmsnorm_fp8_opcheck_and_bad_input():
    x = torch.randn(6, 96, device=DEVICE)
    gamma = torch.rand(96, device=DEVICE) + 0.5
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    for granularity, block in ((0, 0), (1, 0), (2, 32)):
        for columnwise in (True, False):
            args = (x, gamma, 1e-6, False, torch.float8_e4m3fn, granularity, block, columnwise)
            torch.library.opcheck(impl.rmsnorm_fp8_fwd_impl, args, test_utils=utils)
    mx = Float8QuantConfig(
        granularity=ScalingGranularity.MX_BLOCKWISE, block_size=32, scale_dtype=ScaleDtype.E8M0
    )
    with pytest.raises(ValueError, match="fuses TENSORWISE"):
        rmsnorm_fp8(x, gamma, mx)
    with pytest.raises(ValueError, match="2-D"):
        rmsnorm_fp8(x[None], gamma, FUSED_CONFIGS["rowwise"])
    with pytest.raises(TypeError, match="columnwise"):
        rmsnorm_fp8(x, gamma, FUSED_CONFIGS["rowwise"], columnwise=1)


def test_rmsnorm_fp8_into_gemm_fp8_compiles_without_graph_breaks():
    config = FUSED_CONFIGS["rowwise"]

    def step(x, gamma, w):
        return gemm_fp8(rmsnorm_fp8(x, gamma, config), w, trans_b=True, config=config).float().sum()

    leaves = [t.detach().clone().requires_grad_() for t in _tensors((64, 128), torch.bfloat16)[:2]]
    leaves.append((torch.randn(96, 128, device=DEVICE) * 0.1).to(torch.bfloat16).requires_grad_())
    torch.compile(step, fullgraph=True, backend="aot_eager")(*leaves).backward()
    eager = [t.detach().clone().requires_grad_() for t in leaves]
    step(*eager).backward()
    for a, b in zip(leaves, eager, strict=True):
        assert torch.equal(a.grad, b.grad)


def test_strided_gamma_is_read_with_its_stride():
    x = torch.randn(6, 96, device=DEVICE, requires_grad=True)
    wide = (torch.rand(192, device=DEVICE) + 0.5).requires_grad_()
    gamma = wide[::2]
    y = rmsnorm(x, gamma)
    y.sum().backward()
    expected, _ = _reference(x.detach(), gamma.detach(), 1e-6, False)
    _assert_close(y, expected, torch.float32)
    assert wide.grad[1::2].abs().sum() == 0 and wide.grad[::2].abs().sum() > 0
