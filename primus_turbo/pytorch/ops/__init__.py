"""Public operators: ``primus_turbo.pytorch.ops.<op>``."""

from primus_turbo.pytorch.ops.gemm import gemm
from primus_turbo.pytorch.ops.quantization import dequantize_fp8, quantize_fp8, quantize_fp8_with_trans

__all__ = ["dequantize_fp8", "gemm", "quantize_fp8", "quantize_fp8_with_trans"]
