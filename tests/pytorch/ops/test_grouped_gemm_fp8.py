"""FP8 grouped GEMM: forward, dgrad and wgrad SNR against a per-group fp64 reference for tensorwise
and row-wise scaling, both weight layouts and every routing kind; the per-group column quantization;
fused accumulation; the op contract and bad input."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager, PrecisionType
from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, Format, ScalingGranularity
from primus_turbo.pytorch.kernels.grouped_gemm import grouped_gemm_fp8_impl as impl
from primus_turbo.pytorch.ops import grouped_gemm_fp8
from tests.pytorch.ops.test_grouped_gemm import _group_lens, _operands, _reference
from tests.pytorch.test_utils import DEVICES, compute_snr

DEVICE = DEVICES[0]
G = ScalingGranularity
OUT_GATE = {Format.E4M3: 25.0, Format.HYBRID: 25.0, Format.E5M2: 20.0}
GRAD_GATE = {Format.E4M3: 25.0, Format.HYBRID: 20.0, Format.E5M2: 20.0}


@pytest.fixture(autouse=True)
def _reset_backends():
    GlobalBackendManager.reset()
    yield
    GlobalBackendManager.reset()


@pytest.mark.parametrize("fmt", [Format.E4M3, Format.HYBRID, Format.E5M2], ids=lambda f: f.name.lower())
@pytest.mark.parametrize("trans_b", [False, True], ids=["KN", "NK"])
@pytest.mark.parametrize("kind", ["balanced", "skewed", "empty", "one-group"])
@pytest.mark.parametrize("granularity", [G.TENSORWISE, G.ROWWISE], ids=lambda g: g.name.lower())
@pytest.mark.parametrize("backend", [BackendType.TORCH, BackendType.TRITON], ids=lambda b: b.name)
def test_forward_dgrad_wgrad_snr(backend, granularity, kind, trans_b, fmt):
    GlobalBackendManager.set_grouped_gemm_backend(backend, PrecisionType.FP8)
    lens = _group_lens(kind, 4, 16)
    a, b, grad = _operands(lens, 64, 48, trans_b, torch.bfloat16)
    config = Float8QuantConfig(format=fmt, granularity=granularity)
    out = grouped_gemm_fp8(a, b, lens, trans_b=trans_b, config=config)
    out.backward(grad)
    ref_out, ref_a, ref_b = _reference(a, b, lens, trans_b, grad)
    assert out.shape == ref_out.shape and out.dtype == torch.bfloat16
    assert compute_snr(ref_out, out) >= OUT_GATE[fmt]
    assert compute_snr(ref_a, a.grad) >= GRAD_GATE[fmt]
    for g in range(lens.shape[0]):
        if lens[g] > 0:
            assert compute_snr(ref_b[g], b.grad[g]) >= GRAD_GATE[fmt]
        else:
            assert torch.all(b.grad[g] == 0)


def test_group_column_quantization_scales_each_group_on_its_own():
    lens = torch.tensor([3, 0, 5], dtype=torch.int64, device=DEVICE)
    offs = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
    x = torch.randn(8, 6, device=DEVICE)
    x[3:] *= 100
    x[4, 2] = float("nan")
    q, scale = impl.quantize_fp8_group_columns_impl(x, offs, torch.float8_e4m3fn)
    torch.testing.assert_close(scale[0], x[:3].abs().amax(0) / 448)
    assert torch.all(scale[1] == 1)
    assert torch.isnan(scale[2, 2]) and torch.isfinite(scale[2, [0, 1, 3, 4, 5]]).all()
    assert q[:3].float().abs().amax(0).eq(448).all()


def test_megatron_fused_wgrad_accumulation():
    lens = _group_lens("skewed", 4, 16)
    a, b, grad = _operands(lens, 64, 48, True, torch.bfloat16)
    b.main_grad = torch.ones(b.shape, device=DEVICE)
    config = Float8QuantConfig(granularity=G.ROWWISE)
    grouped_gemm_fp8(a, b, lens, trans_b=True, config=config, fuse_bgrad_accum_pattern="megatron").backward(
        grad
    )
    _, _, ref_b = _reference(a, b, lens, True, grad)
    assert b.grad_added_to_main_grad
    assert compute_snr(ref_b + 1, b.main_grad) >= 25


def test_opcheck_and_compile():
    lens = _group_lens("empty", 4, 8)
    offs = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
    a, b, grad = _operands(lens, 32, 16, True, torch.float32)
    qa, qb = a.detach().to(torch.float8_e4m3fn), b.detach().to(torch.float8_e4m3fn)
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    one = torch.ones((), device=DEVICE)
    args = (qa, one, qb, torch.ones(4, 1, 1, device=DEVICE), offs, True, torch.bfloat16)
    torch.library.opcheck(impl.grouped_gemm_fp8_impl, args, test_utils=utils)
    args = (qa, torch.ones(4, 32, device=DEVICE), grad.to(torch.float8_e5m2), one, offs, torch.float32)
    torch.library.opcheck(impl.grouped_gemm_fp8_variable_k_impl, args, test_utils=utils)
    torch.library.opcheck(
        impl.quantize_fp8_group_columns_impl, (a.detach(), offs, torch.float8_e4m3fn), test_utils=utils
    )
    config = Float8QuantConfig(format=Format.HYBRID, granularity=G.ROWWISE)

    def step(a, b):
        return grouped_gemm_fp8(a, b, lens, trans_b=True, config=config).float().square().sum()

    leaves = [a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()]
    torch.compile(step, fullgraph=True, backend="aot_eager")(*leaves).backward()
    eager = [a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()]
    step(*eager).backward()
    for x, y in zip(leaves, eager, strict=True):
        assert torch.equal(x.grad, y.grad)


def test_bad_input_raises_clear_error():
    lens = _group_lens("balanced", 3, 4)
    a, b, _ = _operands(lens, 32, 16, False, torch.bfloat16)
    blockwise = Float8QuantConfig(granularity=G.BLOCKWISE, block_size=128)
    with pytest.raises(ValueError, match="TENSORWISE or ROWWISE"):
        grouped_gemm_fp8(a, b, lens, config=blockwise)
    with pytest.raises(TypeError, match="Float8QuantConfig"):
        grouped_gemm_fp8(a, b, lens, config="fp8")
    with pytest.raises(ValueError, match="groups but b has"):
        grouped_gemm_fp8(a, b, lens[:-1])


@pytest.mark.parametrize("per_column", [False, True], ids=["tensor", "per-column"])
def test_triton_variable_k_kernel(per_column):
    from primus_turbo.triton.grouped_gemm import grouped_gemm_fp8_variable_k_triton

    lens = torch.tensor([5, 0, 37, 1, 20], dtype=torch.int64, device=DEVICE)
    offs = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
    lhs = torch.randn(63, 16, device=DEVICE).to(torch.float8_e4m3fn)
    rhs = torch.randn(63, 8, device=DEVICE).to(torch.float8_e5m2)
    sl = torch.rand(5, 16, device=DEVICE) + 0.5 if per_column else torch.tensor(0.7, device=DEVICE)
    sr = torch.rand(5, 8, device=DEVICE) + 0.5 if per_column else torch.tensor(1.3, device=DEVICE)
    out = grouped_gemm_fp8_variable_k_triton(lhs, sl, rhs, sr, offs, torch.float32)
    bounds = offs.tolist()
    for g in range(5):
        left = lhs[bounds[g] : bounds[g + 1]].double() * (sl[g].double() if per_column else sl.double())
        right = rhs[bounds[g] : bounds[g + 1]].double() * (sr[g].double() if per_column else sr.double())
        # Hopper's FP8 MMA adds products in a narrower accumulator (about 14 bits below the largest
        # term) before each promotion to fp32, so the bound scales with the sum of |products|.
        bound = (left.abs().t() @ right.abs()).max().item() * 2**-12 + 1e-6
        torch.testing.assert_close(out[g].double(), left.t() @ right, rtol=0, atol=bound)
