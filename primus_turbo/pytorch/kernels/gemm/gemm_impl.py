"""Dense GEMM custom ops ``primus_turbo::gemm`` / ``primus_turbo::gemm_accum`` and their backends.

Backends take ``out=None`` (return a new product) or an ``out`` to accumulate into (``out += product``).

Inputs reach the backends row-major: a column-major operand is passed as its transpose with the
``trans`` flag flipped, so no backend copies a transposed view.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from primus_turbo.pytorch.core.backend import (
    AutoKernelDispatcher,
    BackendType,
    KernelBackend,
    precision_of,
)
from primus_turbo.pytorch.core.custom_op import custom_op
from primus_turbo.triton.gemm.gemm_kernel import gemm_triton
from primus_turbo.triton.utils.device_info import interpreter_active, triton_unavailable_reason

__all__ = [
    "GemmDispatcher",
    "gemm_accum_impl",
    "gemm_call",
    "gemm_impl",
    "last_selected_backend",
]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _op(t: torch.Tensor, trans: bool) -> torch.Tensor:
    return t.t() if trans else t


def _mnk(a: torch.Tensor, b: torch.Tensor, trans_a: bool, trans_b: bool) -> tuple[int, int, int]:
    """(M, N, K) of ``op(a) @ op(b)``."""
    m, k = (a.shape[1], a.shape[0]) if trans_a else (a.shape[0], a.shape[1])
    n = b.shape[0] if trans_b else b.shape[1]
    return m, n, k


def _row_major(t: torch.Tensor, trans: bool) -> tuple[torch.Tensor, bool]:
    if t.is_contiguous():
        return t, trans
    if t.t().is_contiguous():
        return t.t(), not trans
    return t.contiguous(), trans


def _common_unsupported(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> str | None:
    if a.dtype not in _FLOAT_DTYPES or b.dtype != a.dtype:
        return f"needs a and b of one dtype among fp16/bf16/fp32, got {a.dtype} and {b.dtype}"
    if out_dtype not in _FLOAT_DTYPES:
        return f"out_dtype {out_dtype} is not fp16/bf16/fp32"
    return None


class TorchGemmBackend(KernelBackend):
    """Plain PyTorch: runs on any device and is the reference path."""

    autotune = False

    @staticmethod
    def execute(a, b, trans_a, trans_b, out_dtype, out=None, **_: Any) -> torch.Tensor:
        lhs, rhs = _op(a, trans_a), _op(b, trans_b)
        if out_dtype != a.dtype:
            lhs, rhs = lhs.float(), rhs.float()
        result = torch.mm(lhs, rhs)
        if out is not None:
            return out.add_(result)
        return result if result.dtype == out_dtype else result.to(out_dtype)


class HipblasltGemmBackend(KernelBackend):
    """The vendor BLASLt (hipBLASLt on ROCm, cuBLASLt on CUDA) reached through torch."""

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not torch.cuda.is_available():
            return "needs a CUDA or ROCm GPU (torch.cuda.is_available() is False)"
        return None

    @classmethod
    def unsupported_reason(cls, a, b, out_dtype, **_: Any) -> str | None:
        if a.device.type != "cuda":
            return f"needs GPU tensors, got {a.device}"
        reason = _common_unsupported(a, b, out_dtype)
        if reason is None and out_dtype not in (a.dtype, torch.float32):
            reason = f"output {out_dtype} must equal the input dtype {a.dtype} or be fp32"
        return reason

    @staticmethod
    def execute(a, b, trans_a, trans_b, out_dtype, out=None, **_: Any) -> torch.Tensor:
        lhs, rhs = _op(a, trans_a), _op(b, trans_b)
        widen = out_dtype != a.dtype
        if out is None:
            return torch.mm(lhs, rhs, out_dtype=out_dtype) if widen else torch.mm(lhs, rhs)
        if widen:
            return torch.addmm(out, lhs, rhs, out_dtype=out_dtype, out=out)
        return torch.addmm(out, lhs, rhs, out=out)


class TritonGemmBackend(KernelBackend):
    """This library's Triton kernels (persistent TMA kernel on Hopper, masked pointer kernel elsewhere)."""

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return triton_unavailable_reason()

    @classmethod
    def unsupported_reason(cls, a, b, out_dtype, **_: Any) -> str | None:
        if a.device.type == "cpu" and not interpreter_active():
            return "CPU tensors need TRITON_INTERPRET=1"
        return _common_unsupported(a, b, out_dtype)

    @staticmethod
    def execute(a, b, trans_a, trans_b, out_dtype, out=None, **_: Any) -> torch.Tensor:
        if out is not None:
            return gemm_triton(a, b, trans_a, trans_b, out, accumulate=True)
        m, n, _ = _mnk(a, b, trans_a, trans_b)
        return gemm_triton(a, b, trans_a, trans_b, torch.empty((m, n), dtype=out_dtype, device=a.device))


class GemmDispatcher(AutoKernelDispatcher):
    """Backend choice for dense GEMM; the vendor BLAS is the default on GPUs (see docs/performance.md)."""

    op_name = "gemm"
    settings_op = "gemm"
    backends = {
        BackendType.HIPBLASLT: HipblasltGemmBackend,
        BackendType.TRITON: TritonGemmBackend,
        BackendType.TORCH: TorchGemmBackend,
    }

    @classmethod
    def make_key(cls, a, b, trans_a, trans_b, out_dtype, out=None, **_: Any) -> Hashable:
        return (
            a.device.type,
            *_mnk(a, b, trans_a, trans_b),
            a.dtype,
            out_dtype,
            trans_a,
            trans_b,
            out is not None,
        )

    @classmethod
    def resolve_key(cls, a, b, trans_a, trans_b, out_dtype, out=None, **_: Any) -> Hashable:
        return (a.device.type, *_mnk(a, b, trans_a, trans_b), a.dtype, b.dtype, out_dtype, trans_a, trans_b,
                out is not None)  # fmt: skip

    @classmethod
    def default_backend(cls, a, **_: Any) -> BackendType:
        return BackendType.HIPBLASLT if a.device.type == "cuda" else BackendType.TORCH

    @classmethod
    def tuning_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        out = kwargs.get("out")
        if out is None:
            return kwargs
        return {**kwargs, "out": torch.zeros_like(out)}


def last_selected_backend() -> BackendType | None:
    """The backend the most recent GEMM call ran on (for benchmarks and logs)."""
    return GemmDispatcher.last_selected()


def gemm_call(a, b, trans_a, trans_b, out_dtype, out=None) -> torch.Tensor:
    """``primus_turbo::gemm``'s body (``out += ...`` when ``out`` is given), for eager callers that
    checked ``direct_call_allowed``."""
    a, trans_a = _row_major(a, trans_a)
    b, trans_b = _row_major(b, trans_b)
    return GemmDispatcher.run(
        precision_of(a.dtype),
        a=a,
        b=b,
        trans_a=trans_a,
        trans_b=trans_b,
        out_dtype=out_dtype,
        out=out,
    )


@custom_op("primus_turbo::gemm", mutates_args=())
def gemm_impl(
    a: torch.Tensor, b: torch.Tensor, trans_a: bool, trans_b: bool, out_dtype: torch.dtype
) -> torch.Tensor:
    """``op(a) @ op(b)`` as a new (M, N) tensor of ``out_dtype``."""
    return gemm_call(a, b, trans_a, trans_b, out_dtype, None)


@gemm_impl.register_fake
def _gemm_fake(a, b, trans_a, trans_b, out_dtype):
    m, n, _ = _mnk(a, b, trans_a, trans_b)
    return a.new_empty((m, n), dtype=out_dtype)


@custom_op("primus_turbo::gemm_accum", mutates_args=("out",))
def gemm_accum_impl(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, trans_a: bool, trans_b: bool
) -> None:
    """``out += op(a) @ op(b)`` in ``out``'s dtype (fp32 ``main_grad`` for fused wgrad accumulation)."""
    gemm_call(a, b, trans_a, trans_b, out.dtype, out)


@gemm_accum_impl.register_fake
def _gemm_accum_fake(a, b, out, trans_a, trans_b):
    return None
