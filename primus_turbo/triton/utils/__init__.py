"""Helpers shared by Triton launchers."""

from primus_turbo.triton.utils.device_info import (
    interpreter_active,
    kernel_autotune_enabled,
    max_shared_memory,
    num_sms,
    supports_tma,
)

__all__ = ["interpreter_active", "kernel_autotune_enabled", "max_shared_memory", "num_sms", "supports_tma"]
