"""FP8 GEMM: forward and backward SNR against the fp32 reference for every granularity, format and
layout; pre-quantized operands; fused wgrad accumulation; the op contract and bad input."""

from __future__ import annotations

import itertools

import pytest
import torch

from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager, PrecisionType
from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, Format, ScaleDtype, ScalingGranularity
from primus_turbo.pytorch.kernels.gemm import gemm_fp8_impl as impl
from primus_turbo.pytorch.ops import QuantizedTensor, gemm_fp8, quantize_fp8
from tests.pytorch.test_utils import DEVICES, compute_snr

DEVICE = DEVICES[0]
ON_GPU = DEVICE == "cuda"
G = ScalingGranularity
BLOCK = 128 if ON_GPU else 32


def _config(granularity: ScalingGranularity, fmt: Format = Format.E4M3) -> Float8QuantConfig:
    if granularity is G.BLOCKWISE:
        return Float8QuantConfig(format=fmt, granularity=granularity, block_size=BLOCK)
    if granularity is G.MX_BLOCKWISE:
        return Float8QuantConfig(
            format=fmt, granularity=granularity, block_size=32, scale_dtype=ScaleDtype.E8M0
        )
    return Float8QuantConfig(format=fmt, granularity=granularity)


GRANULARITIES = list(G)
BACKENDS = [BackendType.TORCH, BackendType.TRITON] + ([BackendType.HIPBLASLT] if ON_GPU else [])
LAYOUTS = list(itertools.product([False, True], repeat=2))
# (80, 48, 64): backward contracts over M and N, which are not whole blocks on the CPU (block 32)
SHAPES = [(64, 96, 128), (96, 32, 64), (80, 48, 64)] + ([(256, 128, 384), (256, 256, 384)] if ON_GPU else [])
# real-model shapes on the GPU, in the Linear layout (the one every layer uses)
LARGE_SHAPES = [(4096, 4096, 4096), (2048, 576, 7168)] if ON_GPU else []
# SNR gates (dB): the output of E4M3 and HYBRID at 25, E5M2 at 20; gradients follow the format that
# quantized the gradient: E5M2 under HYBRID
OUT_GATE = {Format.E4M3: 25.0, Format.HYBRID: 25.0, Format.E5M2: 20.0}
GRAD_GATE = {Format.E4M3: 25.0, Format.HYBRID: 20.0, Format.E5M2: 20.0}


@pytest.fixture(autouse=True)
def _reset_backends():
    GlobalBackendManager.reset()
    yield
    GlobalBackendManager.reset()


def _operands(m, n, k, trans_a, trans_b, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn((k, m) if trans_a else (m, k), generator=gen)
    b = torch.randn((n, k) if trans_b else (k, n), generator=gen) * k**-0.5
    grad = torch.randn(m, n, generator=gen)
    return (
        a.to(DEVICE, dtype).requires_grad_(),
        b.to(DEVICE, dtype).requires_grad_(),
        grad.to(DEVICE, dtype),
    )


def _reference(a, b, trans_a, trans_b, grad):
    a32 = a.detach().float().requires_grad_()
    b32 = b.detach().float().requires_grad_()
    out = (a32.t() if trans_a else a32) @ (b32.t() if trans_b else b32)
    out.backward(grad.float())
    return out.detach(), a32.grad, b32.grad


@pytest.mark.parametrize("fmt", [Format.E4M3, Format.HYBRID, Format.E5M2], ids=lambda f: f.name.lower())
@pytest.mark.parametrize("trans_a,trans_b", LAYOUTS, ids=["NN", "NT", "TN", "TT"])
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("granularity", GRANULARITIES, ids=lambda g: g.name.lower())
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_forward_backward_snr(backend, granularity, m, n, k, trans_a, trans_b, fmt):
    _check_forward_backward(backend, granularity, m, n, k, trans_a, trans_b, fmt)


@pytest.mark.parametrize("fmt", [Format.E4M3, Format.HYBRID], ids=lambda f: f.name.lower())
@pytest.mark.parametrize("m,n,k", LARGE_SHAPES)
@pytest.mark.parametrize("granularity", GRANULARITIES, ids=lambda g: g.name.lower())
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_forward_backward_snr_model_shapes(backend, granularity, m, n, k, fmt):
    _check_forward_backward(backend, granularity, m, n, k, False, True, fmt)


def _check_forward_backward(backend, granularity, m, n, k, trans_a, trans_b, fmt):
    if granularity is G.MX_BLOCKWISE and (m % 32 or n % 32 or k % 32):
        pytest.skip("MX needs multiples of 32")
    GlobalBackendManager.set_gemm_backend(backend, PrecisionType.FP8)
    a, b, grad = _operands(m, n, k, trans_a, trans_b)
    if granularity is G.BLOCKWISE and k % BLOCK:
        with pytest.raises(ValueError, match="multiple of block_size"):
            gemm_fp8(a, b, trans_a, trans_b, config=_config(granularity, fmt))
        return
    try:
        out = gemm_fp8(a, b, trans_a, trans_b, config=_config(granularity, fmt))
    except ValueError as exc:
        if "cannot handle" not in str(exc):
            raise
        pytest.skip(f"{backend.name} does not claim this case: {exc}")
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    ref_out, ref_a, ref_b = _reference(a, b, trans_a, trans_b, grad)
    assert compute_snr(ref_out, out) >= OUT_GATE[fmt]
    try:
        out.backward(grad)
    except ValueError as exc:  # the forward is checked; a backward GEMM the pinned backend declines
        if "cannot handle" not in str(exc):
            raise
        pytest.skip(f"{backend.name} does not claim a backward GEMM of this case: {exc}")
    assert a.grad.shape == a.shape and b.grad.shape == b.shape
    assert compute_snr(ref_a, a.grad) >= GRAD_GATE[fmt]
    assert compute_snr(ref_b, b.grad) >= GRAD_GATE[fmt]


@pytest.mark.skipif(not ON_GPU, reason="cuBLASLt block scaling runs on GPUs")
@pytest.mark.parametrize("k", [128, 256, 384, 512, 1024])
@pytest.mark.parametrize(
    "a_2d,b_2d",
    [(False, True), (False, False), (True, False)],
    ids=["1x128-128x128", "1x128-1x128", "128x128-1x128"],
)
def test_hipblaslt_block_scaling_is_right_wherever_it_claims(a_2d, b_2d, k):
    """cuBLASLt misreads some block layouts without an error; every case the backend accepts must match
    the dequantized product of the same FP8 operands."""
    from primus_turbo.pytorch.core.low_precision import ScalingRecipe

    gen = torch.Generator().manual_seed(k)

    def quantized(rows: int, block_2d: bool):
        x = torch.randn(rows, k, generator=gen).to(DEVICE)
        recipe = ScalingRecipe(use_2d_block=True) if block_2d else None
        axis = None if block_2d else 1
        return quantize_fp8(
            x, torch.float8_e4m3fn, G.BLOCKWISE, block_size=128, axis=axis, scaling_recipe=recipe
        )

    (qa, sa), (qb, sb) = quantized(384, a_2d), quantized(256, b_2d)
    kwargs = dict(a=qa, a_scale=sa, b=qb, b_scale=sb, out_dtype=torch.bfloat16)
    kwargs.update(granularity=G.BLOCKWISE.value, block_size=128, a_2d=a_2d, b_2d=b_2d)
    reason = impl.HipblasltGemmFp8Backend.decline_reason(**kwargs)
    if reason is not None:
        pytest.skip(reason)
    out = impl.HipblasltGemmFp8Backend.execute(**kwargs)
    assert compute_snr(impl.TorchGemmFp8Backend.execute(**kwargs).float(), out.float()) >= 35


@pytest.mark.parametrize("granularity", [G.TENSORWISE, G.BLOCKWISE], ids=["tensorwise", "blockwise"])
def test_prequantized_weight_matches_quantizing_inside(granularity):
    config = _config(granularity)
    a, b, grad = _operands(64, 96, 128, False, True)
    kwargs = {"block_size": BLOCK, "scaling_recipe": None}
    if granularity is G.BLOCKWISE:
        from primus_turbo.pytorch.core.low_precision import ScalingRecipe

        kwargs["scaling_recipe"] = ScalingRecipe(use_2d_block=True)
    else:
        kwargs = {}
    weight = QuantizedTensor.quantize(b.detach(), torch.float8_e4m3fn, granularity, **kwargs)
    out = gemm_fp8(a, weight, trans_b=True, config=config)
    expected = gemm_fp8(a.detach(), b.detach(), trans_b=True, config=config)
    assert torch.equal(out, expected)
    out.backward(grad)
    ref_out, ref_a, _ = _reference(a, b, False, True, grad)
    assert compute_snr(ref_a, a.grad) >= 25


def test_prequantized_rowwise_weight_requantizes_for_dgrad():
    config = _config(G.ROWWISE)
    a, b, grad = _operands(64, 96, 128, False, True)
    weight = QuantizedTensor.quantize(b.detach(), torch.float8_e4m3fn, G.ROWWISE, axis=1)
    gemm_fp8(a, weight, trans_b=True, config=config).backward(grad)
    _, ref_a, _ = _reference(a, b, False, True, grad)
    assert compute_snr(ref_a, a.grad) >= 25


@pytest.mark.parametrize("granularity", GRANULARITIES, ids=lambda g: g.name.lower())
@pytest.mark.parametrize("backend", [BackendType.TORCH, BackendType.TRITON], ids=lambda b: b.name)
def test_megatron_fused_wgrad_accumulation(backend, granularity):
    if backend is BackendType.TRITON and granularity is G.MX_BLOCKWISE:
        pytest.skip("MX runs on the TORCH backend")
    GlobalBackendManager.set_gemm_backend(backend, PrecisionType.FP8)
    a, b, grad = _operands(2 * BLOCK, 3 * BLOCK, 4 * BLOCK, False, True)
    b.main_grad = torch.ones(b.shape, device=DEVICE, dtype=torch.float32)
    out = gemm_fp8(a, b, trans_b=True, config=_config(granularity), fuse_bgrad_accum_pattern="megatron")
    out.backward(grad)
    _, _, ref_b = _reference(a, b, False, True, grad)
    assert b.grad_added_to_main_grad
    assert compute_snr(ref_b + 1, b.main_grad) >= 25


@pytest.mark.parametrize("granularity", [G.TENSORWISE, G.ROWWISE, G.BLOCKWISE], ids=lambda g: g.name.lower())
def test_backends_agree_with_the_reference(granularity):
    a, b, _ = _operands(64, 96, 128, False, True)
    outs = {}
    for backend in BACKENDS:
        GlobalBackendManager.set_gemm_backend(backend, PrecisionType.FP8)
        try:
            outs[backend] = gemm_fp8(a.detach(), b.detach(), trans_b=True, config=_config(granularity))
        except ValueError as exc:
            assert "cannot handle" in str(exc)
            continue
        assert impl.GemmFp8Dispatcher.last_selected() is backend
    reference = outs.pop(BackendType.TORCH)
    assert BackendType.TRITON in outs
    for out in outs.values():
        assert compute_snr(reference.float(), out.float()) >= 35


@pytest.mark.deterministic
@pytest.mark.parametrize("granularity", GRANULARITIES, ids=lambda g: g.name.lower())
def test_deterministic(granularity):
    a, b, grad = _operands(64, 96, 128, False, True)
    results = []
    for _ in range(10):
        a.grad = b.grad = None
        out = gemm_fp8(a, b, trans_b=True, config=_config(granularity))
        out.backward(grad)
        results.append((out, a.grad, b.grad))
    for result in results[1:]:
        assert all(torch.equal(x, y) for x, y in zip(results[0], result, strict=True))


def test_opcheck():
    a, b, _ = _operands(64, 96, 128, False, True)
    qa, sa = quantize_fp8(a.detach(), torch.float8_e4m3fn, G.ROWWISE, axis=1)
    qb, sb = quantize_fp8(b.detach(), torch.float8_e4m3fn, G.ROWWISE, axis=1)
    # opcheck's schema test multiplies every input, which torch does not implement for fp8 dtypes
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    args = (qa, sa, qb, sb, torch.bfloat16, G.ROWWISE.value, 0, False, False)
    torch.library.opcheck(impl.gemm_fp8_impl, args, test_utils=utils)
    out = torch.zeros(64, 96, device=DEVICE)
    accum_args = (qa, sa, qb, sb, out, G.ROWWISE.value, 0, False, False)
    torch.library.opcheck(impl.gemm_fp8_accum_impl, accum_args, test_utils=utils)


@pytest.mark.parametrize("granularity", GRANULARITIES, ids=lambda g: g.name.lower())
def test_compiles_forward_and_backward_without_graph_breaks(granularity):
    config = _config(granularity, Format.HYBRID)

    def step(a, b):
        return gemm_fp8(a, b, trans_b=True, config=config).float().square().sum()

    a, b, _ = _operands(64, 96, 128, False, True)
    loss = torch.compile(step, fullgraph=True, backend="aot_eager")(a, b)
    loss.backward()
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    step(a2, b2).backward()
    assert torch.equal(a.grad, a2.grad) and torch.equal(b.grad, b2.grad)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda a, b: gemm_fp8(a.int(), b, trans_b=True), TypeError, "a.dtype"),
        (lambda a, b: gemm_fp8(a, b[:, :64], trans_b=True), ValueError, "inner dimensions"),
        (lambda a, b: gemm_fp8(a[None], b, trans_b=True), ValueError, "2-D"),
        (lambda a, b: gemm_fp8(a, b, trans_b=True, config="fp8"), TypeError, "Float8QuantConfig"),
        (
            lambda a, b: gemm_fp8(
                a[:, : BLOCK + 8], b[:, : BLOCK + 8], trans_b=True, config=_config(G.BLOCKWISE)
            ),
            ValueError,
            "multiple of block_size",
        ),
        (
            lambda a, b: gemm_fp8(a[:40], b, trans_b=True, config=_config(G.MX_BLOCKWISE)),
            ValueError,
            "multiples of 32",
        ),
        (
            lambda a, b: gemm_fp8(a, b, trans_b=True, fuse_bgrad_accum_pattern="megatron"),
            ValueError,
            "main_grad",
        ),
        (
            lambda a, b: gemm_fp8(
                a,
                QuantizedTensor.quantize(b, torch.float8_e4m3fn, G.TENSORWISE),
                trans_b=True,
                config=_config(G.ROWWISE),
            ),
            ValueError,
            "quantized TENSORWISE",
        ),
        (lambda a, b: gemm_fp8(a, b, trans_b=True, out_dtype=torch.int8), TypeError, "out_dtype"),
    ],
)
def test_bad_input_raises_clear_error(call, error, match):
    a, b, _ = _operands(64, 96, 256 if ON_GPU else 128, False, True)
    with pytest.raises(error, match=match):
        call(a.detach(), b.detach())


@pytest.mark.parametrize("granularity", [G.TENSORWISE, G.ROWWISE, G.BLOCKWISE], ids=lambda g: g.name.lower())
def test_triton_reuses_its_chosen_config(granularity):
    from primus_turbo.triton.gemm import gemm_fp8_kernel

    GlobalBackendManager.set_gemm_backend(BackendType.TRITON, PrecisionType.FP8)
    a, b, _ = _operands(64, 96, 128, False, True)
    # on Hopper the block-scaled forward runs the Gluon kernel, which has no autotuned config
    hopper = ON_GPU and torch.version.hip is None and torch.cuda.get_device_capability() == (9, 0)
    configs = 0 if hopper and granularity is G.BLOCKWISE else 1
    gemm_fp8_kernel._chosen.clear()
    first = gemm_fp8(a.detach(), b.detach(), trans_b=True, config=_config(granularity))
    assert len(gemm_fp8_kernel._chosen) == configs
    again = gemm_fp8(a.detach(), b.detach(), trans_b=True, config=_config(granularity))
    assert len(gemm_fp8_kernel._chosen) == configs and torch.equal(first, again)


def test_prequantized_operands_must_match_the_gemm():
    a, b, _ = _operands(64, 96, 128, False, True)
    rowwise = _config(G.ROWWISE)
    along_n = QuantizedTensor.quantize(b.detach(), torch.float8_e4m3fn, G.ROWWISE, axis=0)
    with pytest.raises(ValueError, match="along K"):
        gemm_fp8(a, along_n, trans_b=True, config=rowwise)
    # stored (K, M) for trans_a, quantized along M instead of K
    activation = QuantizedTensor.quantize(a.detach().t().contiguous(), torch.float8_e4m3fn, G.ROWWISE, axis=1)
    with pytest.raises(ValueError, match="along K"):
        gemm_fp8(activation, b, trans_a=True, trans_b=True, config=rowwise)
    other_block = QuantizedTensor.quantize(
        b.detach(), torch.float8_e4m3fn, G.BLOCKWISE, block_size=16, axis=1
    )
    with pytest.raises(ValueError, match="block_size"):
        gemm_fp8(a, other_block, trans_b=True, config=_config(G.BLOCKWISE))
    from primus_turbo.pytorch.core.low_precision import ScalingRecipe

    tiles = QuantizedTensor.quantize(
        a.detach(), torch.float8_e4m3fn, G.BLOCKWISE, block_size=BLOCK, scaling_recipe=ScalingRecipe(True)
    )
    with pytest.raises(ValueError, match="only be the weight"):
        gemm_fp8(tiles, b, trans_b=True, config=_config(G.BLOCKWISE))
