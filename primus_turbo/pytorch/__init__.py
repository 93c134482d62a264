"""PyTorch frontend: ``import primus_turbo.pytorch as turbo``; ``turbo.ops.*`` and ``turbo.modules.*``."""

from primus_turbo.pytorch import core, modules, ops
from primus_turbo.pytorch.core.low_precision import float4_e2m1fn_x2, float8_e4m3, float8_e5m2

__all__ = ["core", "float4_e2m1fn_x2", "float8_e4m3", "float8_e5m2", "modules", "ops"]
