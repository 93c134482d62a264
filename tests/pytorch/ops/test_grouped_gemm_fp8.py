"""FP8 grouped GEMM: forward, dgrad and wgrad SNR against a per-group fp64 reference for tensorwise
and row-wise scaling, both weight layouts and every routing kind; the per-group column quantization;
fused accumulation; the op contract and bad input."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager, PrecisionType
from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, Format, ScaleDtype, ScalingGranularity
from primus_turbo.pytorch.kernels.grouped_gemm import grouped_gemm_fp8_impl as impl
from primus_turbo.pytorch.kernels.grouped_gemm.group_offs_impl import compute_group_offs
from primus_turbo.pytorch.ops import grouped_gemm, grouped_gemm_fp8, quantize_fp8_experts
from tests.pytorch.ops.test_grouped_gemm import _group_lens, _operands, _reference
from tests.pytorch.test_utils import DEVICES, compute_snr

DEVICE = DEVICES[0]
G = ScalingGranularity
OUT_GATE = {Format.E4M3: 25.0, Format.HYBRID: 25.0, Format.E5M2: 20.0}
GRAD_GATE = {Format.E4M3: 25.0, Format.HYBRID: 20.0, Format.E5M2: 20.0}


BACKENDS = [BackendType.TORCH, BackendType.TRITON] + ([None] if DEVICE == "cuda" else [])


@pytest.fixture(autouse=True)
def _reset_backends():
    GlobalBackendManager.reset()
    yield
    GlobalBackendManager.reset()


@pytest.mark.parametrize("fmt", [Format.E4M3, Format.HYBRID, Format.E5M2], ids=lambda f: f.name.lower())
@pytest.mark.parametrize("trans_b", [False, True], ids=["KN", "NK"])
@pytest.mark.parametrize("kind", ["balanced", "skewed", "empty", "one-group"])
@pytest.mark.parametrize("granularity", [G.TENSORWISE, G.ROWWISE], ids=lambda g: g.name.lower())
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name if b else "DEFAULT")
def test_forward_dgrad_wgrad_snr(backend, granularity, kind, trans_b, fmt):
    """DEFAULT: the selection out of the box (on Hopper the Gluon kernel; K 64 is one partial K-block,
    N 48 a partial column tile)."""
    if backend is not None:
        GlobalBackendManager.set_grouped_gemm_backend(backend, PrecisionType.FP8)
    lens = _group_lens(kind, 4, 16)
    config = Float8QuantConfig(format=fmt, granularity=granularity)
    _check_against_reference(lens, 64, 48, trans_b, config)


@pytest.mark.skipif(
    DEVICE != "cuda" or torch.version.hip is not None or torch.cuda.get_device_capability() != (9, 0),
    reason="the Hopper default selection",
)
def test_default_selection_on_hopper():
    """TRITON (its Gluon kernel) for one contiguous [G, N, K] weight copy, torch._scaled_grouped_mm for
    K-major weights the Gluon kernel cannot describe as one [G * N, K] tensor."""
    e4m3 = torch.float8_e4m3fn
    wide = torch.randn(2, 128, 512, device="cuda").to(e4m3)
    kwargs = dict(
        a=torch.randn(256, 256, device="cuda").to(e4m3),
        a_scale=torch.ones(256, 1, device="cuda"),
        b=wide[:, :, :256].contiguous(),
        b_scale=torch.ones(2, 1, 1, device="cuda"),
        group_offs=torch.tensor([0, 100, 256], device="cuda"),
        trans_b=True,
        out_dtype=torch.bfloat16,
        block_size=0,
    )
    assert impl.GroupedGemmFp8Dispatcher.default_backend(**kwargs) is BackendType.TRITON
    kwargs["b"] = wide[:, :, :256]
    assert impl.GroupedGemmFp8Dispatcher.default_backend(**kwargs) is BackendType.HIPBLASLT


def _check_against_reference(lens, k, n, trans_b, config):
    """Forward, dgrad and per-group wgrad against the fp64 reference (zero wgrad for empty groups)."""
    a, b, grad = _operands(lens, k, n, trans_b, torch.bfloat16)
    out = grouped_gemm_fp8(a, b, lens, trans_b=trans_b, config=config)
    out.backward(grad)
    ref_out, ref_a, ref_b = _reference(a, b, lens, trans_b, grad)
    assert out.shape == ref_out.shape and out.dtype == torch.bfloat16
    assert compute_snr(ref_out, out) >= OUT_GATE[config.format]
    assert compute_snr(ref_a, a.grad) >= GRAD_GATE[config.format]
    for g in range(lens.shape[0]):
        if lens[g] > 0:
            assert compute_snr(ref_b[g], b.grad[g]) >= GRAD_GATE[config.format]
        else:
            assert torch.all(b.grad[g] == 0)


BLOCK = 128 if DEVICE == "cuda" else 32


@pytest.mark.parametrize("fmt", [Format.E4M3, Format.HYBRID], ids=lambda f: f.name.lower())
@pytest.mark.parametrize("trans_b", [False, True], ids=["KN", "NK"])
@pytest.mark.parametrize("kind", ["balanced", "skewed", "empty", "one-group"])
@pytest.mark.parametrize("backend", [BackendType.TORCH, BackendType.TRITON], ids=lambda b: b.name)
def test_blockwise_forward_dgrad_wgrad_snr(backend, kind, trans_b, fmt):
    """Group sizes that are not multiples of the block (and groups spanning several blocks)."""
    GlobalBackendManager.set_grouped_gemm_backend(backend, PrecisionType.FP8)
    lens = _group_lens(kind, 4, BLOCK + BLOCK // 2 + 3)
    config = Float8QuantConfig(format=fmt, granularity=G.BLOCKWISE, block_size=BLOCK)
    _check_against_reference(lens, 2 * BLOCK, 3 * BLOCK, trans_b, config)


@pytest.mark.parametrize("block", [32, 64])
def test_blockwise_with_blocks_the_kernels_do_not_take(block):
    """Block sizes other than the Triton kernels' 128 run on the reference path, forward and wgrad alike:
    the right gradients, not the kernel reading one scale row per 128 tokens."""
    lens = _group_lens("skewed", 4, 3 * block + 5)
    config = Float8QuantConfig(granularity=G.BLOCKWISE, block_size=block)
    _check_against_reference(lens, 4 * block, 2 * block, True, config)


def test_group_block_quantization_cuts_aligned_blocks_at_group_boundaries():
    block = 4
    lens = torch.tensor([6, 0, 3, 9], dtype=torch.int64, device=DEVICE)
    offs = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
    x = torch.randn(18, 5, device=DEVICE)
    x[9:] *= 100
    x[12, 1] = float("nan")
    q, scale = impl.quantize_fp8_group_blocks_impl(x, offs, torch.float8_e4m3fn, block)
    assert scale.shape == (-(-18 // block) + 4, 5)
    # blocks of 4 tokens aligned to multiples of 4, cut where groups end: group 0 -> rows 0-3, 4-5;
    # group 2 -> 6-7, 8; group 3 -> 9-11, 12-15, 16-17
    expected_rows = [(0, 4), (4, 6), (6, 8), (8, 9), (9, 12), (12, 16), (16, 18)]
    for i, (lo, hi) in enumerate(expected_rows):
        if i == 5:
            assert torch.isnan(scale[i, 1]) and torch.isfinite(scale[i, [0, 2, 3, 4]]).all()
            continue
        torch.testing.assert_close(scale[i], x[lo:hi].abs().amax(0) / 448)
    assert torch.all(scale[len(expected_rows) :] == 1)
    assert q[9:12, 0].float().abs().max() == 448


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


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("kind", ["balanced", "skewed", "empty", "one-group"])
def test_group_quantization_kernels_match_the_reference(kind, fp8_dtype):
    """Both wgrad-operand quantizations equal their torch references bit for bit (NaN, inf, zero
    columns, empty groups, blocks cut short by a group's end) and store their output token-major, rows
    padded to 16 bytes for TMA."""
    lens = _group_lens(kind, 4, BLOCK // 2 + 3)
    offs = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
    tokens = int(lens.sum())
    gen = torch.Generator().manual_seed(7)
    wide = (torch.randn(tokens, 200, generator=gen) * 10).to(torch.bfloat16).to(DEVICE)
    x = wide[:, :160]  # strided rows
    x[:, 5] = 0
    if tokens > 3:
        x[1, 2], x[tokens - 2, 150] = float("nan"), float("inf")
    cases = [
        (impl.quantize_fp8_group_columns_impl, impl.group_columns_reference, (x, offs, fp8_dtype)),
        (impl.quantize_fp8_group_blocks_impl, impl.group_blocks_reference, (x, offs, fp8_dtype, BLOCK)),
    ]
    for op, reference, args in cases:
        q, scale = op(*args)
        q_ref, scale_ref = reference(*args)
        assert q.shape == x.shape and q.stride() == (1, -(-tokens // 16) * 16)  # rows padded to 16 bytes
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
        torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("granularity", [G.TENSORWISE, G.ROWWISE, G.BLOCKWISE], ids=lambda g: g.name.lower())
@pytest.mark.parametrize("trans_b", [True, False], ids=["trans_b", "no_trans_b"])
def test_expert_weights_are_quantized_along_each_reduction(granularity, trans_b):
    """The forward's FP8 copy of the expert weights has K contiguous and the input gradient's N (what FP8
    tensor cores read); 2-D block and tensorwise scales serve both, so the two hold the same bytes."""
    block = 32
    b = torch.randn(3, 2 * block, 3 * block, device=DEVICE, dtype=torch.bfloat16)
    config = Float8QuantConfig(
        granularity=granularity, block_size=block if granularity is G.BLOCKWISE else None
    )
    made = quantize_fp8_experts(b, config, trans_b=trans_b)
    k_axis = 2 if trans_b else 1
    for (q, scale), axis in ((made.forward, k_axis), (made.dgrad, 3 - k_axis)):
        assert q.shape == b.shape and q.stride(axis) == 1
        if granularity is G.BLOCKWISE:
            scale = impl.expand_scale(scale, b.shape, G.BLOCKWISE.value, block, 2, True)
        assert compute_snr(b.float(), q.float() * scale) >= 25
    if granularity is not G.ROWWISE:
        forward, dgrad = made.forward[0].contiguous(), made.dgrad[0].contiguous()
        assert torch.equal(forward.view(torch.uint8), dgrad.view(torch.uint8))


@pytest.mark.parametrize("granularity", [G.TENSORWISE, G.ROWWISE, G.BLOCKWISE], ids=lambda g: g.name.lower())
def test_prequantized_experts_give_the_same_results(granularity):
    """``b_quantized`` (weights quantized once, reused across micro-batches) changes nothing: the same
    output and gradients, bit for bit, the weight gradient still reaching ``b``."""
    lens = _group_lens("skewed", 4, 16)
    a, b, grad = _operands(lens, 64, 64, True, torch.bfloat16)
    config = Float8QuantConfig(granularity=granularity, block_size=32 if granularity is G.BLOCKWISE else None)
    results = []
    for b_quantized in (None, quantize_fp8_experts(b.detach(), config, trans_b=True)):
        a_, b_ = a.detach().requires_grad_(), b.detach().requires_grad_()
        out = grouped_gemm_fp8(a_, b_, lens, trans_b=True, config=config, b_quantized=b_quantized)
        out.backward(grad)
        results.append((out, a_.grad, b_.grad))
    for plain, cached in zip(*results, strict=True):
        assert torch.equal(plain, cached)


@pytest.mark.parametrize("kind", ["skewed", "empty"])
@pytest.mark.parametrize("fmt", [Format.E4M3, Format.HYBRID], ids=lambda f: f.name.lower())
def test_fp8_tokens_from_the_fused_activation_give_the_same_results(kind, fmt):
    """Tensorwise: fc2 reading ``swiglu_fp8``'s FP8 rows (and its transposed copy in the weight gradient)
    computes what quantizing ``swiglu_with_probs``'s bf16 output in the GEMM computes, bit for bit, the
    gradients reaching fc1's output, the probabilities and the weights."""
    from primus_turbo.pytorch.ops import swiglu_fp8, swiglu_with_probs

    lens = _group_lens(kind, 4, 16)
    tokens = int(lens.sum())
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(tokens, 128, generator=gen).to(torch.bfloat16).to(DEVICE)
    probs = torch.rand(tokens, generator=gen).to(DEVICE)
    b = (torch.randn(4, 48, 64, generator=gen) * 0.1).to(torch.bfloat16).to(DEVICE)
    grad = torch.randn(tokens, 48, generator=gen).to(torch.bfloat16).to(DEVICE)
    config = Float8QuantConfig(format=fmt)
    results = []
    for fused in (False, True):
        h_, p_, b_ = (t.detach().requires_grad_() for t in (h, probs, b))
        act = swiglu_fp8(h_, config, p_) if fused else swiglu_with_probs(h_, p_)
        out = grouped_gemm_fp8(act, b_, lens, trans_b=True, config=config)
        out.backward(grad)
        results.append((out, h_.grad, p_.grad, b_.grad))
    for plain, fused in zip(*results, strict=True):
        assert torch.equal(plain, fused)


def test_fp8_tokens_bad_input():
    from primus_turbo.pytorch.ops import QuantizedTensor, quantize_fp8

    lens = _group_lens("balanced", 2, 8)
    a, b, _ = _operands(lens, 64, 64, True, torch.bfloat16)
    rows = QuantizedTensor.quantize(a.detach(), torch.float8_e4m3fn, G.ROWWISE, axis=1)
    with pytest.raises(ValueError, match="TENSORWISE scaling only"):
        grouped_gemm_fp8(rows, b, lens, trans_b=True, config=Float8QuantConfig(granularity=G.ROWWISE))
    q, s = quantize_fp8(a.detach(), torch.float8_e5m2, G.TENSORWISE)
    with pytest.raises(TypeError, match="a.data must be"):
        grouped_gemm_fp8(QuantizedTensor(q, s, G.TENSORWISE), b, lens, trans_b=True)
    q, s = quantize_fp8(a.detach(), torch.float8_e4m3fn, G.TENSORWISE)
    with pytest.raises(ValueError, match="needs the high-precision a"):
        grouped_gemm_fp8(QuantizedTensor(q, s, G.TENSORWISE), b, lens, trans_b=True, fp8_wgrad=False)
    out = grouped_gemm_fp8(QuantizedTensor(q, s, G.TENSORWISE), b.detach(), lens, trans_b=True)
    assert out.shape == (a.shape[0], 64) and not out.requires_grad  # forward only: nothing to differentiate


def test_prequantized_experts_must_match_the_call():
    lens = _group_lens("balanced", 2, 8)
    a, b, _ = _operands(lens, 64, 64, True, torch.bfloat16)
    config = Float8QuantConfig(granularity=G.ROWWISE)
    made = quantize_fp8_experts(b.detach(), config, trans_b=True)
    with pytest.raises(ValueError, match="b_quantized was made for"):
        grouped_gemm_fp8(a, b, lens, trans_b=False, config=config, b_quantized=made)
    with pytest.raises(ValueError, match="b_quantized was made for"):
        grouped_gemm_fp8(a, b, lens, trans_b=True, config=Float8QuantConfig(), b_quantized=made)
    with pytest.raises(TypeError, match="QuantizedExperts"):
        grouped_gemm_fp8(a, b, lens, trans_b=True, config=config, b_quantized=made.forward)


@pytest.mark.parametrize("trans_b", [False, True], ids=["KN", "NK"])
@pytest.mark.parametrize("granularity", [G.TENSORWISE, G.ROWWISE, G.BLOCKWISE], ids=lambda g: g.name.lower())
def test_high_precision_wgrad_is_the_bf16_wgrad(granularity, trans_b):
    """``fp8_wgrad=False``: the output and input gradient are the FP8 ones bit for bit, the weight gradient
    is ``grouped_gemm``'s (unquantized operands) bit for bit, plain and accumulated into ``main_grad``."""
    lens = _group_lens("skewed", 4, 16)
    a, b, grad = _operands(lens, 64, 64, trans_b, torch.bfloat16)
    config = Float8QuantConfig(granularity=granularity, block_size=32 if granularity is G.BLOCKWISE else None)

    def run(fp8_wgrad, accum=None):
        a_, b_ = a.detach().requires_grad_(), b.detach().requires_grad_()
        if accum:
            b_.main_grad = torch.ones(b.shape, device=DEVICE)
        kwargs = dict(trans_b=trans_b, config=config, fuse_bgrad_accum_pattern=accum)
        out = grouped_gemm_fp8(a_, b_, lens, fp8_wgrad=fp8_wgrad, **kwargs)
        out.backward(grad)
        return out, a_.grad, b_.main_grad if accum else b_.grad

    fp8, high = run(True), run(False)
    assert torch.equal(fp8[0], high[0]) and torch.equal(fp8[1], high[1])
    a_, b_ = a.detach(), b.detach().requires_grad_()
    grouped_gemm(a_, b_, lens, trans_b=trans_b).backward(grad)
    assert torch.equal(high[2], b_.grad)
    assert compute_snr(high[2].float(), fp8[2].float()) >= 20
    b_.main_grad = torch.ones(b.shape, device=DEVICE)
    grouped_gemm(a_, b_, lens, trans_b=trans_b, fuse_bgrad_accum_pattern="megatron").backward(grad)
    assert torch.equal(run(False, "megatron")[2], b_.main_grad)


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


def test_megatron_fused_accumulation_compiles_like_eager():
    """The accumulating wgrad op under ``fullgraph=True``: the same gradients and main_grad as eager."""
    lens = _group_lens("skewed", 4, 16)
    a, b, _ = _operands(lens, 64, 48, True, torch.bfloat16)
    config = Float8QuantConfig(granularity=G.ROWWISE)

    def step(a, b):
        out = grouped_gemm_fp8(a, b, lens, trans_b=True, config=config, fuse_bgrad_accum_pattern="megatron")
        return out.float().square().sum()

    results = []
    for fn in (torch.compile(step, fullgraph=True, backend="aot_eager"), step):
        leaves = [a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()]
        leaves[1].main_grad = torch.ones(b.shape, device=DEVICE)
        fn(*leaves).backward()
        results.append((leaves[0].grad, leaves[1].main_grad))
    for compiled, eager in zip(*results, strict=True):
        assert torch.equal(compiled, eager)


def _assert_compiled_step_matches_eager(a, b, lens, config, fp8_wgrad=True):
    """A ``fullgraph=True`` compiled forward + backward gives the eager gradients bit for bit."""

    def step(a, b):
        out = grouped_gemm_fp8(a, b, lens, trans_b=True, config=config, fp8_wgrad=fp8_wgrad)
        return out.float().square().sum()

    leaves = [a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()]
    torch.compile(step, fullgraph=True, backend="aot_eager")(*leaves).backward()
    eager = [a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()]
    step(*eager).backward()
    for x, y in zip(leaves, eager, strict=True):
        assert torch.equal(x.grad, y.grad)


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
    accum = (*args[:5], torch.zeros(4, 32, 16, device=DEVICE))
    torch.library.opcheck(impl.grouped_gemm_fp8_variable_k_accum_impl, accum, test_utils=utils)
    torch.library.opcheck(
        impl.quantize_fp8_group_columns_impl, (a.detach(), offs, torch.float8_e4m3fn), test_utils=utils
    )
    torch.library.opcheck(impl.transpose_last_two_impl, (qb,), test_utils=utils)
    torch.library.opcheck(impl.transpose_last_two_impl, (a.detach()[:, :16],), test_utils=utils)
    for granularity in (G.TENSORWISE, G.ROWWISE):
        config = Float8QuantConfig(format=Format.HYBRID, granularity=granularity)
        _assert_compiled_step_matches_eager(a, b, lens, config)


def test_blockwise_opcheck_and_compile():
    lens = _group_lens("empty", 4, BLOCK // 2 + 5)
    offs = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
    a, b, grad = _operands(lens, 2 * BLOCK, BLOCK, True, torch.float32)
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    qa, qb = a.detach().to(torch.float8_e4m3fn), b.detach().to(torch.float8_e4m3fn)
    sa = torch.rand(a.shape[0], 2, device=DEVICE) + 0.5
    sb = torch.rand(4, 1, 2, device=DEVICE) + 0.5
    args = (qa, sa, qb, sb, offs, True, torch.bfloat16, BLOCK)
    torch.library.opcheck(impl.grouped_gemm_fp8_impl, args, test_utils=utils)
    quantized = (a.detach(), offs, torch.float8_e4m3fn, BLOCK)
    torch.library.opcheck(impl.quantize_fp8_group_blocks_impl, quantized, test_utils=utils)
    ql, sl = impl.quantize_fp8_group_blocks_impl(*quantized)
    qr, sr = impl.quantize_fp8_group_blocks_impl(grad, offs, torch.float8_e5m2, BLOCK)
    args = (ql, sl, qr, sr, offs, torch.float32, BLOCK)
    torch.library.opcheck(impl.grouped_gemm_fp8_variable_k_impl, args, test_utils=utils)
    # the backward's path: the block layout computed once and passed to the quantizers and the GEMM
    ends, base = impl.group_block_layout(offs, BLOCK)
    given = impl.quantize_fp8_group_blocks_impl(*quantized, ends)
    torch.library.opcheck(impl.quantize_fp8_group_blocks_impl, (*quantized, ends), test_utils=utils)
    assert torch.equal(given[0].view(torch.uint8), ql.view(torch.uint8)) and torch.equal(given[1], sl)
    torch.library.opcheck(impl.grouped_gemm_fp8_variable_k_impl, (*args, base), test_utils=utils)
    accum = (ql, sl, qr, sr, offs, torch.zeros(4, ql.shape[1], qr.shape[1], device=DEVICE), BLOCK, base)
    torch.library.opcheck(impl.grouped_gemm_fp8_variable_k_accum_impl, accum, test_utils=utils)
    config = Float8QuantConfig(format=Format.HYBRID, granularity=G.BLOCKWISE, block_size=BLOCK)
    _assert_compiled_step_matches_eager(a, b, lens, config)
    _assert_compiled_step_matches_eager(a, b, lens, config, fp8_wgrad=False)


def test_autotune_times_balanced_groups_and_keys_by_shape_class():
    """The FP8 dispatcher, like the bf16 ones, times candidates on evenly split groups of the call's
    tokens and shares results across routings and batch sizes of one power of two."""
    lens = _group_lens("skewed", 4, 40)
    offs = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
    tokens = int(lens.sum())
    qa = torch.zeros(tokens, 32, device=DEVICE).to(torch.float8_e4m3fn)
    qb = torch.zeros(4, 16, 32, device=DEVICE).to(torch.float8_e4m3fn)
    one = torch.ones((), device=DEVICE)
    kwargs = dict(a=qa, a_scale=one, b=qb, b_scale=one, group_offs=offs, trans_b=True)
    tuned = impl.GroupedGemmFp8Dispatcher.tuning_kwargs({**kwargs, "out_dtype": torch.bfloat16})
    expected = torch.div(torch.arange(5, device=DEVICE) * tokens, 4, rounding_mode="floor")
    assert torch.equal(tuned["group_offs"], expected) and tuned["a"] is qa
    shape_class = 1 << (tokens - 1).bit_length()
    keys = {
        impl.GroupedGemmFp8Dispatcher.make_key(
            **{**kwargs, "a": torch.zeros(rows, 32, device=DEVICE)}, out_dtype=torch.bfloat16, block_size=0
        )
        for rows in (tokens, shape_class, shape_class // 2 + 1)
    }
    assert len(keys) == 1


def test_bad_input_raises_clear_error():
    lens = _group_lens("balanced", 3, 4)
    a, b, _ = _operands(lens, 32, 16, False, torch.bfloat16)
    blockwise = Float8QuantConfig(granularity=G.BLOCKWISE, block_size=128)
    with pytest.raises(ValueError, match="multiples of block_size"):
        grouped_gemm_fp8(a, b, lens, config=blockwise)
    mx = Float8QuantConfig(granularity=G.MX_BLOCKWISE, block_size=32, scale_dtype=ScaleDtype.E8M0)
    with pytest.raises(ValueError, match="TENSORWISE, ROWWISE or BLOCKWISE"):
        grouped_gemm_fp8(a, b, lens, config=mx)
    with pytest.raises(TypeError, match="Float8QuantConfig"):
        grouped_gemm_fp8(a, b, lens, config="fp8")
    with pytest.raises(TypeError, match="fp8_wgrad must be a bool"):
        grouped_gemm_fp8(a, b, lens, fp8_wgrad="no")
    with pytest.raises(ValueError, match="groups but b has"):
        grouped_gemm_fp8(a, b, lens[:-1])
    with pytest.raises(ValueError, match="2-D or 3-D"):
        impl.transpose_last_two_impl(torch.zeros(2, 3, 4, 5, device=DEVICE))


def test_triton_block_kernels_match_the_reference():
    """The Triton forward and variable-K kernels in block mode against the TORCH reference paths: groups
    of 0 to 6 token blocks (odd and even counts, partial first and last blocks)."""
    from primus_turbo.triton.grouped_gemm import (
        grouped_fp8_scale_block,
        grouped_gemm_fp8_triton,
        grouped_gemm_fp8_variable_k_triton,
    )

    block = grouped_fp8_scale_block()
    lens = torch.tensor([block + 5, 0, 2 * block, 7, 5 * block + 9], dtype=torch.int64, device=DEVICE)
    groups = len(lens)
    offs = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
    tokens, k, n = int(lens.sum()), 2 * block, 3 * block
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(tokens, k, generator=gen).to(DEVICE).to(torch.float8_e4m3fn)
    b = torch.randn(groups, n, k, generator=gen).to(DEVICE).to(torch.float8_e4m3fn)
    sa = (torch.rand(tokens, k // block, generator=gen) + 0.5).to(DEVICE)
    sb = (torch.rand(groups, n // block, k // block, generator=gen) + 0.5).to(DEVICE)
    args = (a, sa, b, sb, offs, True, torch.float32)
    out = grouped_gemm_fp8_triton(*args, block)
    ref = impl.TorchGroupedGemmFp8Backend.execute(*args, block_size=block)
    assert compute_snr(ref, out) >= 60
    rows = impl.group_block_count(tokens, groups, block)
    sl = (torch.rand(rows, k, generator=gen) + 0.5).to(DEVICE)
    grad = torch.randn(tokens, n, generator=gen).to(DEVICE).to(torch.float8_e5m2)
    sr = (torch.rand(rows, n, generator=gen) + 0.5).to(DEVICE)
    base = impl.group_block_base(offs, block)
    wgrad = grouped_gemm_fp8_variable_k_triton(a, sl, grad, sr, offs, torch.float32, base)
    token_rows, _ = impl.group_block_rows(offs, tokens, block)
    left, right = a.double() * sl[token_rows].double(), grad.double() * sr[token_rows].double()
    bounds = offs.tolist()
    for g in range(groups):
        expected = left[bounds[g] : bounds[g + 1]].t() @ right[bounds[g] : bounds[g + 1]]
        if lens[g] == 0:
            assert torch.all(wgrad[g] == 0)
        else:
            assert compute_snr(expected, wgrad[g]) >= 60


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
    main_grad = torch.randn(5, 16, 8, device=DEVICE)
    accumulated = main_grad.clone()
    grouped_gemm_fp8_variable_k_triton(lhs, sl, rhs, sr, offs, torch.float32, out=accumulated)
    torch.testing.assert_close(accumulated, main_grad + out, rtol=1e-6, atol=1e-6)
    bounds = offs.tolist()
    for g in range(5):
        left = lhs[bounds[g] : bounds[g + 1]].double() * (sl[g].double() if per_column else sl.double())
        right = rhs[bounds[g] : bounds[g + 1]].double() * (sr[g].double() if per_column else sr.double())
        # Hopper's FP8 MMA adds products in a narrower accumulator (about 14 bits below the largest
        # term) before each promotion to fp32, so the bound scales with the sum of |products|.
        bound = (left.abs().t() @ right.abs()).max().item() * 2**-12 + 1e-6
        torch.testing.assert_close(out[g].double(), left.t() @ right, rtol=0, atol=bound)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("granularity", [G.TENSORWISE, G.ROWWISE, G.BLOCKWISE], ids=lambda g: g.name.lower())
def test_cuda_graph_capture_and_replay(granularity):
    """The whole FP8 step (quantizations, forward, dgrad, wgrad) replays from a CUDA graph: nothing on
    the path reads group sizes on the host."""
    lens = _group_lens("skewed", 4, 200)
    a, b, grad = _operands(lens, 256, 128, True, torch.bfloat16)
    block = 128 if granularity is G.BLOCKWISE else None
    config = Float8QuantConfig(granularity=granularity, block_size=block)
    static_a = a.detach().clone().requires_grad_()
    grouped_gemm_fp8(static_a, b, lens, trans_b=True, config=config).backward(grad)  # compile outside
    static_a.grad = b.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = grouped_gemm_fp8(static_a, b, lens, trans_b=True, config=config)
        static_out.backward(grad)
    fresh = torch.randn_like(a)
    with torch.no_grad():
        static_a.copy_(fresh)
    graph.replay()
    expected_a = fresh.detach().clone().requires_grad_()
    expected_b = b.detach().clone().requires_grad_()
    expected = grouped_gemm_fp8(expected_a, expected_b, lens, trans_b=True, config=config)
    expected.backward(grad)
    torch.testing.assert_close(static_out, expected, rtol=0, atol=0)
    torch.testing.assert_close(static_a.grad, expected_a.grad, rtol=0, atol=0)
    torch.testing.assert_close(b.grad, expected_b.grad, rtol=0, atol=0)


@pytest.mark.parametrize(
    "quantize,launch",
    [("columns", (128, 64, 8)), ("columns", (16, 128, 4)), ("blocks", (128, 8)), ("blocks", (64, 4))],
    ids=str,
)
def test_group_quantizer_launch_overrides_give_the_same_bits(quantize, launch):
    """The tuning sweep's launch overrides change only the speed of the wgrad-operand quantizers."""
    from primus_turbo.triton.grouped_gemm import (
        quantize_fp8_group_blocks_triton,
        quantize_fp8_group_columns_triton,
    )

    lens = torch.tensor([0, 70, 130, 3], dtype=torch.int64, device=DEVICE)
    offs = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
    x = torch.randn(int(lens.sum()), 320, device=DEVICE, dtype=torch.bfloat16)
    e4m3 = torch.float8_e4m3fn
    if quantize == "columns":
        outputs = [quantize_fp8_group_columns_triton(x, offs, e4m3, c) for c in (None, launch)]
    else:
        ends = impl.group_block_layout(offs, 128)[0]
        count = impl.group_block_count(x.shape[0], lens.numel(), 128)
        outputs = [
            quantize_fp8_group_blocks_triton(x, offs, ends, e4m3, 128, count, c) for c in (None, launch)
        ]
    (q0, s0), (q1, s1) = outputs
    assert torch.equal(q0.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s0, s1)


def test_two_gemms_on_one_routing_share_the_block_layout(monkeypatch):
    """fc1's and fc2's blockwise backwards (two wgrad quantizers and the wgrad GEMM each) make the offsets
    and the scale-block layout of their shared group counts once."""
    made = []
    layout = impl._block_layout
    monkeypatch.setattr(impl, "_block_layout", lambda offs, block: made.append(block) or layout(offs, block))
    config = Float8QuantConfig(granularity=G.BLOCKWISE, block_size=BLOCK)
    lens = _group_lens("skewed", 4, BLOCK + 5).to(DEVICE)
    x = torch.randn(int(lens.sum()), 2 * BLOCK, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    w1 = torch.randn(4, 2 * BLOCK, 2 * BLOCK, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    w2 = torch.randn(4, 2 * BLOCK, 2 * BLOCK, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    hidden = grouped_gemm_fp8(x, w1, lens, trans_b=True, config=config)
    grouped_gemm_fp8(hidden, w2, lens, trans_b=True, config=config).sum().backward()
    assert made == [BLOCK]
    lens.add_(0)  # new counts (a new version): a new layout
    grouped_gemm_fp8(x, w1, lens, trans_b=True, config=config).sum().backward()
    assert made == [BLOCK, BLOCK]
    assert compute_group_offs(lens) is compute_group_offs(lens)


@pytest.mark.parametrize("shape", [(3, 160, 96), (2, 256, 128), (1, 1, 300)], ids=str)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_tensorwise_expert_copies_in_one_read_match_the_row_quantization(shape, in_dtype, monkeypatch):
    """``quantize_fp8_experts_tensorwise``: each expert's one-scale copy and its transpose, bit for bit the
    row quantization of the [G, X * Y] view and a transposed copy (a NaN poisons only its expert), on
    the one-read tile path and the reference path alike; the op passes opcheck."""
    from primus_turbo.pytorch.kernels.quantization.quantization_impl import quantize_fp8_reference

    b = torch.randn(shape, dtype=in_dtype, device=DEVICE)
    if shape[0] > 1:
        b[1, 0, 3] = float("nan")
    flat_q, flat_s = quantize_fp8_reference(
        b.reshape(shape[0], -1), torch.float8_e4m3fn, ScalingGranularity.ROWWISE.value, 0, 1, False
    )
    expected = flat_q.view(shape)
    results = [impl.quantize_fp8_experts_tensorwise_impl(b, torch.float8_e4m3fn)]
    monkeypatch.setattr(impl, "fp8_triton_usable", lambda *_: False)
    results.append(impl.quantize_fp8_experts_tensorwise_impl(b, torch.float8_e4m3fn))
    for q, q_t, scale in results:
        assert q_t.is_contiguous() and q_t.shape == (shape[0], shape[2], shape[1])
        assert torch.equal(q.view(torch.uint8), expected.view(torch.uint8))
        assert torch.equal(q_t.view(torch.uint8), expected.transpose(1, 2).contiguous().view(torch.uint8))
        torch.testing.assert_close(scale.flatten(), flat_s.flatten(), rtol=0, atol=0, equal_nan=True)
    monkeypatch.undo()
    torch.library.opcheck(impl.quantize_fp8_experts_tensorwise_impl, (b.nan_to_num(), torch.float8_e4m3fn))
