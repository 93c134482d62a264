"""Grouped GEMM custom ops ``primus_turbo::grouped_gemm`` (forward and dgrad) and
``primus_turbo::grouped_gemm_variable_k`` / ``grouped_gemm_variable_k_accum`` (wgrad), and their backends.

Group boundaries arrive as ``group_offs``, the int64 [G + 1] exclusive prefix sum of the group sizes,
on the device: no backend copies them to the host except the TORCH per-group loop, the fallback where
``torch._grouped_mm`` is missing.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from typing import Any

import torch

from primus_turbo.common.platform import is_hopper_or_newer
from primus_turbo.pytorch.core.backend import (
    AutoKernelDispatcher,
    BackendType,
    KernelBackend,
    precision_of,
)
from primus_turbo.pytorch.core.custom_op import custom_op
from primus_turbo.pytorch.kernels.grouped_gemm.group_offs_impl import (
    balanced_group_offs,
    derived_from,
    token_shape_class,
)
from primus_turbo.triton.grouped_gemm import grouped_gemm_triton, grouped_gemm_variable_k_triton
from primus_turbo.triton.utils.device_info import interpreter_active, triton_unavailable_reason

__all__ = [
    "GroupedGemmDispatcher",
    "GroupedGemmVariableKDispatcher",
    "grouped_gemm_impl",
    "grouped_gemm_variable_k_accum_impl",
    "grouped_gemm_variable_k_impl",
]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


@functools.lru_cache(maxsize=None)
def _sm90(index: int) -> bool:
    return is_hopper_or_newer(index)


def _grouped_mm_usable(a: torch.Tensor, *others: torch.Tensor) -> bool:
    """``torch._grouped_mm`` needs 16-byte aligned rows; it runs on the CPU for every float dtype and on
    CUDA (sm_90+) for bf16."""
    if not _HAS_GROUPED_MM or any(t.shape[-1] * t.element_size() % 16 for t in (a, *others)):
        return False
    if a.device.type == "cpu":
        return True
    return (
        a.device.type == "cuda"
        and torch.version.hip is None
        and a.dtype == torch.bfloat16
        and _sm90(a.device.index if a.device.index is not None else torch.cuda.current_device())
    )


def _ends(group_offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm``'s offsets: the int32 end row of each group, converted once per offsets
    tensor (``derived_from``)."""
    return derived_from(group_offs, "int32 ends", _int32_ends)


def _int32_ends(group_offs: torch.Tensor) -> torch.Tensor:
    return group_offs[1:].to(torch.int32)


class TorchGroupedGemmBackend(KernelBackend):
    """``torch._grouped_mm``, or a loop of ``torch.mm`` over the groups (host sync) where it is missing.

    An autotune candidate: on GPUs ``torch._grouped_mm`` is the vendor kernel the Triton one competes with.
    """

    @staticmethod
    def execute(a, b, group_offs, trans_b, **_: Any) -> torch.Tensor:
        rhs = b.transpose(1, 2) if trans_b else b
        if a.shape[0] == 0:
            return a.new_empty((0, rhs.shape[2]))
        if _grouped_mm_usable(a, b):
            return torch._grouped_mm(a, rhs, offs=_ends(group_offs), out_dtype=a.dtype)
        bounds = group_offs.tolist()
        out = a.new_empty((a.shape[0], rhs.shape[2]))
        for g in range(rhs.shape[0]):
            torch.mm(a[bounds[g] : bounds[g + 1]], rhs[g], out=out[bounds[g] : bounds[g + 1]])
        return out


class TritonGroupedGemmBackend(KernelBackend):
    """The persistent grouped kernel (group offsets read on the device)."""

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return triton_unavailable_reason()

    @classmethod
    def unsupported_reason(cls, a, **_: Any) -> str | None:
        if a.device.type == "cpu" and not interpreter_active():
            return "CPU tensors need TRITON_INTERPRET=1"
        return None

    @staticmethod
    def execute(a, b, group_offs, trans_b, **_: Any) -> torch.Tensor:
        return grouped_gemm_triton(a, b, group_offs, trans_b)


class _UnavailableOnCuda(KernelBackend):
    """A backend name kept for configuration compatibility that has no implementation here."""

    @classmethod
    def unavailable_reason(cls) -> str | None:
        name = cls.__name__.removesuffix("GroupedGemmBackend")
        return f"{name} grouped GEMM kernels are not built in this library"

    @staticmethod
    def execute(**kwargs: Any) -> Any:
        raise RuntimeError("unavailable backend")


class CKGroupedGemmBackend(_UnavailableOnCuda):
    """Composable Kernel (ROCm): not part of this build."""


class HipblasltGroupedGemmBackend(_UnavailableOnCuda):
    """hipBLASLt grouped GEMM (ROCm): not part of this build."""


class GroupedGemmDispatcher(AutoKernelDispatcher):
    """Backend choice for the grouped GEMM (forward and dgrad)."""

    op_name = "grouped_gemm"
    settings_op = "grouped_gemm"
    backends = {
        BackendType.TRITON: TritonGroupedGemmBackend,
        BackendType.TORCH: TorchGroupedGemmBackend,
        BackendType.CK: CKGroupedGemmBackend,
        BackendType.HIPBLASLT: HipblasltGroupedGemmBackend,
    }

    @classmethod
    def make_key(cls, a, b, group_offs, trans_b, **_: Any) -> Hashable:
        return (a.device.type, token_shape_class(a.shape[0]), *b.shape, a.dtype, trans_b)

    @classmethod
    def resolve_key(cls, a, b, group_offs, trans_b, **_: Any) -> Hashable:
        return (a.device.type, token_shape_class(a.shape[0]), *b.shape, a.dtype, b.dtype, trans_b, a.shape[1])

    @classmethod
    def default_backend(cls, a, b, **_: Any) -> BackendType:
        return (
            BackendType.TORCH if a.device.type != "cuda" or _grouped_mm_usable(a, b) else BackendType.TRITON
        )

    @classmethod
    def tuning_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {**kwargs, "group_offs": balanced_group_offs(kwargs["group_offs"], kwargs["a"].shape[0])}


class TorchGroupedGemmVariableKBackend(KernelBackend):
    """``torch._grouped_mm`` over the token dimension, or a per-group loop (host sync); an autotune
    candidate like ``TorchGroupedGemmBackend``."""

    @staticmethod
    def execute(lhs, rhs, group_offs, out=None, **_: Any) -> torch.Tensor:
        groups = group_offs.numel() - 1
        if lhs.shape[0] == 0:
            result = lhs.new_zeros((groups, lhs.shape[1], rhs.shape[1]))
        elif _grouped_mm_usable(lhs, rhs):
            result = torch._grouped_mm(lhs.t(), rhs, offs=_ends(group_offs), out_dtype=lhs.dtype)
        else:
            bounds = group_offs.tolist()
            result = lhs.new_zeros((groups, lhs.shape[1], rhs.shape[1]))
            for g in range(groups):
                torch.mm(lhs[bounds[g] : bounds[g + 1]].t(), rhs[bounds[g] : bounds[g + 1]], out=result[g])
        return result if out is None else out.add_(result)


class TritonGroupedGemmVariableKBackend(TritonGroupedGemmBackend):
    """One program per (group, output tile), reducing over the group's tokens."""

    @staticmethod
    def execute(lhs, rhs, group_offs, out=None, **_: Any) -> torch.Tensor:
        if out is not None:
            return grouped_gemm_variable_k_triton(lhs, rhs, group_offs, out, accumulate=True)
        groups = group_offs.numel() - 1
        result = torch.empty((groups, lhs.shape[1], rhs.shape[1]), dtype=lhs.dtype, device=lhs.device)
        return grouped_gemm_variable_k_triton(lhs, rhs, group_offs, result)

    @classmethod
    def unsupported_reason(cls, lhs, **_: Any) -> str | None:
        return super().unsupported_reason(a=lhs)


class GroupedGemmVariableKDispatcher(AutoKernelDispatcher):
    """Backend choice for the variable-K grouped GEMM (wgrad)."""

    op_name = "grouped_gemm_variable_k"
    settings_op = "grouped_gemm"
    backends = {
        BackendType.TRITON: TritonGroupedGemmVariableKBackend,
        BackendType.TORCH: TorchGroupedGemmVariableKBackend,
        BackendType.CK: CKGroupedGemmBackend,
        BackendType.HIPBLASLT: HipblasltGroupedGemmBackend,
    }

    @classmethod
    def make_key(cls, lhs, rhs, group_offs, out=None, **_: Any) -> Hashable:
        shape = (token_shape_class(lhs.shape[0]), lhs.shape[1], rhs.shape[1], group_offs.numel() - 1)
        return (lhs.device.type, *shape, lhs.dtype, out is not None)

    @classmethod
    def resolve_key(cls, lhs, rhs, group_offs, out=None, **kw: Any) -> Hashable:
        return (cls.make_key(lhs=lhs, rhs=rhs, group_offs=group_offs, out=out), rhs.dtype)

    @classmethod
    def default_backend(cls, lhs, **_: Any) -> BackendType:
        return (
            BackendType.TORCH if lhs.device.type != "cuda" or _grouped_mm_usable(lhs) else BackendType.TRITON
        )

    @classmethod
    def tuning_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        tuned = {**kwargs, "group_offs": balanced_group_offs(kwargs["group_offs"], kwargs["lhs"].shape[0])}
        if kwargs.get("out") is not None:
            tuned["out"] = torch.zeros_like(kwargs["out"])
        return tuned


@custom_op("primus_turbo::grouped_gemm", mutates_args=())
def grouped_gemm_impl(
    a: torch.Tensor, b: torch.Tensor, group_offs: torch.Tensor, trans_b: bool
) -> torch.Tensor:
    """[T, N]: rows ``offs[g]:offs[g + 1]`` of ``a`` [T, K] times ``b[g]`` ([K, N], or [N, K] transposed)."""
    return GroupedGemmDispatcher.run(precision_of(a.dtype), a=a, b=b, group_offs=group_offs, trans_b=trans_b)


@grouped_gemm_impl.register_fake
def _grouped_gemm_fake(a, b, group_offs, trans_b):
    return a.new_empty((a.shape[0], b.shape[1] if trans_b else b.shape[2]))


@custom_op("primus_turbo::grouped_gemm_variable_k", mutates_args=())
def grouped_gemm_variable_k_impl(
    lhs: torch.Tensor, rhs: torch.Tensor, group_offs: torch.Tensor
) -> torch.Tensor:
    """[G, P, Q]: ``lhs[rows of g]^T @ rhs[rows of g]`` for ``lhs`` [T, P] and ``rhs`` [T, Q]."""
    return GroupedGemmVariableKDispatcher.run(
        precision_of(lhs.dtype), lhs=lhs, rhs=rhs, group_offs=group_offs
    )


@grouped_gemm_variable_k_impl.register_fake
def _grouped_gemm_variable_k_fake(lhs, rhs, group_offs):
    return lhs.new_empty((group_offs.shape[0] - 1, lhs.shape[1], rhs.shape[1]))


@custom_op("primus_turbo::grouped_gemm_variable_k_accum", mutates_args=("out",))
def grouped_gemm_variable_k_accum_impl(
    lhs: torch.Tensor, rhs: torch.Tensor, group_offs: torch.Tensor, out: torch.Tensor
) -> None:
    """``out[g] += lhs[rows of g]^T @ rhs[rows of g]`` (fp32 ``main_grad`` for fused wgrad accumulation)."""
    GroupedGemmVariableKDispatcher.run(
        precision_of(lhs.dtype), lhs=lhs, rhs=rhs, group_offs=group_offs, out=out
    )


@grouped_gemm_variable_k_accum_impl.register_fake
def _grouped_gemm_variable_k_accum_fake(lhs, rhs, group_offs, out):
    return None
