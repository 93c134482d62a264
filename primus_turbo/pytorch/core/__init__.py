"""Backend selection and low-precision configuration shared by every op."""

from primus_turbo.pytorch.core.backend import (
    AutoKernelDispatcher,
    BackendChoice,
    BackendType,
    GlobalBackendManager,
    KernelBackend,
    PrecisionType,
)
from primus_turbo.pytorch.core.low_precision import (
    Float4QuantConfig,
    Float8QuantConfig,
    Format,
    ScaleDtype,
    ScalingGranularity,
    ScalingRecipe,
    ScalingStrategy,
)

__all__ = [
    "AutoKernelDispatcher",
    "BackendChoice",
    "BackendType",
    "Float4QuantConfig",
    "Float8QuantConfig",
    "Format",
    "GlobalBackendManager",
    "KernelBackend",
    "PrecisionType",
    "ScaleDtype",
    "ScalingGranularity",
    "ScalingRecipe",
    "ScalingStrategy",
]
