"""Low-precision formats, scaling granularities and quantization configs shared by FP8/FP4 ops."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import torch

from primus_turbo.common.platform import Fp8Flavour, fp8_flavour

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "MXFP4_BLOCK_SIZE",
    "MXFP8_BLOCK_SIZE",
    "MX_PADDING_ALIGN_SIZE",
    "Float4QuantConfig",
    "Float8QuantConfig",
    "Format",
    "ScaleDtype",
    "ScalingGranularity",
    "ScalingRecipe",
    "ScalingStrategy",
    "float4_e2m1fn_x2",
    "float8_e4m3",
    "float8_e5m2",
    "fp8_dtype_for",
]

MXFP8_BLOCK_SIZE = 32
MXFP4_BLOCK_SIZE = 32
MX_PADDING_ALIGN_SIZE = 128
DEFAULT_BLOCK_SIZE = 128


class Format(Enum):
    """Element format. HYBRID means E4M3 for forward operands and E5M2 for gradients."""

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"
    E2M1_X2 = "E2M1_X2"


class ScaleDtype(Enum):
    """Dtype of the scales: fp32, or the power-of-two E8M0 that MX formats require."""

    FP32 = "FP32"
    E8M0 = "E8M0"


class ScalingGranularity(Enum):
    """How many elements share one scale. ``.value`` is the int that crosses custom-op boundaries."""

    TENSORWISE = 0
    ROWWISE = 1
    BLOCKWISE = 2
    MX_BLOCKWISE = 3


class ScalingStrategy(Enum):
    """How scales are chosen: from the current tensor's amax."""

    DYNAMIC = "DYNAMIC"


class ScalingRecipe(NamedTuple):
    """Per-operand quantization options (2-D weight blocks, stochastic rounding, Hadamard transform)."""

    use_2d_block: bool = False
    use_sr: bool = False
    use_rht: bool = False


def _require_enum(name: str, value: object, enum_cls: type[Enum]) -> None:
    if not isinstance(value, enum_cls):
        raise TypeError(f"{name} must be a {enum_cls.__name__}, got {value!r}")


def _require_config_enums(config: Float8QuantConfig | Float4QuantConfig) -> None:
    """The enum-typed fields shared by the FP8 and FP4 configs."""
    for name, enum_cls in (
        ("format", Format),
        ("granularity", ScalingGranularity),
        ("strategy", ScalingStrategy),
        ("scale_dtype", ScaleDtype),
    ):
        _require_enum(name, getattr(config, name), enum_cls)


@dataclass(frozen=True)
class Float8QuantConfig:
    """FP8 quantization: element format, scale granularity, strategy, scale dtype and block size."""

    format: Format = Format.E4M3
    granularity: ScalingGranularity = ScalingGranularity.TENSORWISE
    strategy: ScalingStrategy = ScalingStrategy.DYNAMIC
    scale_dtype: ScaleDtype = ScaleDtype.FP32
    block_size: int | None = None

    def __post_init__(self) -> None:
        _require_config_enums(self)
        if self.format is Format.E2M1_X2:
            raise ValueError("Float8QuantConfig: format E2M1_X2 is FP4; use Float4QuantConfig")
        if self.block_size is not None and (not isinstance(self.block_size, int) or self.block_size <= 0):
            raise ValueError(f"Float8QuantConfig: block_size must be a positive int, got {self.block_size!r}")
        if self.granularity is ScalingGranularity.BLOCKWISE:
            if self.block_size is None:
                raise ValueError("Float8QuantConfig: BLOCKWISE granularity needs block_size (e.g. 128)")
            if self.scale_dtype is not ScaleDtype.FP32:
                raise ValueError("Float8QuantConfig: BLOCKWISE granularity uses FP32 scales")
        elif self.granularity is ScalingGranularity.MX_BLOCKWISE:
            if self.block_size != MXFP8_BLOCK_SIZE:
                raise ValueError(f"Float8QuantConfig: MX_BLOCKWISE needs block_size={MXFP8_BLOCK_SIZE}")
            if self.scale_dtype is not ScaleDtype.E8M0:
                raise ValueError("Float8QuantConfig: MX_BLOCKWISE needs scale_dtype=E8M0")
        else:
            if self.block_size is not None:
                raise ValueError(f"Float8QuantConfig: {self.granularity.name} takes no block_size")
            if self.scale_dtype is not ScaleDtype.FP32:
                raise ValueError(f"Float8QuantConfig: {self.granularity.name} uses FP32 scales")


@dataclass(frozen=True)
class Float4QuantConfig:
    """MXFP4 quantization (E2M1 pairs, E8M0 scales per 32 elements) with optional gradient SR."""

    format: Format = Format.E2M1_X2
    granularity: ScalingGranularity = ScalingGranularity.MX_BLOCKWISE
    strategy: ScalingStrategy = ScalingStrategy.DYNAMIC
    scale_dtype: ScaleDtype = ScaleDtype.E8M0
    block_size: int = MXFP4_BLOCK_SIZE
    use_gradient_sr: bool = False
    use_preshuffle: bool = False

    def __post_init__(self) -> None:
        _require_config_enums(self)
        if self.format is not Format.E2M1_X2:
            raise ValueError("Float4QuantConfig: format must be E2M1_X2")
        if self.granularity is not ScalingGranularity.MX_BLOCKWISE:
            raise ValueError("Float4QuantConfig: granularity must be MX_BLOCKWISE")
        if self.scale_dtype is not ScaleDtype.E8M0:
            raise ValueError("Float4QuantConfig: scale_dtype must be E8M0")
        if self.block_size != MXFP4_BLOCK_SIZE:
            raise ValueError(f"Float4QuantConfig: block_size must be {MXFP4_BLOCK_SIZE}")
        for name in ("use_gradient_sr", "use_preshuffle"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Float4QuantConfig: {name} must be a bool")


def _platform_fp8_dtypes() -> tuple[torch.dtype, torch.dtype]:
    if fp8_flavour() is Fp8Flavour.FNUZ:
        return torch.float8_e4m3fnuz, torch.float8_e5m2fnuz
    return torch.float8_e4m3fn, torch.float8_e5m2


float8_e4m3, float8_e5m2 = _platform_fp8_dtypes()
float4_e2m1fn_x2: torch.dtype | None = getattr(torch, "float4_e2m1fn_x2", None)


def fp8_dtype_for(fmt: Format, is_forward: bool) -> torch.dtype:
    """The FP8 dtype for an operand: HYBRID picks E4M3 in forward and E5M2 for gradients."""
    _require_enum("format", fmt, Format)
    if fmt is Format.E4M3 or (fmt is Format.HYBRID and is_forward):
        return float8_e4m3
    if fmt is Format.E5M2 or fmt is Format.HYBRID:
        return float8_e5m2
    raise ValueError(f"{fmt.name} is not an FP8 format")
