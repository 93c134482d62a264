"""Quantization configs validate themselves; FP8 dtype aliases follow the platform."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.pytorch.core.low_precision import (
    Float4QuantConfig,
    Float8QuantConfig,
    Format,
    ScaleDtype,
    ScalingGranularity,
    float8_e4m3,
    float8_e5m2,
    fp8_dtype_for,
)


def test_float8_defaults_and_valid_configs():
    config = Float8QuantConfig()
    assert config.format is Format.E4M3 and config.granularity is ScalingGranularity.TENSORWISE
    Float8QuantConfig(granularity=ScalingGranularity.ROWWISE, format=Format.HYBRID)
    Float8QuantConfig(granularity=ScalingGranularity.BLOCKWISE, block_size=128)
    Float8QuantConfig(granularity=ScalingGranularity.MX_BLOCKWISE, block_size=32, scale_dtype=ScaleDtype.E8M0)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"granularity": ScalingGranularity.BLOCKWISE}, ValueError, "needs block_size"),
        ({"granularity": ScalingGranularity.MX_BLOCKWISE, "block_size": 32}, ValueError, "E8M0"),
        ({"granularity": ScalingGranularity.MX_BLOCKWISE, "block_size": 64}, ValueError, "block_size=32"),
        ({"block_size": 128}, ValueError, "TENSORWISE takes no block_size"),
        ({"scale_dtype": ScaleDtype.E8M0}, ValueError, "FP32 scales"),
        ({"format": Format.E2M1_X2}, ValueError, "Float4QuantConfig"),
        ({"format": "E4M3"}, TypeError, "format must be a Format"),
        ({"granularity": ScalingGranularity.BLOCKWISE, "block_size": -1}, ValueError, "positive int"),
    ],
)
def test_float8_config_rejects(kwargs, error, match):
    with pytest.raises(error, match=match):
        Float8QuantConfig(**kwargs)


def test_float4_config():
    config = Float4QuantConfig()
    assert config.block_size == 32 and config.scale_dtype is ScaleDtype.E8M0
    with pytest.raises(ValueError, match="block_size must be 32"):
        Float4QuantConfig(block_size=16)
    with pytest.raises(ValueError, match="format must be E2M1_X2"):
        Float4QuantConfig(format=Format.E4M3)
    with pytest.raises(TypeError, match="use_gradient_sr must be a bool"):
        Float4QuantConfig(use_gradient_sr=1)


def test_fp8_dtype_aliases():
    assert {float8_e4m3, float8_e5m2} <= {
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.float8_e4m3fnuz,
        torch.float8_e5m2fnuz,
    }
    assert fp8_dtype_for(Format.HYBRID, is_forward=True) == float8_e4m3
    assert fp8_dtype_for(Format.HYBRID, is_forward=False) == float8_e5m2
    assert fp8_dtype_for(Format.E5M2, is_forward=True) == float8_e5m2
    with pytest.raises(ValueError, match="not an FP8 format"):
        fp8_dtype_for(Format.E2M1_X2, is_forward=True)
