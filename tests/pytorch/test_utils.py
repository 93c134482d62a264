"""Accuracy gates shared by the tests: allclose tolerances per dtype and SNR in dB."""

from __future__ import annotations

import pytest
import torch

__all__ = ["DEVICES", "assert_fused_fp8_output", "compute_snr", "get_tolerances"]

_TOLERANCES = {
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 1e-2,
    torch.float8_e4m3fn: 1e-1,
    torch.float8_e5m2: 1e-1,
}

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


def _significant_strides(t: torch.Tensor) -> list[int]:
    """The strides that address anything: those of dimensions longer than 1."""
    return [stride for size, stride in zip(t.shape, t.stride(), strict=True) if size > 1]


def _assert_fp8_within_one_ulp(value: torch.Tensor, reference: torch.Tensor) -> None:
    """FP8 tensors equal up to one unit in the last place of the larger magnitude, NaN where NaN."""
    a, b = value.float(), reference.float()
    assert torch.equal(a.isnan(), b.isnan())
    a, b = a.nan_to_num(), b.nan_to_num()
    mantissa_bits = 3 if value.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz) else 2
    smallest_normal = 2.0 ** (-6 if mantissa_bits == 3 else -14)
    magnitude = torch.maximum(a.abs(), b.abs()).clamp(min=smallest_normal)
    ulp = torch.exp2(torch.floor(torch.log2(magnitude)) - mantissa_bits)
    assert ((a - b).abs() <= ulp).all()


def assert_fused_fp8_output(fused, y: torch.Tensor, config, columnwise: bool, exact: bool = True) -> None:
    """A fused producer's ``QuantizedTensor`` holds ``quantize_fp8_with_trans(y)`` (``quantize_fp8``
    along the last dimension without ``columnwise``) laid out the same way, and writes no high-precision
    values: only a ``grad_anchor`` of ``y``'s shape. Bit for bit when ``exact``; otherwise (a producer
    whose row sums may round differently from the unfused op's) within one FP8 ulp, scales within an
    ulp of ``y``'s dtype (1e-6 for fp32)."""
    from primus_turbo.pytorch.core.low_precision import ScalingGranularity
    from primus_turbo.pytorch.ops import quantize_fp8, quantize_fp8_with_trans

    if columnwise:
        expected = quantize_fp8_with_trans(
            y, fused.data.dtype, config.granularity, block_size=config.block_size
        )
        got = (fused.data, fused.scale_inv, fused.data_t, fused.scale_inv_t)
    else:
        axis = None if config.granularity is ScalingGranularity.TENSORWISE else 1
        expected = quantize_fp8(
            y, fused.data.dtype, config.granularity, block_size=config.block_size, axis=axis
        )
        got = (fused.data, fused.scale_inv)
        assert fused.data_t is None and fused.scale_inv_t is None
    for value, reference in zip(got, expected, strict=True):
        assert value.shape == reference.shape
        if value.numel():
            assert _significant_strides(value) == _significant_strides(reference)
        if value.dtype.itemsize == 1 and exact:
            assert torch.equal(value.view(torch.uint8), reference.view(torch.uint8))
        elif value.dtype.itemsize == 1:
            _assert_fp8_within_one_ulp(value, reference)
        else:
            # a row sum rounding the other way moves a row's largest element by an ulp of y (bf16), or
            # a few (fp32, where the scale's division adds its own rounding)
            rtol = 0 if exact else max(torch.finfo(y.dtype).eps, 1e-6)
            torch.testing.assert_close(value, reference, rtol=rtol, atol=0, equal_nan=True)
    assert fused.hp is None
    assert fused.grad_anchor.shape == y.shape and fused.grad_anchor.dtype == y.dtype


def get_tolerances(dtype: torch.dtype) -> dict[str, float]:
    """``rtol``/``atol`` for ``torch.testing.assert_close``: bf16/fp16 1e-2, fp32 1e-4, fp8 1e-1."""
    if dtype not in _TOLERANCES:
        raise ValueError(f"no tolerance defined for {dtype}")
    tol = _TOLERANCES[dtype]
    return {"rtol": tol, "atol": tol}


def compute_snr(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """Signal-to-noise ratio ``10 log10(|ref|^2 / |ref - x|^2)`` in dB, reference first."""
    reference = reference.double()
    noise = (reference - actual.double()).pow(2).sum()
    return (10 * torch.log10(reference.pow(2).sum() / (noise + 1e-12))).item()


def test_get_tolerances_gates():
    assert get_tolerances(torch.bfloat16) == {"rtol": 1e-2, "atol": 1e-2}
    assert get_tolerances(torch.float32) == {"rtol": 1e-4, "atol": 1e-4}
    with pytest.raises(ValueError, match="no tolerance"):
        get_tolerances(torch.int32)


def test_compute_snr_known_values():
    ref = torch.ones(1000)
    assert compute_snr(ref, ref) > 100
    assert compute_snr(ref, ref * 1.1) == pytest.approx(20.0, abs=1e-3)
    assert compute_snr(ref, ref * 1.01) == pytest.approx(40.0, abs=1e-3)
