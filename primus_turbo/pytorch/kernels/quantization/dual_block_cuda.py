"""Both 1 x 128 block FP8 copies of a producer's output from the C++/CUDA kernel
(``torch.ops.primus_turbo_cpp_extension.fp8_dual_block_emit``).

Its persistent blocks stream the next 128 x 128 tile into shared memory while they quantize the current
one, with outputs bit-identical to the Triton tiles. On H200 (CUDA graphs, inputs rotated past L2) it ran
at 0.83-0.85 of a same-size copy for a plain quantization (Triton: 0.54-0.56), 0.51-0.55 for RMSNorm
with its rstd pass (Triton: 0.35-0.39) and 0.58-0.80 for SwiGLU (Triton: 0.39-0.41), so
``quantize_fp8_with_trans``,
``rmsnorm_fp8`` and ``swiglu_fp8`` / ``geglu_fp8`` with both 1 x 128 copies use it. It needs 16-byte
aligned rows, so callers fall back to Triton elsewhere (and on ROCm, where the op is not built).
"""

from __future__ import annotations

import functools

import torch

from primus_turbo.pytorch.core.cpp_extension import cpp_extension_loaded

__all__ = ["PRODUCER_COPY", "PRODUCER_GATED", "PRODUCER_RMSNORM", "dual_block_cuda", "dual_block_cuda_usable"]

PRODUCER_COPY, PRODUCER_GATED, PRODUCER_RMSNORM = 0, 1, 2
_BLOCK = 128
_INPUT_DTYPES = (torch.bfloat16, torch.float16)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@functools.lru_cache(maxsize=None)
def _op_runs_on(device_index: int) -> bool:
    """The op is registered (built for CUDA only, so never on ROCm) and the GPU streams through cp.async
    (sm_80+; measured on sm_90)."""
    return (
        cpp_extension_loaded()
        and hasattr(torch.ops.primus_turbo_cpp_extension, "fp8_dual_block_emit")
        and torch.cuda.get_device_capability(device_index)[0] >= 8
    )


def dual_block_cuda_usable(x: torch.Tensor, fp8_dtype: torch.dtype, block: int) -> bool:
    """True when the CUDA kernel can read 2-D ``x`` (rows, K) for both 1 x ``block`` copies: the op is
    built, 128-blocks, a bf16/fp16 input with 16-byte aligned rows, K % 8 == 0 and rows % 16 == 0 (a gated
    input also needs each half 16-byte aligned, which its caller checks)."""
    return (
        block == _BLOCK
        and x.is_cuda
        and x.dim() == 2
        and x.dtype in _INPUT_DTYPES
        and fp8_dtype in _FP8_DTYPES
        and x.stride(1) == 1
        and x.stride(0) % 8 == 0
        and x.data_ptr() % 16 == 0
        and x.shape[0] % 16 == 0
        and x.shape[1] % 8 == 0
        and _op_runs_on(x.device.index if x.device.index is not None else torch.cuda.current_device())
    )


def dual_block_cuda(
    x: torch.Tensor,
    producer: int,
    q: torch.Tensor,
    scale: torch.Tensor,
    q_t: torch.Tensor,
    scale_t: torch.Tensor,
    gamma: torch.Tensor | None = None,
    rstd: torch.Tensor | None = None,
    zero_centered: bool = False,
    probs: torch.Tensor | None = None,
    row_mask: torch.Tensor | None = None,
    act: int = 0,
) -> None:
    """Write the producer's output of ``x`` (a copy; RMSNorm with ``gamma`` and a precomputed ``rstd``; the
    gated activation ``act`` of x = [gate | linear] with optional ``probs`` and ``row_mask``) into
    ``q``/``scale`` along K and ``q_t``/``scale_t`` transposed, laid out as ``quantize_fp8_with_trans``
    returns them."""
    torch.ops.primus_turbo_cpp_extension.fp8_dual_block_emit(
        x, gamma, rstd, probs, row_mask, producer, act, zero_centered, q, scale, q_t, scale_t
    )
