"""Platform detection: CUDA vs ROCm, GPU architecture and the FP8 flavour (OCP or FNUZ)."""

from __future__ import annotations

import functools
from enum import Enum

import torch

__all__ = [
    "Fp8Flavour",
    "Platform",
    "current_platform",
    "device_arch",
    "fp8_flavour",
    "is_cuda",
    "is_hopper_or_newer",
    "is_rocm",
]


class Platform(Enum):
    """Which GPU runtime this torch build targets."""

    CUDA = "cuda"
    ROCM = "rocm"
    CPU = "cpu"


class Fp8Flavour(Enum):
    """OCP E4M3/E5M2 (CUDA, gfx950) or the FNUZ variants (gfx942)."""

    OCP = "ocp"
    FNUZ = "fnuz"


def current_platform() -> Platform:
    """The runtime torch was built for; ``CPU`` when it has none or no device is visible."""
    if torch.version.hip is not None and torch.cuda.is_available():
        return Platform.ROCM
    if torch.version.cuda is not None and torch.cuda.is_available():
        return Platform.CUDA
    return Platform.CPU


def is_cuda() -> bool:
    return current_platform() is Platform.CUDA


def is_rocm() -> bool:
    return current_platform() is Platform.ROCM


@functools.lru_cache(maxsize=None)
def device_arch(device_index: int = 0) -> str:
    """Architecture name of a visible GPU: ``sm_90`` on CUDA, ``gfx942`` on ROCm, ``cpu`` without one."""
    platform = current_platform()
    if platform is Platform.CPU:
        return "cpu"
    props = torch.cuda.get_device_properties(device_index)
    if platform is Platform.ROCM:
        return props.gcnArchName.split(":")[0]
    return f"sm_{props.major}{props.minor}"


def is_hopper_or_newer(device_index: int = 0) -> bool:
    """True on an NVIDIA GPU of compute capability 9.0 or newer (TMA and wgmma available)."""
    return is_cuda() and torch.cuda.get_device_capability(device_index)[0] >= 9


def fp8_flavour(device_index: int = 0) -> Fp8Flavour:
    """gfx942 uses the FNUZ encodings; CUDA, gfx950 and CPU use OCP."""
    if is_rocm() and device_arch(device_index).startswith("gfx94"):
        return Fp8Flavour.FNUZ
    return Fp8Flavour.OCP
