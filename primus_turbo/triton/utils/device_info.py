"""Device facts the launchers need: interpreter mode, SM count and TMA support."""

import functools

import torch

from primus_turbo.common.constants import ENV_TRITON_AUTOTUNE
from primus_turbo.common.env import env_reader
from primus_turbo.common.platform import is_hopper_or_newer

__all__ = [
    "fp8_cast_saturates",
    "interpreter_active",
    "kernel_autotune_enabled",
    "max_shared_memory",
    "num_sms",
    "supports_tma",
    "triton_runs_on",
    "triton_unavailable_reason",
]


_interpret_env = env_reader("TRITON_INTERPRET")
_autotune_env = env_reader(ENV_TRITON_AUTOTUNE)


def interpreter_active() -> bool:
    """True when Triton kernels run under ``TRITON_INTERPRET=1`` (the CPU test path)."""
    return _interpret_env() == "1"


def triton_runs_on(device: torch.device) -> bool:
    """Whether Triton kernels take tensors on ``device``: GPUs, and the CPU under the interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and interpreter_active())


def triton_unavailable_reason() -> str | None:
    """Why no Triton kernel can run in this process (no GPU, no interpreter), or None when one can."""
    if torch.cuda.is_available() or interpreter_active():
        return None
    return "needs a CUDA/ROCm GPU, or TRITON_INTERPRET=1 to run on the CPU"


def kernel_autotune_enabled() -> bool:
    """False under the interpreter (nothing to time) or with ``PRIMUS_TURBO_TRITON_AUTOTUNE=0``:
    kernels then launch one config picked by a heuristic."""
    return not interpreter_active() and (_autotune_env() or "1").strip() != "0"


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _cuda_num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors (compute units) of ``device``; a small fixed count on CPU."""
    if device.type == "cuda":
        return _cuda_num_sms(_cuda_index(device))
    return 4


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def is_sm90(device: torch.device) -> bool:
    """An NVIDIA Hopper GPU (compute capability 9.0): the target of the Gluon kernels. Cached per device,
    since the kernels' eligibility checks ask on every call."""
    return (
        device.type == "cuda"
        and torch.version.hip is None
        and _cuda_capability(_cuda_index(device)) == (9, 0)
    )


@functools.lru_cache(maxsize=None)
def _cuda_max_shared_memory(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    # torch >= 2.5 reports it; older builds get the Hopper figure and rely on Triton's own resource check
    return getattr(props, "shared_memory_per_block_optin", 0) or 227 * 1024


def max_shared_memory(device: torch.device) -> int:
    """Bytes of shared memory (LDS on AMD) one block may use: 227 KB on Hopper, 64 KB on gfx942."""
    if device.type == "cuda":
        return _cuda_max_shared_memory(_cuda_index(device))
    return 1 << 30


@functools.lru_cache(maxsize=None)
def _cuda_has_tma(index: int) -> bool:
    return is_hopper_or_newer(index)


def supports_tma(device: torch.device) -> bool:
    """Tensor-memory-accelerator descriptors: NVIDIA sm_90+, and the interpreter emulates them."""
    if device.type == "cuda":
        return _cuda_has_tma(_cuda_index(device))
    return interpreter_active()


def fp8_cast_saturates(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether Triton's fp32 -> ``dtype`` cast saturates by itself on ``device``: NVIDIA sm_89+ converts to
    the OCP types with ``cvt.rn.satfinite`` (beyond +-max and +-inf to +-max, NaN kept), so the kernels
    can skip their own clamp. Not for the FNUZ types (converted in software there), not under the
    interpreter, on ROCm or on older NVIDIA GPUs."""
    return (
        device.type == "cuda"
        and dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        and torch.version.hip is None
        and _cuda_capability(_cuda_index(device)) >= (8, 9)
    )
