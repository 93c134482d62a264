"""Group offsets for grouped GEMM: the exclusive prefix sum of per-group row counts.

On a GPU with the C++ extension built this is one small kernel
(``torch.ops.primus_turbo_cpp_extension.grouped_gemm_compute_offs``, CUDA + Meta impls); elsewhere it is
``cumsum`` with a leading zero. Both are traceable by ``torch.compile``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from primus_turbo.pytorch.core.cpp_extension import cpp_extension_loaded
from primus_turbo.pytorch.core.custom_op import direct_call_allowed

__all__ = ["balanced_group_offs", "compute_group_offs", "derived_from", "token_shape_class"]

_HAS_CPP_EXTENSION = cpp_extension_loaded()


def compute_group_offs(group_lens: torch.Tensor) -> torch.Tensor:
    """int64 ``[G + 1]`` offsets (``offs[0] = 0``, ``offs[i + 1] = offs[i] + group_lens[i]``), made once per
    counts tensor (``derived_from``): fc1 and fc2 of one routing then share them, and with them what is
    derived from the offsets."""
    if group_lens.dim() != 1 or group_lens.dtype != torch.int64:
        raise ValueError(
            f"group_lens must be a 1-D int64 tensor, got {group_lens.dtype} {tuple(group_lens.shape)}"
        )
    return derived_from(group_lens, "offsets", _group_offs)


def _group_offs(group_lens: torch.Tensor) -> torch.Tensor:
    if _HAS_CPP_EXTENSION and group_lens.is_cuda:
        return torch.ops.primus_turbo_cpp_extension.grouped_gemm_compute_offs(group_lens.contiguous())
    return torch.nn.functional.pad(torch.cumsum(group_lens, 0), (1, 0))


# tensor -> {key: (its version, value)}: what a layer's forward, dgrad and wgrad, and fc1 and fc2 (which share
# the routing), derive from the same group counts or offsets, made once instead of once per GEMM
_DERIVED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def derived_from(source: torch.Tensor, key: Hashable, compute: Callable[[torch.Tensor], Any]) -> Any:
    """``compute(source)``, made once per ``source`` tensor (and version) and ``key``. Not reused while a
    CUDA graph is captured (a value made outside the graph would not be replayed with it), for inference
    tensors (they keep no version), or outside plain eager mode (compile, tracing, modes, subclasses)."""
    if (
        not direct_call_allowed(source)
        or source.is_inference()
        or (source.is_cuda and torch.cuda.is_current_stream_capturing())
    ):
        return compute(source)
    derived = _DERIVED.get(source)
    if derived is None:
        derived = _DERIVED[source] = {}
    hit = derived.get(key)
    if hit is not None and hit[0] == source._version:
        return hit[1]
    value = compute(source)
    derived[key] = (source._version, value)
    return value


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
