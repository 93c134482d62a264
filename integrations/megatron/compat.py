"""Everything that differs between the supported megatron-core versions (0.16 through 0.19), in one place."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from typing import Any

from megatron.core import package_info
from megatron.core.models.backends import BackendSpecProvider
from megatron.core.transformer.mlp import MLPSubmodules
from packaging.version import Version

__all__ = [
    "MEGATRON_CORE_VERSION",
    "call_with_supported_kwargs",
    "check_supported_version",
    "experts_spec",
    "grouped_mlp_takes_legacy_flag",
]

MEGATRON_CORE_VERSION = Version(package_info.__version__)
_SUPPORTED = (Version("0.16.0rc0"), Version("0.20.0rc0"))


def check_supported_version() -> None:
    """Raise unless the installed megatron-core is one this integration was written against."""
    low, high = _SUPPORTED
    if not low <= MEGATRON_CORE_VERSION < high:
        raise RuntimeError(
            f"Primus-Turbo supports megatron-core 0.16 through 0.19, found {MEGATRON_CORE_VERSION}"
        )


def grouped_mlp_takes_legacy_flag() -> bool:
    """0.16's ``grouped_mlp_modules(moe_use_grouped_gemm, moe_use_legacy_grouped_gemm)`` returns a
    ``(class, submodules)`` tuple; from 0.17 it takes one flag and returns an experts builder."""
    return (
        "moe_use_legacy_grouped_gemm" in inspect.signature(BackendSpecProvider.grouped_mlp_modules).parameters
    )


def experts_spec(experts: type, fc1: type, fc2: type) -> Any:
    """What ``grouped_mlp_modules`` returns for ``experts`` built from ``fc1``/``fc2`` in this version."""
    if grouped_mlp_takes_legacy_flag():
        return experts, MLPSubmodules(linear_fc1=fc1, linear_fc2=fc2)
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules

    return partial(experts, submodules=GroupedMLPSubmodules(linear_fc1=fc1, linear_fc2=fc2))


def call_with_supported_kwargs(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` with the keyword arguments its signature (in this Megatron version) accepts."""
    parameters = inspect.signature(fn).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in parameters}
    return fn(*args, **kwargs)
