"""MXFP4: quantization against the TORCH reference bit for bit, the E2M1 grid and its ties, scale
rules and edge cases, and ``gemm_fp4`` forward/backward SNR, with the op contract and bad input."""

from __future__ import annotations

import itertools

import pytest
import torch

from primus_turbo.pytorch.core.low_precision import Float4QuantConfig, ScalingGranularity
from primus_turbo.pytorch.kernels.gemm import gemm_fp4_impl
from primus_turbo.pytorch.kernels.quantization import quantization_fp4_impl as impl
from primus_turbo.pytorch.ops import dequantize_fp4, gemm_fp4, quantize_fp4, quantize_fp4_with_trans
from tests.pytorch.test_utils import DEVICES, compute_snr

DEVICE = DEVICES[0]
FP4_GATE = 10.0
SHAPES = [(64, 128), (3, 32), (2, 5, 96)] + ([(4096, 7168)] if DEVICE == "cuda" else [])
UTILS = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")


def _input(shape, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 3).to(dtype).to(DEVICE)


def _same_bits(a, b):
    return torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_quantize_matches_reference_and_round_trips(shape, dtype):
    x = _input(shape, dtype)
    q, scale = quantize_fp4(x)
    q_ref, scale_ref = impl.quantize_fp4_reference(x.cpu())
    assert q.shape == (*shape[:-1], shape[-1] // 2) and q.dtype == impl.FP4_DTYPE
    assert scale.shape == (*shape[:-1], shape[-1] // 32) and scale.dtype == torch.float8_e8m0fnu
    assert _same_bits(q, q_ref) and _same_bits(scale, scale_ref)
    restored = dequantize_fp4(q, scale, torch.float32)
    assert compute_snr(x.float(), restored) >= FP4_GATE


def test_e2m1_grid_rounds_to_nearest_even_and_saturates():
    # amax 7 -> scale 2 ** (2 - 2) = 1, so the values below are coded as they are
    values = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.3, -2.9, 0.0, -6.0, 0.1, 1.6, 4.4, 5.9]
    x = torch.tensor(values * 2, device=DEVICE).reshape(1, 32)
    q, scale = quantize_fp4(x)
    assert scale.float().item() == 1.0
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5, -3.0, 0.0, -6.0, 0.0, 1.5, 4.0, 6.0]
    assert dequantize_fp4(q, scale, torch.float32).flatten().tolist() == expected * 2


def test_scales_are_powers_of_two_from_the_exponent():
    x = _input((64, 128), torch.float32)
    _, scale = quantize_fp4(x)
    amax = x.abs().reshape(64, 4, 32).amax(-1)
    assert torch.equal(scale.float().cpu(), torch.exp2(torch.floor(torch.log2(amax)) - 2).cpu())


def test_zero_and_nonfinite_groups():
    x = _input((4, 64), torch.float32)
    x[0] = 0
    x[1, 3] = float("nan")
    x[2, 40] = float("inf")
    q, scale = quantize_fp4(x)
    restored = dequantize_fp4(q, scale, torch.float32)
    assert scale[0].float().tolist() == [1.0, 1.0] and torch.all(restored[0] == 0)
    assert torch.isnan(scale[1, 0].float()) and torch.isnan(restored[1, :32]).all()
    assert torch.isnan(scale[2, 1].float()) and torch.isnan(restored[2, 32:]).all()
    assert torch.isfinite(restored[1, 32:]).all() and torch.isfinite(restored[3]).all()


def test_with_trans_equals_quantizing_the_transpose():
    x = _input((64, 96))
    q, s, q_t, s_t = quantize_fp4_with_trans(x)
    q_ref, s_ref = quantize_fp4(x)
    q_col, s_col = quantize_fp4(x.t().contiguous())
    assert _same_bits(q, q_ref) and _same_bits(s, s_ref)
    assert _same_bits(q_t, q_col) and _same_bits(s_t, s_col)


def test_opcheck_and_compile():
    x = _input((64, 96))
    torch.library.opcheck(impl.quantize_fp4_impl, (x,), test_utils=UTILS)
    torch.library.opcheck(impl.quantize_fp4_with_trans_impl, (x,), test_utils=UTILS)
    q, s = impl.quantize_fp4_impl(x)
    torch.library.opcheck(impl.dequantize_fp4_impl, (q, s, torch.bfloat16), test_utils=UTILS)
    q2, s2 = quantize_fp4(_input((96, 96), seed=1))
    torch.library.opcheck(gemm_fp4_impl.gemm_fp4_impl, (q, s, q2, s2, torch.bfloat16), test_utils=UTILS)

    def round_trip(x):
        return dequantize_fp4(*quantize_fp4(x), torch.float32)

    compiled = torch.compile(round_trip, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), round_trip(x))


@pytest.mark.parametrize(
    "trans_a,trans_b", list(itertools.product([False, True], repeat=2)), ids=["NN", "NT", "TN", "TT"]
)
def test_gemm_fp4_forward_backward_snr(trans_a, trans_b):
    m, n, k = 64, 96, 128
    gen = torch.Generator().manual_seed(0)
    a = torch.randn((k, m) if trans_a else (m, k), generator=gen).to(DEVICE, torch.bfloat16).requires_grad_()
    b = (torch.randn((n, k) if trans_b else (k, n), generator=gen) * k**-0.5).to(DEVICE, torch.bfloat16)
    b.requires_grad_()
    grad = torch.randn(m, n, generator=gen).to(DEVICE, torch.bfloat16)
    out = gemm_fp4(a, b, trans_a, trans_b)
    out.backward(grad)
    a32, b32 = a.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    ref = (a32.t() if trans_a else a32) @ (b32.t() if trans_b else b32)
    ref.backward(grad.float())
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    for expected, actual in ((ref, out), (a32.grad, a.grad), (b32.grad, b.grad)):
        assert compute_snr(expected, actual) >= FP4_GATE


def test_gemm_fp4_megatron_accumulation():
    a = _input((64, 128)).requires_grad_()
    b = (_input((96, 128), seed=1) * 0.1).requires_grad_()
    b.main_grad = torch.zeros(96, 128, device=DEVICE)
    gemm_fp4(a, b, trans_b=True, fuse_bgrad_accum_pattern="megatron").float().sum().backward()
    expected = torch.ones(64, 96, device=DEVICE).t() @ a.detach().float()
    assert b.grad_added_to_main_grad
    assert compute_snr(expected, b.main_grad) >= FP4_GATE


def test_gemm_fp4_compiles_forward_and_backward():
    a = _input((64, 128)).requires_grad_()
    b = (_input((96, 128), seed=1) * 0.1).requires_grad_()

    def step(a, b):
        return gemm_fp4(a, b, trans_b=True).float().square().sum()

    torch.compile(step, fullgraph=True, backend="aot_eager")(a, b).backward()
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    step(a2, b2).backward()
    assert torch.equal(a.grad, a2.grad) and torch.equal(b.grad, b2.grad)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda x: quantize_fp4(x[:, :40]), ValueError, "multiple of 32"),
        (lambda x: quantize_fp4(x, ScalingGranularity.BLOCKWISE), ValueError, "MX_BLOCKWISE only"),
        (lambda x: quantize_fp4(x, axis=0), ValueError, "last dimension"),
        (lambda x: quantize_fp4(x.int()), TypeError, "x.dtype"),
        (lambda x: quantize_fp4_with_trans(x[:40]), ValueError, "multiples of 32"),
        (lambda x: dequantize_fp4(x, x, torch.float32), TypeError, "q.dtype"),
        (lambda x: gemm_fp4(x, x[:, :96], trans_b=True), ValueError, "inner dimensions"),
        (lambda x: gemm_fp4(x[:40], x, trans_b=True), ValueError, "multiples of 32"),
        (
            lambda x: gemm_fp4(x, x, trans_b=True, config=Float4QuantConfig(use_gradient_sr=True)),
            ValueError,
            "stochastic",
        ),
        (lambda x: gemm_fp4(x, x, trans_b=True, config="fp4"), TypeError, "Float4QuantConfig"),
    ],
)
def test_bad_input_raises_clear_error(call, error, match):
    with pytest.raises(error, match=match):
        call(_input((64, 128), torch.float32))


def test_quantize_fp4_of_an_empty_last_dimension():
    q, scale = quantize_fp4(torch.randn(4, 0, device=DEVICE))
    assert q.shape == (4, 0) and scale.shape == (4, 0)
