"""FP8 GEMM custom ops ``primus_turbo::gemm_fp8`` / ``gemm_fp8_accum`` on quantized operands, and
their backends.

Both operands arrive in the NT layout the tensor cores want: ``a`` (M, K) and ``b`` (N, K) row-major
FP8 with their ``scale_inv`` along K (the autograd code in ``ops.gemm_fp8`` arranges every forward,
dgrad and wgrad GEMM that way from the quantized copies it keeps). The product is
``(a * a_scale) @ (b * b_scale)^T``. Scales: a 0-d tensor (tensorwise), (rows, 1) (row-wise),
(rows, K / block) (1-D blocks, MX in E8M0) or (rows / block, K / block) (2-D blocks).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from primus_turbo.pytorch.core.backend import (
    AutoKernelDispatcher,
    BackendType,
    KernelBackend,
    PrecisionType,
)
from primus_turbo.pytorch.core.custom_op import custom_op
from primus_turbo.pytorch.core.low_precision import ScalingGranularity
from primus_turbo.pytorch.kernels.quantization.quantization_impl import (
    dequantize_fp8_reference,
    to_block_major,
)
from primus_turbo.triton.gemm.gemm_fp8_kernel import (
    SCALE_BLOCK_2D,
    SCALE_BLOCKS,
    SCALE_ROW,
    SCALE_TENSOR,
    gemm_fp8_triton,
    supported_scale_blocks,
)
from primus_turbo.triton.utils.device_info import interpreter_active, triton_unavailable_reason

__all__ = ["GemmFp8Dispatcher", "gemm_fp8_accum_impl", "gemm_fp8_impl"]

_TENSORWISE = ScalingGranularity.TENSORWISE.value
_ROWWISE = ScalingGranularity.ROWWISE.value
_BLOCKWISE = ScalingGranularity.BLOCKWISE.value
_MX = ScalingGranularity.MX_BLOCKWISE.value
_SCALED_MM_BLOCK = 128


def _dequantize(q: torch.Tensor, scale: torch.Tensor, granularity: int, block_size: int, block_2d: bool):
    return dequantize_fp8_reference(q, scale, torch.float32, granularity, block_size, 1, block_2d)


class TorchGemmFp8Backend(KernelBackend):
    """Dequantize both operands to fp32 and multiply: the reference, on any device."""

    autotune = False

    @staticmethod
    def execute(a, a_scale, b, b_scale, out_dtype, granularity, block_size, a_2d, b_2d, out=None, **_: Any):
        lhs = _dequantize(a, a_scale, granularity, block_size, a_2d)
        rhs = _dequantize(b, b_scale, granularity, block_size, b_2d)
        product = lhs @ rhs.t()
        return product.to(out_dtype) if out is None else out.add_(product)


class HipblasltGemmFp8Backend(KernelBackend):
    """``torch._scaled_mm`` (cuBLASLt / hipBLASLt): tensorwise, row-wise, and 1 x 128 by 128 x 128 blocks."""

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not torch.cuda.is_available():
            return "needs a CUDA or ROCm GPU"
        return None

    @classmethod
    def unsupported_reason(cls, a, b, out_dtype, granularity, block_size, a_2d, b_2d, **_: Any) -> str | None:
        if a.device.type != "cuda":
            return f"needs GPU tensors, got {a.device}"
        if a.shape[1] % 16 or b.shape[0] % 16:
            return f"needs K and N to be multiples of 16, got K={a.shape[1]}, N={b.shape[0]}"
        if a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
            return "cannot multiply two E5M2 operands"
        if granularity == _MX:
            return "MX scaling needs FP8 MX tensor cores (gfx950 / Blackwell)"
        if granularity == _ROWWISE and out_dtype != torch.bfloat16:
            return f"row-wise scaling writes bf16 only, not {out_dtype}"
        if granularity == _BLOCKWISE and (block_size != _SCALED_MM_BLOCK or (a_2d and b_2d)):
            return "block scaling needs 128-wide blocks, 1 x 128 on at least one operand"
        if granularity == _BLOCKWISE and a.shape[1] % _SCALED_MM_BLOCK:
            # cuBLASLt reads the scales of whole K blocks; a partial one gives wrong output, not an error
            return f"block scaling needs K to be a multiple of {_SCALED_MM_BLOCK}, got K={a.shape[1]}"
        if granularity == _BLOCKWISE and (a_2d or b_2d) and (a.shape[1] // _SCALED_MM_BLOCK) % 4:
            # cuBLASLt (CUDA 13, H200) reads a 128 x 128 block grid with rows padded to 4 K-blocks, while
            # torch 2.11 passes them packed: every block row after the first is misread, without an error
            return f"128 x 128 blocks need K to be a multiple of {4 * _SCALED_MM_BLOCK}, got K={a.shape[1]}"
        return None

    @staticmethod
    def execute(a, a_scale, b, b_scale, out_dtype, granularity, block_size, a_2d, b_2d, out=None, **_: Any):
        if granularity == _ROWWISE:
            scale_a, scale_b = a_scale, b_scale.t()
        elif granularity == _BLOCKWISE:
            # cuBLASLt reads 1 x 128 scales K-block-major and 128 x 128 ones as the row-major block grid;
            # torch takes b's scales transposed, like b
            scale_a = a_scale if a_2d else to_block_major(a_scale)
            scale_b = (b_scale if b_2d else to_block_major(b_scale)).t()
        else:
            scale_a, scale_b = a_scale, b_scale
        dtype = out_dtype if out is None else torch.bfloat16 if granularity == _ROWWISE else out.dtype
        product = torch._scaled_mm(a, b.t(), scale_a, scale_b, out_dtype=dtype)
        return product if out is None else out.add_(product)


def _triton_mode(granularity: int, block_2d: bool) -> int:
    if granularity == _TENSORWISE:
        return SCALE_TENSOR
    if granularity == _ROWWISE:
        return SCALE_ROW
    return SCALE_BLOCK_2D if block_2d else SCALE_BLOCKS


class TritonGemmFp8Backend(KernelBackend):
    """This library's persistent FP8 kernel (TMA loads on Hopper, pointer loads elsewhere): tensorwise,
    row-wise and block scaling (1-D or 2-D)."""

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return triton_unavailable_reason()

    @classmethod
    def unsupported_reason(cls, a, b, out_dtype, granularity, block_size, out=None, **_: Any) -> str | None:
        if a.device.type == "cpu" and not interpreter_active():
            return "CPU tensors need TRITON_INTERPRET=1"
        if granularity == _MX:
            return "MX scaling runs on the TORCH backend on GPUs without MX tensor cores"
        if granularity == _BLOCKWISE and block_size not in supported_scale_blocks():
            return f"has no config for block size {block_size} (has {sorted(supported_scale_blocks())})"
        return None

    @staticmethod
    def execute(a, a_scale, b, b_scale, out_dtype, granularity, block_size, a_2d, b_2d, out=None, **_: Any):
        block = block_size if granularity == _BLOCKWISE else 0
        a_mode, b_mode = _triton_mode(granularity, a_2d), _triton_mode(granularity, b_2d)
        accumulate = out is not None
        if out is None:
            out = torch.empty((a.shape[0], b.shape[0]), dtype=out_dtype, device=a.device)
        return gemm_fp8_triton(a, a_scale.float(), a_mode, b, b_scale.float(), b_mode, out, block, accumulate)


class GemmFp8Dispatcher(AutoKernelDispatcher):
    """Backend choice for FP8 GEMM: ``_scaled_mm`` on NVIDIA GPUs (and for tensorwise and row-wise scaling
    on ROCm), the Triton kernel for block scaling on ROCm, the reference on the CPU."""

    op_name = "gemm_fp8"
    settings_op = "gemm"
    backends = {
        BackendType.HIPBLASLT: HipblasltGemmFp8Backend,
        BackendType.TRITON: TritonGemmFp8Backend,
        BackendType.TORCH: TorchGemmFp8Backend,
    }

    @classmethod
    def make_key(cls, a, b, out_dtype, granularity, block_size, a_2d, b_2d, out=None, **_: Any) -> Hashable:
        return (
            a.device.type,
            a.shape[0],
            b.shape[0],
            a.shape[1],
            a.dtype,
            b.dtype,
            out_dtype,
            granularity,
            block_size,
            a_2d,
            b_2d,
            out is not None,
        )

    @classmethod
    def default_backend(cls, a, granularity, **_: Any) -> BackendType:
        if a.device.type != "cuda":
            return BackendType.TORCH
        # cuBLASLt's block-scaled kernels beat this library's Triton kernel on Hopper; ROCm builds of
        # torch have no block-scaled _scaled_mm
        hip_blocks = granularity == _BLOCKWISE and torch.version.hip is not None
        return BackendType.TRITON if hip_blocks else BackendType.HIPBLASLT

    @classmethod
    def tuning_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        out = kwargs.get("out")
        return kwargs if out is None else {**kwargs, "out": torch.zeros_like(out)}


def _call(a, a_scale, b, b_scale, out_dtype, granularity, block_size, a_2d, b_2d, out) -> torch.Tensor:
    return GemmFp8Dispatcher.run(
        PrecisionType.FP8,
        a=a,
        a_scale=a_scale,
        b=b,
        b_scale=b_scale,
        out_dtype=out_dtype,
        granularity=granularity,
        block_size=block_size,
        a_2d=a_2d,
        b_2d=b_2d,
        out=out,
    )


@custom_op("primus_turbo::gemm_fp8", mutates_args=())
def gemm_fp8_impl(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    granularity: int,
    block_size: int,
    a_2d: bool,
    b_2d: bool,
) -> torch.Tensor:
    """``(a * a_scale) @ (b * b_scale)^T`` as a new (M, N) tensor of ``out_dtype``."""
    return _call(a, a_scale, b, b_scale, out_dtype, granularity, block_size, a_2d, b_2d, None)


@gemm_fp8_impl.register_fake
def _gemm_fp8_fake(a, a_scale, b, b_scale, out_dtype, granularity, block_size, a_2d, b_2d):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@custom_op("primus_turbo::gemm_fp8_accum", mutates_args=("out",))
def gemm_fp8_accum_impl(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out: torch.Tensor,
    granularity: int,
    block_size: int,
    a_2d: bool,
    b_2d: bool,
) -> None:
    """``out += (a * a_scale) @ (b * b_scale)^T`` (fp32 ``main_grad`` for fused wgrad accumulation)."""
    _call(a, a_scale, b, b_scale, out.dtype, granularity, block_size, a_2d, b_2d, out)


@gemm_fp8_accum_impl.register_fake
def _gemm_fp8_accum_fake(a, a_scale, b, b_scale, out, granularity, block_size, a_2d, b_2d):
    return None
