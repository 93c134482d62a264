"""FP8 quantization: kernels against the TORCH reference bit for bit, round trips, scale rules,
edge cases (zeros, NaN/inf, saturation), the op contract and bad input."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.pytorch.core.low_precision import ScalingGranularity, ScalingRecipe
from primus_turbo.pytorch.kernels.quantization import quantization_impl as impl
from primus_turbo.pytorch.ops import dequantize_fp8, quantize_fp8, quantize_fp8_with_trans
from primus_turbo.triton.utils.device_info import fp8_cast_saturates
from tests.pytorch.test_utils import DEVICES, compute_snr

DEVICE = DEVICES[0]
G = ScalingGranularity
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SNR_GATE = {E4M3: 25.0, E5M2: 20.0}
# (granularity, keyword arguments): every scaling the op offers, along each axis of a 2-D input
CASES = [
    (G.TENSORWISE, {}),
    (G.ROWWISE, {"axis": 1}),
    (G.ROWWISE, {"axis": 0}),
    (G.BLOCKWISE, {"block_size": 32, "axis": 1}),
    (G.BLOCKWISE, {"block_size": 32, "axis": 0}),
    (G.BLOCKWISE, {"block_size": 128, "axis": -1}),
    (G.BLOCKWISE, {"block_size": 32, "scaling_recipe": ScalingRecipe(use_2d_block=True)}),
    (G.MX_BLOCKWISE, {"axis": 1}),
    (G.MX_BLOCKWISE, {"axis": 0}),
]
CASE_IDS = [
    f"{g.name.lower()}-"
    + "-".join(f"{k}{v}" for k, v in kw.items() if k != "scaling_recipe")
    + ("-2d" if "scaling_recipe" in kw else "")
    for g, kw in CASES
]
SHAPES = [(64, 96), (96, 160), (1, 32)] + ([(4096, 7168)] if DEVICE == "cuda" else [])


def _input(shape, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 3).to(dtype).to(DEVICE)


def _fits(shape, granularity, kwargs):
    if granularity is not G.MX_BLOCKWISE:
        return True
    return shape[kwargs["axis"]] % 32 == 0


def _reference(x, out_dtype, granularity, kwargs):
    block, axis, block_2d = _resolve(x, granularity, kwargs)
    return impl.quantize_fp8_reference(x.cpu(), out_dtype, granularity.value, block, axis, block_2d)


def _resolve(x, granularity, kwargs):
    from primus_turbo.pytorch.ops.quantization import _resolve as resolve

    return resolve(
        x.shape, granularity, kwargs.get("block_size"), kwargs.get("axis"), kwargs.get("scaling_recipe")
    )


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu().contiguous(), b.cpu().contiguous()
    if a.dtype.itemsize == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("out_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("granularity,kwargs", CASES, ids=CASE_IDS)
def test_matches_reference_bitwise_and_round_trips(granularity, kwargs, shape, in_dtype, out_dtype):
    if not _fits(shape, granularity, kwargs):
        pytest.skip("MX blocks need a multiple of 32 along the axis")
    x = _input(shape, in_dtype)
    q, scale_inv = quantize_fp8(x, out_dtype, granularity, **kwargs)
    q_ref, scale_ref = _reference(x, out_dtype, granularity, kwargs)
    assert q.shape == x.shape and q.dtype == out_dtype and q.is_contiguous()
    assert scale_inv.shape == scale_ref.shape and scale_inv.dtype == scale_ref.dtype
    assert _same_bits(q, q_ref) and _same_bits(scale_inv, scale_ref)
    restored = dequantize_fp8(q, scale_inv, torch.float32, granularity, **kwargs)
    assert compute_snr(x.float(), restored) >= SNR_GATE[out_dtype]


@pytest.mark.parametrize(
    "granularity,kwargs", [c for c in CASES if c[0] is not G.MX_BLOCKWISE], ids=CASE_IDS[:7]
)
def test_each_group_maximum_lands_on_the_fp8_maximum(granularity, kwargs):
    x = _input((64, 96))
    q, scale_inv = quantize_fp8(x, E4M3, granularity, **kwargs)
    restored = dequantize_fp8(q, scale_inv, torch.float32, granularity, **kwargs)
    # the largest magnitude of every group is stored as +-448 and restored within one fp8 step
    assert q.float().abs().max().item() == 448.0
    torch.testing.assert_close(restored.abs().max(), x.float().abs().max(), rtol=2**-3, atol=0)


@pytest.mark.parametrize("axis", [0, 1])
def test_mx_scales_are_powers_of_two_from_the_exponent(axis):
    x = _input((64, 96))
    q, scale_inv = quantize_fp8(x, E4M3, G.MX_BLOCKWISE, axis=axis)
    assert scale_inv.dtype == torch.float8_e8m0fnu
    scales = scale_inv.float()
    assert torch.equal(torch.exp2(torch.log2(scales).round()), scales)
    groups = x.float().abs().movedim(axis, -1).reshape(-1, 32).amax(-1)
    expected = torch.exp2(torch.floor(torch.log2(groups)) - 8)
    assert torch.equal(scales.movedim(axis, -1).reshape(-1).cpu(), expected.cpu())


@pytest.mark.parametrize("granularity,kwargs", CASES, ids=CASE_IDS)
def test_zero_group_has_unit_scale(granularity, kwargs):
    x = torch.zeros(64, 96, device=DEVICE)
    q, scale_inv = quantize_fp8(x, E4M3, granularity, **kwargs)
    assert torch.all(q.float() == 0)
    assert torch.all(scale_inv.float() == 1)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("granularity,kwargs", CASES[1:], ids=CASE_IDS[1:])
def test_nonfinite_poisons_only_its_group(granularity, kwargs, bad):
    x = _input((64, 96), torch.float32)
    x[5, 7] = bad
    q, scale_inv = quantize_fp8(x, E4M3, granularity, **kwargs)
    restored = dequantize_fp8(q, scale_inv, torch.float32, granularity, **kwargs)
    poisoned = torch.isnan(restored)
    assert poisoned[5, 7]
    assert poisoned.sum() < x.numel()  # other groups stay finite
    assert torch.isnan(scale_inv.float()).sum() == 1
    finite = ~poisoned
    assert compute_snr(x[finite], restored[finite]) >= 25
    if bad != bad:
        assert torch.isnan(q[5, 7].float())
    else:
        assert q[5, 7].float().item() == (448.0 if bad > 0 else -448.0)  # saturated, never inf/NaN


def test_tensorwise_nonfinite_makes_scale_nan():
    x = _input((16, 32), torch.float32)
    x[0, 0] = float("inf")
    q, scale_inv = quantize_fp8(x, E4M3, G.TENSORWISE)
    assert torch.isnan(scale_inv) and q[0, 0].float().item() == 448.0


def test_huge_finite_values_saturate_not_overflow():
    x = torch.full((4, 32), 1e30, device=DEVICE)
    x[0, 0] = 3e38
    q, scale_inv = quantize_fp8(x, E5M2, G.ROWWISE, axis=1)
    assert torch.isfinite(q.float()).all() and torch.isfinite(scale_inv).all()
    assert q.float().abs().max().item() == torch.finfo(E5M2).max


@pytest.mark.parametrize(
    "out_dtype", [torch.float8_e4m3fnuz, torch.float8_e5m2fnuz], ids=["e4m3fnuz", "e5m2fnuz"]
)
@pytest.mark.parametrize("granularity,kwargs", CASES, ids=CASE_IDS)
def test_fnuz_types_use_their_own_range(granularity, kwargs, out_dtype):
    x = _input((64, 96), torch.float32)
    q, scale_inv = quantize_fp8(x, out_dtype, granularity, **kwargs)
    assert q.dtype == out_dtype
    if granularity is not G.MX_BLOCKWISE:
        assert q.float().abs().max().item() == torch.finfo(out_dtype).max
    restored = dequantize_fp8(q, scale_inv, torch.float32, granularity, **kwargs)
    assert compute_snr(x, restored) >= (25 if out_dtype == torch.float8_e4m3fnuz else 20)


def test_leading_dimensions_and_middle_axis():
    x = _input((2, 48, 64), torch.float32)
    q, scale_inv = quantize_fp8(x, E4M3, G.BLOCKWISE, block_size=16, axis=1)
    assert scale_inv.shape == (2, 3, 64)
    q_ref, s_ref = _reference(x, E4M3, G.BLOCKWISE, {"block_size": 16, "axis": 1})
    assert _same_bits(q, q_ref) and _same_bits(scale_inv, s_ref)
    q, scale_inv = quantize_fp8(x, E4M3, G.ROWWISE, axis=-1)
    assert scale_inv.shape == (2, 48, 1)


@pytest.mark.parametrize("poisoned", [False, True], ids=["finite", "nonfinite"])
def test_long_rows_match_reference_bitwise(poisoned):
    """Rows of 2**16 elements and more (one scale per expert weight) take a reduction-then-cast path."""
    x = _input((3, (1 << 16) + 40))
    x[1] = 0
    if poisoned:
        x[2, 7] = float("nan")
    q, scale_inv = quantize_fp8(x, E4M3, G.ROWWISE, axis=1)
    q_ref, s_ref = _reference(x, E4M3, G.ROWWISE, {"axis": 1})
    assert scale_inv.shape == (3, 1) and bool(scale_inv[1] == 1)
    assert _same_bits(q, q_ref) and _same_bits(scale_inv, s_ref)


WITH_TRANS = [
    (G.TENSORWISE, {}),
    (G.ROWWISE, {}),
    (G.BLOCKWISE, {"block_size": 32}),
    (G.BLOCKWISE, {"block_size": 128}),
    (G.BLOCKWISE, {"block_size": 32, "scaling_recipe": ScalingRecipe(use_2d_block=True)}),
    (G.BLOCKWISE, {"block_size": 128, "scaling_recipe": ScalingRecipe(use_2d_block=True)}),
    (G.MX_BLOCKWISE, {}),
]
WITH_TRANS_IDS = ["tensorwise", "rowwise", "blockwise32", "blockwise128", "block2d", "block2d128", "mx"]


@pytest.mark.parametrize(
    "granularity,kwargs",
    WITH_TRANS,
    ids=WITH_TRANS_IDS,
)
@pytest.mark.parametrize("shape", [(96, 64), (200, 288)], ids=str)
@pytest.mark.parametrize("poisoned", [False, True], ids=["finite", "nonfinite"])
def test_with_trans_equals_two_single_quantizations(granularity, kwargs, shape, poisoned):
    if granularity is G.MX_BLOCKWISE and shape[0] % 32:
        pytest.skip("MX needs M to be a multiple of 32")
    x = _input(shape)
    if poisoned:
        x[5, 7], x[-1, -1] = float("nan"), float("inf")
    q, s, q_t, s_t = quantize_fp8_with_trans(x, E4M3, granularity, **kwargs)
    assert q_t.shape == shape[::-1] and q_t.is_contiguous()
    if granularity is G.TENSORWISE or "scaling_recipe" in kwargs:
        single = dict(kwargs)
        assert _same_bits(q_t, q.t()) and _same_bits(s_t, s.t())
        q_single, s_single = quantize_fp8(x, E4M3, granularity, **single)
    else:
        q_single, s_single = quantize_fp8(x, E4M3, granularity, axis=1, **kwargs)
        q_col, s_col = quantize_fp8(x, E4M3, granularity, axis=0, **kwargs)
        assert _same_bits(q_t, q_col.t()) and _same_bits(s_t, s_col.t())
    assert _same_bits(q, q_single) and _same_bits(s, s_single)


@pytest.mark.parametrize("block", [32, 128])
@pytest.mark.parametrize("shape", [(3, 160, 96), (2, 256, 128)], ids=str)
def test_with_trans_of_a_weight_stack_quantizes_each_slice(shape, block):
    """A stack of expert weights (G, M, K) under 2-D blocks: each slice as ``quantize_fp8`` of that
    weight alone (the TORCH reference, bit for bit), its transposed copy (G, K, M) the same bytes."""
    x = _input(shape)
    x[1, 5, 7], x[-1, -1, -1] = float("nan"), float("inf")
    recipe = ScalingRecipe(use_2d_block=True)
    q, s, q_t, s_t = quantize_fp8_with_trans(x, E4M3, G.BLOCKWISE, block_size=block, scaling_recipe=recipe)
    blocks = (-(-shape[1] // block), -(-shape[2] // block))
    assert q.shape == shape and q_t.shape == (shape[0], shape[2], shape[1]) and q_t.is_contiguous()
    assert s.shape == (shape[0], *blocks) and s_t.shape == (shape[0], *blocks[::-1])
    for i in range(shape[0]):
        q_ref, s_ref = _reference(x[i], E4M3, G.BLOCKWISE, {"block_size": block, "scaling_recipe": recipe})
        assert _same_bits(q[i], q_ref) and _same_bits(s[i], s_ref)
        assert _same_bits(q_t[i], q_ref.t()) and _same_bits(s_t[i], s_ref.t())
    # opcheck compares outputs with assert_close, to which the NaN scales are unequal
    clean = _input(shape)
    torch.library.opcheck(impl.quantize_fp8_with_trans_impl, (clean, E4M3, G.BLOCKWISE.value, block, True))


def test_with_trans_takes_a_stack_only_under_2d_blocks():
    x = _input((2, 64, 96))
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8_with_trans(x, E4M3, G.BLOCKWISE, block_size=32)
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8_with_trans(x, E4M3, G.TENSORWISE)


@pytest.mark.deterministic
@pytest.mark.parametrize("granularity,kwargs", CASES, ids=CASE_IDS)
def test_quantization_is_deterministic(granularity, kwargs):
    x = _input((96, 128))
    first = quantize_fp8(x, E4M3, granularity, **kwargs)
    for _ in range(10):
        again = quantize_fp8(x, E4M3, granularity, **kwargs)
        assert all(_same_bits(a, b) for a, b in zip(first, again, strict=True))


@pytest.mark.parametrize("granularity,kwargs", CASES, ids=CASE_IDS)
def test_opcheck(granularity, kwargs):
    x = _input((64, 96))
    block, axis, block_2d = _resolve(x, granularity, kwargs)
    torch.library.opcheck(impl.quantize_fp8_impl, (x, E4M3, granularity.value, block, axis, block_2d))
    q, scale_inv = impl.quantize_fp8_impl(x, E4M3, granularity.value, block, axis, block_2d)
    # opcheck's schema test multiplies every input tensor, which torch does not implement for fp8
    # dtypes; the schema itself (no mutation, no aliasing) is covered by the fake and AOT tests
    torch.library.opcheck(
        impl.dequantize_fp8_impl,
        (q, scale_inv, torch.bfloat16, granularity.value, block, axis, block_2d),
        test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"),
    )


@pytest.mark.parametrize(
    "shape,granularity,kwargs",
    [
        ((4, 16, 96), G.BLOCKWISE, {"block_size": 32, "axis": -1}),
        ((4, 64, 12), G.BLOCKWISE, {"block_size": 32, "axis": 1}),
        ((64, 96), G.BLOCKWISE, {"block_size": 32, "axis": 0}),
        ((4, 16, 96), G.MX_BLOCKWISE, {"axis": -1}),
        ((4, 16, 96), G.ROWWISE, {"axis": 1}),
    ],
    ids=["blocks-last-3d", "blocks-middle-3d", "blocks-axis0", "mx-last-3d", "rows-middle-3d"],
)
def test_fake_scale_strides_match_real(shape, granularity, kwargs):
    """1-D block scales are stored block-major; the fake impl must say so (compiled graphs plan with it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = _input(shape)
    block, axis, block_2d = _resolve(x, granularity, kwargs)
    args = (E4M3, granularity.value, block, axis, block_2d)
    q, scale = impl.quantize_fp8_impl(x, *args)
    with FakeTensorMode() as mode:
        fake_q, fake_scale = impl.quantize_fp8_impl(mode.from_tensor(x), *args)
    assert (fake_q.shape, fake_q.stride()) == (q.shape, q.stride())
    assert (fake_scale.shape, fake_scale.stride()) == (scale.shape, scale.stride())


@pytest.mark.parametrize(
    "granularity,kwargs",
    WITH_TRANS,
    ids=WITH_TRANS_IDS,
)
def test_opcheck_with_trans(granularity, kwargs):
    x = _input((64, 96))
    block, _, block_2d = _resolve(
        x,
        granularity,
        {**kwargs, "axis": None if granularity is G.TENSORWISE or "scaling_recipe" in kwargs else 1},
    )
    torch.library.opcheck(impl.quantize_fp8_with_trans_impl, (x, E4M3, granularity.value, block, block_2d))


@pytest.mark.parametrize(
    "granularity,kwargs",
    [CASES[0], CASES[3], CASES[6], CASES[7]],
    ids=["tensorwise", "blockwise", "block2d", "mx"],
)
def test_compiles_without_graph_breaks(granularity, kwargs):
    def round_trip(x):
        q, s = quantize_fp8(x, E4M3, granularity, **kwargs)
        q_row, s_row, q_t, s_t = quantize_fp8_with_trans(x, E5M2, G.TENSORWISE)
        return dequantize_fp8(q, s, torch.float32, granularity, **kwargs), q_t

    x = _input((64, 96))
    compiled = torch.compile(round_trip, fullgraph=True, backend="aot_eager")
    out, q_t = compiled(x)
    expected, expected_t = round_trip(x)
    assert _same_bits(out, expected) and _same_bits(q_t, expected_t)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda x: quantize_fp8(x.int(), E4M3, G.TENSORWISE), TypeError, "x.dtype"),
        (lambda x: quantize_fp8(x, torch.bfloat16, G.TENSORWISE), TypeError, "out_dtype"),
        (lambda x: quantize_fp8(x, E4M3, 1), TypeError, "ScalingGranularity"),
        (lambda x: quantize_fp8(x, E4M3, G.ROWWISE), ValueError, "needs axis"),
        (lambda x: quantize_fp8(x, E4M3, G.ROWWISE, axis=2), ValueError, "axis must be"),
        (lambda x: quantize_fp8(x, E4M3, G.TENSORWISE, axis=0), ValueError, "TENSORWISE takes no"),
        (lambda x: quantize_fp8(x, E4M3, G.BLOCKWISE, block_size=100, axis=1), ValueError, "block_size in"),
        (lambda x: quantize_fp8(x, E4M3, G.BLOCKWISE, axis=1), ValueError, "block_size in"),
        (lambda x: quantize_fp8(x[:, :40], E4M3, G.MX_BLOCKWISE, axis=1), ValueError, "multiple of 32"),
        (lambda x: quantize_fp8(x, E4M3, G.MX_BLOCKWISE, block_size=64, axis=1), ValueError, "blocks of 32"),
        (
            lambda x: quantize_fp8(
                x[None], E4M3, G.BLOCKWISE, block_size=32, scaling_recipe=ScalingRecipe(True)
            ),
            ValueError,
            "2-D tensor",
        ),
        (
            lambda x: quantize_fp8(x, E4M3, G.ROWWISE, axis=1, scaling_recipe=ScalingRecipe(use_sr=True)),
            ValueError,
            "FP4",
        ),
        (lambda x: quantize_fp8_with_trans(x[None], E4M3, G.ROWWISE), ValueError, "2-D"),
        (lambda x: dequantize_fp8(x, x, torch.float32, G.TENSORWISE), TypeError, "q.dtype"),
    ],
)
def test_bad_input_raises_clear_error(call, error, match):
    with pytest.raises(error, match=match):
        call(_input((64, 96), torch.float32))


def test_zero_length_dimensions():
    q, scale = quantize_fp8(torch.randn(64, 0, device=DEVICE), E4M3, G.ROWWISE, axis=1)
    assert q.shape == (64, 0) and scale.shape == (64, 1) and torch.all(scale == 1)
    q, scale = quantize_fp8(torch.randn(0, 64, device=DEVICE), E4M3, G.ROWWISE, axis=0)
    assert scale.shape == (1, 64)
    q, scale = quantize_fp8(torch.randn(64, 0, device=DEVICE), E4M3, G.BLOCKWISE, block_size=32, axis=1)
    assert scale.shape == (64, 0)
    torch.library.opcheck(
        impl.quantize_fp8_with_trans_impl, (torch.randn(0, 64, device=DEVICE), E4M3, 1, 0, False)
    )


def test_dequantize_of_transposed_views_matches_its_fake():
    q, scale = quantize_fp8(_input((64, 32)), E4M3, G.ROWWISE, axis=0)
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(
        impl.dequantize_fp8_impl, (q.t(), scale.t(), torch.float32, 1, 0, 1, False), test_utils=utils
    )


def test_kernels_skip_their_clamp_only_where_the_cast_saturates():
    cpu = torch.device("cpu")
    assert not fp8_cast_saturates(cpu, E4M3)
    if torch.cuda.is_available() and torch.version.hip is None:
        gpu = torch.device("cuda")
        assert not fp8_cast_saturates(gpu, torch.float8_e4m3fnuz)
        assert fp8_cast_saturates(gpu, E5M2) == (torch.cuda.get_device_capability() >= (8, 9))
