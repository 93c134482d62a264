"""FP8 grouped GEMM custom ops and their backends, plus the per-group column quantization the
variable-K (wgrad) GEMM needs.

- ``primus_turbo::grouped_gemm_fp8``: [T, N] = per group ``(a * a_scale) @ op(b[g] * b_scale[g])`` with
  ``a`` [T, K], ``b`` [G, K, N] (or [G, N, K] with ``trans_b``); ``a_scale`` is 0-d (tensorwise) or
  [T, 1] (per row), ``b_scale`` broadcasts against ``b`` ([G, 1, 1] per expert, or per row along K).
  With ``block_size`` B (block scaling): ``a_scale`` [T, K / B] and ``b_scale`` each expert's B x B
  block grid, [G, K / B, N / B] (or [G, N / B, K / B]).
- ``primus_turbo::grouped_gemm_fp8_variable_k``: [G, P, Q] = per group ``(lhs * s)^T (rhs * s)`` over the
  group's rows, with 0-d scales or one scale per (group, column) ([G, P] and [G, Q]); with
  ``block_size`` B, one scale row per B tokens of each group (``quantize_fp8_group_blocks``).
- ``primus_turbo::grouped_gemm_fp8_variable_k_accum``: the same added into ``out`` (Megatron's fp32
  ``main_grad``) in the kernel's epilogue.
- ``primus_turbo::quantize_fp8_group_columns``: x [T, C] quantized along its rows within each group,
  one scale per (group, column): the wgrad operands of the row-wise recipe.
- ``primus_turbo::quantize_fp8_group_blocks``: x [T, C] quantized along its rows in blocks of B tokens,
  aligned to multiples of B in the token dimension and cut at group boundaries, one scale per (block,
  column): the wgrad operands of the block recipe. The scale tensor has ``ceil(T / B) + G`` rows (an
  upper bound on the blocks, so that its size does not depend on the group sizes); rows past the last
  block hold 1.

Layouts: Hopper's FP8 tensor cores read both operands with the reduction dimension contiguous (other
layouts ran the Triton kernels 4-8x slower on H200), so the GEMMs take views of any strides and their
callers pass K-major weights and token-major wgrad operands: the two group quantizations return their
[T, C] result stored as [C, T].

Backends: TRITON (the persistent grouped FP8 kernels, no host sync: on Hopper a Gluon kernel for every
scaling whose weights are one contiguous [G, N, K] copy, the plain-Triton kernel elsewhere), TORCH
(dequantize and multiply: the reference, any device; a host sync on GPUs) and HIPBLASLT
(``torch._scaled_grouped_mm``, row-wise with [G, N, K] weights). The variable-K op runs the Triton
kernels on GPUs (Gluon on Hopper) and the reference elsewhere.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from primus_turbo.pytorch.core.backend import (
    AutoKernelDispatcher,
    BackendType,
    KernelBackend,
    PrecisionType,
)
from primus_turbo.pytorch.core.custom_op import custom_op, direct_call_allowed
from primus_turbo.pytorch.core.low_precision import ScalingGranularity
from primus_turbo.pytorch.kernels.grouped_gemm.group_offs_impl import (
    balanced_group_offs,
    derived_from,
    token_shape_class,
)
from primus_turbo.pytorch.kernels.quantization.quantization_impl import (
    expand_scale,
    fp8_triton_usable,
    quantize_fp8_reference,
    tensorwise_multipliers,
    tensorwise_with_trans_triton,
)
from primus_turbo.triton.grouped_gemm import (
    group_block_layout_triton,
    grouped_fp8_scale_block,
    grouped_fp8_sm90_takes,
    grouped_gemm_fp8_triton,
    grouped_gemm_fp8_variable_k_triton,
    quantize_fp8_group_blocks_triton,
    quantize_fp8_group_columns_triton,
    token_major_empty,
)
from primus_turbo.triton.utils.device_info import triton_runs_on, triton_unavailable_reason
from primus_turbo.triton.utils.transpose import transpose_triton

_BLOCKWISE = ScalingGranularity.BLOCKWISE.value

__all__ = [
    "GroupedGemmFp8Dispatcher",
    "group_block_base",
    "group_block_layout",
    "group_block_count",
    "group_block_rows",
    "group_blocks",
    "group_blocks_reference",
    "group_columns_reference",
    "grouped_gemm_fp8_impl",
    "grouped_gemm_fp8_variable_k_accum_impl",
    "grouped_gemm_fp8_variable_k_impl",
    "quantize_fp8_group_blocks_impl",
    "quantize_fp8_experts_tensorwise_impl",
    "quantize_fp8_group_columns_impl",
    "transpose_last_two_impl",
]


def _group_ids(group_offs: torch.Tensor, tokens: int) -> torch.Tensor:
    """The group of every row, from the device offsets (no host sync)."""
    groups = group_offs.numel() - 1
    lens = group_offs[1:] - group_offs[:-1]
    return torch.repeat_interleave(torch.arange(groups, device=group_offs.device), lens, output_size=tokens)


def group_blocks(group_offs: torch.Tensor, block: int) -> torch.Tensor:
    """Scale blocks of every group [G]: the stretches of ``block`` tokens, aligned to multiples of
    ``block`` in the token dimension, that the group's tokens touch (0 for an empty group)."""
    start, end = group_offs[:-1], group_offs[1:]
    touched = torch.div(end + block - 1, block, rounding_mode="floor") - torch.div(
        start, block, rounding_mode="floor"
    )
    return torch.where(end > start, touched, 0)


def group_block_layout(group_offs: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ends, base)`` [G] each: the running total of ``group_blocks`` and every group's first scale row
    (no host sync), made once per offsets tensor and block (``derived_from``): a backward's two
    quantizers and wgrad GEMM, and fc1's and fc2's, share it. One Triton program in eager mode."""
    return derived_from(group_offs, ("block layout", block), lambda offs: _block_layout(offs, block))


def _block_layout(group_offs: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    if triton_runs_on(group_offs.device) and direct_call_allowed(group_offs):
        return group_block_layout_triton(group_offs.contiguous(), block)
    blocks = group_blocks(group_offs, block)
    ends = torch.cumsum(blocks, 0)
    return ends, ends - blocks


def group_block_base(group_offs: torch.Tensor, block: int) -> torch.Tensor:
    """First scale row of every group [G] (no host sync)."""
    return group_block_layout(group_offs, block)[1]


def group_block_rows(group_offs: torch.Tensor, tokens: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale row of every token [T], first scale row of every group [G])`` for the blocks of
    ``group_blocks``, from the device offsets (no host sync)."""
    base = group_block_base(group_offs, block)
    ids = _group_ids(group_offs, tokens)
    first = torch.div(group_offs[:-1], block, rounding_mode="floor")
    aligned = torch.div(torch.arange(tokens, device=group_offs.device), block, rounding_mode="floor")
    return base[ids] + aligned - first[ids], base


def group_block_count(tokens: int, groups: int, block: int) -> int:
    """Rows of a ``quantize_fp8_group_blocks`` scale tensor: at least the blocks of any group sizes."""
    return -(-tokens // block) + groups


def _segment_mm(lhs: torch.Tensor, rhs: torch.Tensor, group_offs: torch.Tensor) -> torch.Tensor:
    """fp32 [T, N] = per group lhs[rows] @ rhs[g] (``torch._grouped_mm`` on the CPU, a loop elsewhere)."""
    if lhs.device.type == "cpu" and hasattr(torch, "_grouped_mm") and lhs.shape[0] > 0:
        return torch._grouped_mm(lhs, rhs, offs=group_offs[1:].to(torch.int32))
    bounds = group_offs.tolist()
    out = lhs.new_zeros((lhs.shape[0], rhs.shape[2]))
    for g in range(rhs.shape[0]):
        torch.mm(lhs[bounds[g] : bounds[g + 1]], rhs[g], out=out[bounds[g] : bounds[g + 1]])
    return out


class TorchGroupedGemmFp8Backend(KernelBackend):
    """Dequantize to fp32 and multiply per group: the reference, on any device (host sync on GPUs)."""

    autotune = False

    @staticmethod
    def execute(a, a_scale, b, b_scale, group_offs, trans_b, out_dtype, block_size, **_: Any) -> torch.Tensor:
        if block_size:
            a_scale = expand_scale(a_scale, a.shape, _BLOCKWISE, block_size, 1, False)
            b_scale = expand_scale(b_scale, b.shape, _BLOCKWISE, block_size, 2, True)
        rhs = b.float() * b_scale
        rhs = rhs.transpose(1, 2) if trans_b else rhs
        return _segment_mm(a.float() * a_scale, rhs, group_offs).to(out_dtype)


class HipblasltGroupedGemmFp8Backend(KernelBackend):
    """``torch._scaled_grouped_mm`` (cuBLASLt/hipBLASLt's grouped kernel): E4M3 operands, per-tensor or
    per-row scales (tensorwise ones are expanded to rows), weights K-major (the reduction dimension
    contiguous, as ``grouped_gemm_fp8`` lays them out). The default where it applies and the Hopper
    Gluon kernel does not: on H200 it ran 1.1x-1.4x faster than the plain-Triton kernel."""

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not torch.cuda.is_available() or not hasattr(torch, "_scaled_grouped_mm"):
            return "needs a GPU build of torch with torch._scaled_grouped_mm"
        return None

    @classmethod
    def unsupported_reason(cls, a, a_scale, b, trans_b, out_dtype, block_size, **_: Any) -> str | None:
        if a.device.type != "cuda":
            return f"needs GPU tensors, got {a.device}"
        if block_size:
            return "torch._scaled_grouped_mm has no block scaling"
        if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
            return f"needs E4M3 operands, got {a.dtype} and {b.dtype}"
        if _weight_operand(b, trans_b).stride(1) != 1:
            return "needs K-major weights (the reduction dimension contiguous)"
        if out_dtype != torch.bfloat16 or a.shape[1] % 16 or b.shape[1] % 16 or b.shape[2] % 16:
            return "needs bf16 output and K, N multiples of 16"
        return None

    @staticmethod
    def execute(a, a_scale, b, b_scale, group_offs, trans_b, out_dtype, **_: Any) -> torch.Tensor:
        mat_b = _weight_operand(b, trans_b)
        groups, n = mat_b.shape[0], mat_b.shape[2]
        scale_a = a_scale.float().reshape(-1).expand(a.shape[0]).contiguous()
        scale_b = b_scale.float().reshape(groups, -1).expand(groups, n).contiguous()
        offs = group_offs[1:].to(torch.int32)
        return torch._scaled_grouped_mm(a, mat_b, scale_a, scale_b, offs=offs, out_dtype=out_dtype)


def _weight_operand(b: torch.Tensor, trans_b: bool) -> torch.Tensor:
    """The weights as the [G, K, N] operand of the product."""
    return b.transpose(1, 2) if trans_b else b


class TritonGroupedGemmFp8Backend(KernelBackend):
    """The persistent grouped FP8 kernel: group offsets read on the device, scales in the epilogue."""

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return triton_unavailable_reason()

    @classmethod
    def unsupported_reason(cls, a, block_size, **_: Any) -> str | None:
        if not triton_runs_on(a.device):
            return "CPU tensors need TRITON_INTERPRET=1"
        if block_size and block_size != grouped_fp8_scale_block():
            return f"block scaling runs with blocks of {grouped_fp8_scale_block()}, not {block_size}"
        return None

    @staticmethod
    def execute(a, a_scale, b, b_scale, group_offs, trans_b, out_dtype, block_size, **_: Any) -> torch.Tensor:
        return grouped_gemm_fp8_triton(a, a_scale, b, b_scale, group_offs, trans_b, out_dtype, block_size)


class GroupedGemmFp8Dispatcher(AutoKernelDispatcher):
    """Backend choice for the FP8 grouped GEMM (forward and dgrad)."""

    op_name = "grouped_gemm_fp8"
    settings_op = "grouped_gemm"
    backends = {
        BackendType.TRITON: TritonGroupedGemmFp8Backend,
        BackendType.HIPBLASLT: HipblasltGroupedGemmFp8Backend,
        BackendType.TORCH: TorchGroupedGemmFp8Backend,
    }

    @classmethod
    def make_key(cls, a, a_scale, b, trans_b, out_dtype, block_size, **_: Any) -> Hashable:
        return (a.device.type, token_shape_class(a.shape[0]), *b.shape, a_scale.dim(), trans_b, block_size)

    @classmethod
    def resolve_key(cls, a, a_scale, b, b_scale, trans_b, out_dtype, block_size, **kw: Any) -> Hashable:
        # the Gluon kernel and torch._scaled_grouped_mm decline on dtypes, strides and scale layouts too
        key = cls.make_key(
            a=a, a_scale=a_scale, b=b, trans_b=trans_b, out_dtype=out_dtype, block_size=block_size
        )
        return (key, a.dtype, b.dtype, out_dtype, a.stride(), b.stride(), a_scale.shape, a_scale.stride(),
                b_scale.shape, b_scale.stride())  # fmt: skip

    @classmethod
    def default_backend(cls, **kwargs: Any) -> BackendType:
        """TRITON where its Hopper Gluon kernel takes the call (1.13x-1.22x ``torch._scaled_grouped_mm``
        geomean on H200), else HIPBLASLT where it applies (the plain-Triton kernel runs 0.7x-0.9x of
        it), else TRITON."""
        if kwargs["a"].device.type != "cuda":
            return BackendType.TORCH
        names = ("a", "a_scale", "b", "b_scale", "trans_b", "out_dtype", "block_size")
        if grouped_fp8_sm90_takes(*(kwargs[name] for name in names)):
            return BackendType.TRITON
        usable = HipblasltGroupedGemmFp8Backend.can_handle(**kwargs)
        return BackendType.HIPBLASLT if usable else BackendType.TRITON

    @classmethod
    def tuning_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {**kwargs, "group_offs": balanced_group_offs(kwargs["group_offs"], kwargs["a"].shape[0])}


@custom_op("primus_turbo::grouped_gemm_fp8", mutates_args=())
def grouped_gemm_fp8_impl(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    group_offs: torch.Tensor,
    trans_b: bool,
    out_dtype: torch.dtype,
    block_size: int = 0,
) -> torch.Tensor:
    """[T, N] grouped product of FP8 operands with their dequantization scales (``block_size`` > 0:
    block scaling)."""
    return GroupedGemmFp8Dispatcher.run(
        PrecisionType.FP8,
        a=a,
        a_scale=a_scale,
        b=b,
        b_scale=b_scale,
        group_offs=group_offs,
        trans_b=trans_b,
        out_dtype=out_dtype,
        block_size=block_size,
    )


@grouped_gemm_fp8_impl.register_fake
def _grouped_gemm_fp8_fake(a, a_scale, b, b_scale, group_offs, trans_b, out_dtype, block_size=0):
    return a.new_empty((a.shape[0], b.shape[1] if trans_b else b.shape[2]), dtype=out_dtype)


@custom_op("primus_turbo::grouped_gemm_fp8_variable_k", mutates_args=())
def grouped_gemm_fp8_variable_k_impl(
    lhs: torch.Tensor,
    lhs_scale: torch.Tensor,
    rhs: torch.Tensor,
    rhs_scale: torch.Tensor,
    group_offs: torch.Tensor,
    out_dtype: torch.dtype,
    block_size: int = 0,
    block_base: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32-accumulated [G, P, Q] = per group ``(lhs * s)^T @ (rhs * s)`` over the group's rows. Under
    block scaling ``block_base`` (``group_block_layout``'s second tensor) saves recomputing it."""
    if _variable_k_on_triton(lhs, block_size):
        operands = (lhs, lhs_scale, rhs, rhs_scale, group_offs)
        return _variable_k_triton(*operands, block_size, block_base, out_dtype)
    return _variable_k_reference(lhs, lhs_scale, rhs, rhs_scale, group_offs, block_size).to(out_dtype)


def _variable_k_on_triton(lhs: torch.Tensor, block_size: int) -> bool:
    """The Triton variable-K kernels run on GPUs with the token blocks they were built for (one scale row
    per ``grouped_fp8_scale_block()`` tokens); other block sizes take the reference path."""
    return lhs.device.type == "cuda" and block_size in (0, grouped_fp8_scale_block())


def _variable_k_triton(
    lhs, lhs_scale, rhs, rhs_scale, group_offs, block_size: int, block_base, out_dtype, out=None
):
    """The Triton variable-K kernel, given each group's first scale row under block scaling."""
    if block_size and block_base is None:
        block_base = group_block_base(group_offs, block_size)
    operands = (lhs, lhs_scale, rhs, rhs_scale, group_offs)
    return grouped_gemm_fp8_variable_k_triton(*operands, out_dtype, block_base if block_size else None, out)


def _variable_k_reference(lhs, lhs_scale, rhs, rhs_scale, group_offs, block_size: int) -> torch.Tensor:
    """fp32 [G, P, Q]: the dequantized operands multiplied per group (the reference path)."""
    groups = group_offs.numel() - 1
    if block_size:
        rows, _ = group_block_rows(group_offs, lhs.shape[0], block_size)
    else:
        rows = _group_ids(group_offs, lhs.shape[0])
    left = (lhs.float() * (lhs_scale[rows] if lhs_scale.dim() else lhs_scale)).contiguous()
    right = (rhs.float() * (rhs_scale[rows] if rhs_scale.dim() else rhs_scale)).contiguous()
    if lhs.device.type == "cpu" and hasattr(torch, "_grouped_mm") and lhs.shape[0] > 0:
        out = torch._grouped_mm(left.t(), right, offs=group_offs[1:].to(torch.int32))
    else:
        bounds = group_offs.tolist()
        out = left.new_zeros((groups, lhs.shape[1], rhs.shape[1]))
        for g in range(groups):
            torch.mm(left[bounds[g] : bounds[g + 1]].t(), right[bounds[g] : bounds[g + 1]], out=out[g])
    return out


@grouped_gemm_fp8_variable_k_impl.register_fake
def _grouped_gemm_fp8_variable_k_fake(
    lhs, lhs_scale, rhs, rhs_scale, group_offs, out_dtype, block_size=0, block_base=None
):
    return lhs.new_empty((group_offs.shape[0] - 1, lhs.shape[1], rhs.shape[1]), dtype=out_dtype)


@custom_op("primus_turbo::grouped_gemm_fp8_variable_k_accum", mutates_args=("out",))
def grouped_gemm_fp8_variable_k_accum_impl(
    lhs: torch.Tensor,
    lhs_scale: torch.Tensor,
    rhs: torch.Tensor,
    rhs_scale: torch.Tensor,
    group_offs: torch.Tensor,
    out: torch.Tensor,
    block_size: int = 0,
    block_base: torch.Tensor | None = None,
) -> None:
    """``out[g] +=`` the variable-K product (fp32 ``main_grad``, the fused wgrad accumulation), inside the
    GEMM's epilogue on GPUs: no [G, P, Q] temporary and no separate add."""
    if _variable_k_on_triton(lhs, block_size) and out.stride(-1) == 1:
        operands = (lhs, lhs_scale, rhs, rhs_scale, group_offs)
        _variable_k_triton(*operands, block_size, block_base, out.dtype, out)
        return
    out.add_(_variable_k_reference(lhs, lhs_scale, rhs, rhs_scale, group_offs, block_size))


@grouped_gemm_fp8_variable_k_accum_impl.register_fake
def _grouped_gemm_fp8_variable_k_accum_fake(
    lhs, lhs_scale, rhs, rhs_scale, group_offs, out, block_size=0, block_base=None
):
    return None


@custom_op("primus_turbo::transpose_last_two", mutates_args=())
def transpose_last_two_impl(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``x.transpose(-2, -1)`` for a 2-D or 3-D ``x`` (an expert weight stack): the
    K-major copies FP8 GEMMs read. Coalesced Triton tiles where Triton runs, torch's copy elsewhere."""
    if triton_runs_on(x.device) and (x.stride(-1) == 1 or x.shape[-1] == 1):
        return transpose_triton(x)
    return x.transpose(-2, -1).clone(memory_format=torch.contiguous_format)


@transpose_last_two_impl.register_fake
def _transpose_last_two_fake(x):
    return x.transpose(-2, -1).clone(memory_format=torch.contiguous_format)


@custom_op("primus_turbo::quantize_fp8_experts_tensorwise", mutates_args=())
def quantize_fp8_experts_tensorwise_impl(
    b: torch.Tensor, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q [G, X, Y], q_t [G, Y, X], scale_inv [G, 1, 1])``: each expert weight of ``b`` [G, X, Y] with
    its own scale, in both layouts (the forward's and the input gradient's). Where Triton runs, one amax
    reduction and then every tile read once and written twice; elsewhere the row quantization of the
    [G, X * Y] view and a transposed copy, the same values."""
    groups = b.shape[0]
    if b.numel() and fp8_triton_usable(b, out_dtype):
        q, q_t, scale = tensorwise_with_trans_triton(b.contiguous(), out_dtype)
        return q, q_t, scale.view(groups, 1, 1)
    flat = b.reshape(groups, -1)
    q, scale = quantize_fp8_reference(flat, out_dtype, ScalingGranularity.ROWWISE.value, 0, 1, False)
    q = q.view(b.shape)
    return q, q.transpose(1, 2).clone(memory_format=torch.contiguous_format), scale.view(groups, 1, 1)


@quantize_fp8_experts_tensorwise_impl.register_fake
def _quantize_fp8_experts_tensorwise_fake(b, out_dtype):
    q = torch.empty(b.shape, dtype=out_dtype, device=b.device)
    q_t = torch.empty((b.shape[0], b.shape[2], b.shape[1]), dtype=out_dtype, device=b.device)
    return q, q_t, torch.empty((b.shape[0], 1, 1), dtype=torch.float32, device=b.device)


def _quantize_row_groups(
    x: torch.Tensor, rows: torch.Tensor, groups: int, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [T, C] token-major, scale_inv [groups, C])`` with one scale per (scale row, column), token t
    counting towards scale row ``rows[t]``: the numerics of both group quantizations."""
    mag = x.float().abs()
    amax = mag.new_zeros((groups, x.shape[1])).scatter_reduce(0, rows[:, None].expand_as(mag), mag, "amax")
    multiplier, scale_inv = tensorwise_multipliers(amax, fp8_dtype)
    fp8_max = torch.finfo(fp8_dtype).max
    q = (x.float() * multiplier[rows]).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    return token_major_empty(x, fp8_dtype).copy_(q), scale_inv


def group_columns_reference(
    x: torch.Tensor, group_offs: torch.Tensor, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path of ``quantize_fp8_group_columns`` (the numerics its kernel reproduces)."""
    return _quantize_row_groups(x, _group_ids(group_offs, x.shape[0]), group_offs.numel() - 1, fp8_dtype)


def group_blocks_reference(
    x: torch.Tensor, group_offs: torch.Tensor, fp8_dtype: torch.dtype, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path of ``quantize_fp8_group_blocks`` (the numerics its kernel reproduces)."""
    rows, _ = group_block_rows(group_offs, x.shape[0], block_size)
    count = group_block_count(x.shape[0], group_offs.numel() - 1, block_size)
    return _quantize_row_groups(x, rows, count, fp8_dtype)


@custom_op("primus_turbo::quantize_fp8_group_columns", mutates_args=())
def quantize_fp8_group_columns_impl(
    x: torch.Tensor, group_offs: torch.Tensor, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [T, C], scale_inv [G, C])``: x quantized along its rows within each group, one scale per
    (group, column), with the scale rules of ``quantize_fp8`` (zeros -> 1, NaN/inf -> NaN, saturation);
    ``q`` is token-major (stored [C, T]), as the wgrad GEMM reads it."""
    if triton_runs_on(x.device):
        return quantize_fp8_group_columns_triton(x, group_offs, fp8_dtype)
    return group_columns_reference(x, group_offs, fp8_dtype)


@quantize_fp8_group_columns_impl.register_fake
def _quantize_fp8_group_columns_fake(x, group_offs, fp8_dtype):
    groups = group_offs.shape[0] - 1
    return token_major_empty(x, fp8_dtype), x.new_empty((groups, x.shape[1]), dtype=torch.float32)


@custom_op("primus_turbo::quantize_fp8_group_blocks", mutates_args=())
def quantize_fp8_group_blocks_impl(
    x: torch.Tensor,
    group_offs: torch.Tensor,
    fp8_dtype: torch.dtype,
    block_size: int,
    block_ends: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [T, C], scale_inv [ceil(T / B) + G, C])``: x quantized along its rows in the blocks of
    ``group_blocks`` (``block_size`` tokens aligned in the token dimension, cut at group boundaries), one
    scale per (block, column), with the scale rules of ``quantize_fp8``; unused scale rows hold 1. ``q``
    is token-major (stored [C, T]). ``block_ends`` (``group_block_layout``'s first tensor) saves
    recomputing it."""
    if triton_runs_on(x.device):
        count = group_block_count(x.shape[0], group_offs.numel() - 1, block_size)
        if block_ends is None:
            block_ends = group_block_layout(group_offs, block_size)[0]
        return quantize_fp8_group_blocks_triton(x, group_offs, block_ends, fp8_dtype, block_size, count)
    return group_blocks_reference(x, group_offs, fp8_dtype, block_size)


@quantize_fp8_group_blocks_impl.register_fake
def _quantize_fp8_group_blocks_fake(x, group_offs, fp8_dtype, block_size, block_ends=None):
    count = group_block_count(x.shape[0], group_offs.shape[0] - 1, block_size)
    return token_major_empty(x, fp8_dtype), x.new_empty((count, x.shape[1]), dtype=torch.float32)
