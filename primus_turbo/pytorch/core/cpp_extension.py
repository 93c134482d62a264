"""Loads the optional C++/CUDA extension ``primus_turbo._C`` (``torch.ops.primus_turbo_cpp_extension``)."""

from __future__ import annotations

import functools

import torch  # noqa: F401  (the extension links against torch's libraries, which must load first)

from primus_turbo.common.logger import get_logger

__all__ = ["cpp_extension_loaded"]

_log = get_logger(__name__)


@functools.lru_cache(maxsize=None)
def cpp_extension_loaded() -> bool:
    """True when ``primus_turbo._C`` imports; otherwise logs why once and callers use PyTorch paths."""
    try:
        import primus_turbo._C  # noqa: F401
    except ImportError as exc:
        _log.info("C++/CUDA extension primus_turbo._C not loaded (%s); using PyTorch fallbacks", exc)
        return False
    return True
