"""Public operators: ``primus_turbo.pytorch.ops.<op>``."""

from primus_turbo.pytorch.ops.gemm import gemm

__all__ = ["gemm"]
