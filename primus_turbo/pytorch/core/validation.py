"""Up-front argument checks for public ops: bad input fails here with a message naming the argument."""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["check_dtype", "check_same_device", "check_tensor"]


def check_tensor(name: str, value: object, dim: int | None = None) -> torch.Tensor:
    """``value`` must be a tensor (of ``dim`` dimensions when given)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if dim is not None and value.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(value.shape)}")
    return value


def check_dtype(name: str, dtype: torch.dtype, allowed: Iterable[torch.dtype]) -> None:
    allowed = tuple(allowed)
    if dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{name} must be one of {names}, got {str(dtype).removeprefix('torch.')}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(f"inputs must be on one device, got {listing}")
