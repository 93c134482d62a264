"""Accuracy gates shared by the tests: allclose tolerances per dtype and SNR in dB."""

from __future__ import annotations

import pytest
import torch

__all__ = ["DEVICES", "compute_snr", "get_tolerances"]

_TOLERANCES = {
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 1e-2,
    torch.float8_e4m3fn: 1e-1,
    torch.float8_e5m2: 1e-1,
}

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


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
