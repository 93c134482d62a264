"""Group offsets for grouped GEMM: the exclusive prefix sum of per-group row counts.

On a GPU with the C++ extension built this is one small kernel
(``torch.ops.primus_turbo_cpp_extension.grouped_gemm_compute_offs``, CUDA + Meta impls); elsewhere it is
``cumsum`` with a leading zero. Both are traceable by ``torch.compile``.
"""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.cpp_extension import cpp_extension_loaded

__all__ = ["balanced_group_offs", "compute_group_offs", "token_shape_class"]

_HAS_CPP_EXTENSION = cpp_extension_loaded()


def compute_group_offs(group_lens: torch.Tensor) -> torch.Tensor:
    """int64 ``[G + 1]`` offsets (``offs[0] = 0``, ``offs[i + 1] = offs[i] + group_lens[i]``)."""
    if group_lens.dim() != 1 or group_lens.dtype != torch.int64:
        raise ValueError(
            f"group_lens must be a 1-D int64 tensor, got {group_lens.dtype} {tuple(group_lens.shape)}"
        )
    if _HAS_CPP_EXTENSION and group_lens.is_cuda:
        return torch.ops.primus_turbo_cpp_extension.grouped_gemm_compute_offs(group_lens.contiguous())
    return torch.nn.functional.pad(torch.cumsum(group_lens, 0), (1, 0))


def balanced_group_offs(group_offs: torch.Tensor, tokens: int) -> torch.Tensor:
    """Offsets splitting ``tokens`` evenly over ``group_offs``' groups, built on its device without a
    host sync: what autotuning times, so that one routing's skew does not decide a shape class."""
    groups = group_offs.numel() - 1
    return torch.div(
        torch.arange(groups + 1, device=group_offs.device) * tokens, groups, rounding_mode="floor"
    )


def token_shape_class(tokens: int) -> int:
    """Tokens rounded up to a power of two: the autotune cache key's token count, shared by every routing
    and nearby batch size."""
    return 1 << max(tokens - 1, 0).bit_length()
