"""Both 1 x 128 block FP8 copies of a producer's output from the C++/CUDA kernel
(``torch.ops.primus_turbo_cpp_extension.fp8_dual_block_emit``).

Its persistent blocks stream the next 128 x 128 tile into shared memory while they quantize the current
one, with outputs bit-identical to the Triton tiles. On H200 (CUDA graphs, inputs rotated past L2) it ran
at 0.83-0.85 of a same-size copy for a plain quantization (Triton: 0.54-0.56), 0.51-0.55 for RMSNorm
with its rstd pass (Triton: 0.35-0.39) and 0.58-0.80 for SwiGLU (Triton: 0.39-0.41), so
``quantize_fp8_with_trans``, ``rmsnorm_fp8`` and ``swiglu_fp8`` / ``geglu_fp8`` with both 1 x 128 copies
use it. It needs 16-byte aligned rows, so callers fall back to Triton elsewhere (and on ROCm, where the
op is not built). RMSNorm rows of at most 4096 elements skip the rstd pass on sm_90
(``rmsnorm_single_read_cuda``).
"""

from __future__ import annotations

import functools

import torch

from primus_turbo.pytorch.core.cpp_extension import cpp_extension_loaded

__all__ = [
    "PRODUCER_COPY",
    "PRODUCER_GATED",
    "PRODUCER_RMSNORM",
    "dual_block_cuda",
    "dual_block_cuda_usable",
    "rmsnorm_single_read_cuda",
    "rmsnorm_single_read_usable",
]

PRODUCER_COPY, PRODUCER_GATED, PRODUCER_RMSNORM = 0, 1, 2
_BLOCK = 128
_INPUT_DTYPES = (torch.bfloat16, torch.float16)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# widest row the single-read RMSNorm takes: two of a strip's tiles per block of a 16-block cluster
_SINGLE_READ_COLS = 4096


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


@functools.lru_cache(maxsize=None)
def _clusters_run_on(device_index: int) -> bool:
    """Thread-block clusters (sm_90+) and the single-read RMSNorm op registered."""
    return (
        _op_runs_on(device_index)
        and hasattr(torch.ops.primus_turbo_cpp_extension, "fp8_rmsnorm_dual_block")
        and torch.cuda.get_device_capability(device_index)[0] >= 9
    )


def rmsnorm_single_read_usable(x: torch.Tensor) -> bool:
    """True when ``rmsnorm_single_read_cuda`` can take 2-D ``x`` that ``dual_block_cuda`` takes for
    RMSNorm: rows of at most 4096 elements on a GPU with thread-block clusters."""
    return x.shape[1] <= _SINGLE_READ_COLS and _clusters_run_on(
        x.device.index if x.device.index is not None else torch.cuda.current_device()
    )


def rmsnorm_single_read_cuda(
    x: torch.Tensor,
    gamma: torch.Tensor,
    eps: float,
    zero_centered: bool,
    q: torch.Tensor,
    scale: torch.Tensor,
    q_t: torch.Tensor,
    scale_t: torch.Tensor,
) -> torch.Tensor:
    """RMSNorm's two 1 x 128 copies (laid out as ``quantize_fp8_with_trans`` returns them) and its rstd,
    from one read of ``x``: clusters of blocks hold 128-row strips in shared memory and add their row sums
    on chip. rstd sums the squares in another order than the forward kernel, so y may differ by an ulp of
    its dtype and the copies by one FP8 ulp. Returns rstd (fp32 per row)."""
    rstd = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    torch.ops.primus_turbo_cpp_extension.fp8_rmsnorm_dual_block(
        x, gamma, eps, zero_centered, rstd, q, scale, q_t, scale_t
    )
    return rstd
