"""Group offsets for grouped GEMM: the exclusive prefix sum of per-group row counts.

On a GPU with the C++ extension built this is one small kernel
(``torch.ops.primus_turbo_cpp_extension.grouped_gemm_compute_offs``, CUDA + Meta impls); elsewhere it is
``cumsum`` with a leading zero. Both are traceable by ``torch.compile``.
"""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.cpp_extension import cpp_extension_loaded

__all__ = ["compute_group_offs"]

_HAS_CPP_EXTENSION = cpp_extension_loaded()


def compute_group_offs(group_lens: torch.Tensor) -> torch.Tensor:
    """int64 ``[G + 1]`` offsets (``offs[0] = 0``, ``offs[i + 1] = offs[i] + group_lens[i]``)."""
    if group_lens.dim() != 1 or group_lens.dtype != torch.int64:
        raise ValueError(
            f"group_lens must be a 1-D int64 tensor, got {group_lens.dtype} {tuple(group_lens.shape)}"
        )
    if _HAS_CPP_EXTENSION and group_lens.is_cuda:
        return torch.ops.primus_turbo_cpp_extension.grouped_gemm_compute_offs(group_lens.contiguous())
    return torch.cat([group_lens.new_zeros(1), torch.cumsum(group_lens, 0)])
