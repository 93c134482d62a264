"""FP8 quantization custom ops ``primus_turbo::quantize_fp8`` / ``dequantize_fp8`` /
``quantize_fp8_with_trans``: Triton kernels on GPUs (and under the interpreter), and the TORCH
reference that defines the numerics (see ``primus_turbo/triton/quantization/fp8_quant_kernel.py``).

Arguments cross the op boundary as plain values: ``granularity`` is ``ScalingGranularity.value``,
``block_size`` 0 means none, ``axis`` is a non-negative dimension (ignored where it does not apply).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from primus_turbo.pytorch.core.custom_op import custom_op
from primus_turbo.pytorch.core.low_precision import ScalingGranularity
from primus_turbo.pytorch.kernels.quantization.dual_block_cuda import (
    PRODUCER_COPY,
    dual_block_cuda,
    dual_block_cuda_usable,
)
from primus_turbo.triton.quantization import (
    EMIT_BLOCK,
    EMIT_ROW,
    EMIT_TENSOR,
    quantize_fp8_dual_blocks_triton,
    quantize_fp8_groups_triton,
    quantize_fp8_with_trans_tiles_triton,
    tensorwise_cast_fp8_triton,
)
from primus_turbo.triton.utils.device_info import triton_runs_on
from primus_turbo.triton.utils.transpose import transpose_triton

__all__ = [
    "FP8_DTYPES",
    "dequantize_fp8_impl",
    "dequantize_fp8_reference",
    "e8m0_scales_from_amax",
    "expand_scale",
    "fp8_triton_usable",
    "mx_emax",
    "quantize_fp8_impl",
    "quantize_fp8_reference",
    "quantize_fp8_with_trans_impl",
    "quantize_fp8_with_trans_reference",
    "scale_inv_shape",
    "tensorwise_multipliers",
    "tensorwise_with_trans_triton",
    "to_block_major",
    "with_trans_empty",
    "EMIT_MODES",
    "fp8_producer_empty",
    "fp8_producer_reference",
]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
_TENSORWISE = ScalingGranularity.TENSORWISE.value
_ROWWISE = ScalingGranularity.ROWWISE.value
_BLOCKWISE = ScalingGranularity.BLOCKWISE.value
_MX = ScalingGranularity.MX_BLOCKWISE.value
_FP32_MAX = torch.finfo(torch.float32).max
_LONG_ROW = 1 << 16
_FEW_ROWS = 4096
_TILE_MAX = 128  # the largest tile the one-read, two-layout kernels hold (2-D blocks up to 128 x 128)


def mx_emax(dtype: torch.dtype) -> int:
    """Largest power-of-two exponent of an element format (8 for E4M3, 15 for E5M2, 7 for E4M3FNUZ)."""
    return math.floor(math.log2(torch.finfo(dtype).max))


class _Groups(NamedTuple):
    """How a quantization maps onto 2-D groups: the dimension that holds the groups (moved last),
    and the group shape (rows x cols; cols 0 = the whole row)."""

    axis: int
    rows: int
    cols: int


def _groups(shape: torch.Size, granularity: int, block_size: int, axis: int, block_2d: bool) -> _Groups:
    if granularity == _ROWWISE:
        return _Groups(axis, 1, 0)
    if granularity == _BLOCKWISE and block_2d:
        return _Groups(len(shape) - 1, block_size, block_size)
    return _Groups(axis, 1, block_size)


def scale_inv_shape(
    shape: torch.Size, granularity: int, block_size: int, axis: int, block_2d: bool
) -> tuple[int, ...]:
    """Shape of ``scale_inv``: () tensorwise; otherwise ``shape`` with each grouped dimension replaced
    by its number of groups (1 for row-wise)."""
    if granularity == _TENSORWISE:
        return ()
    groups = _groups(shape, granularity, block_size, axis, block_2d)
    out = list(shape)
    out[groups.axis] = 1 if groups.cols == 0 else -(-shape[groups.axis] // groups.cols)
    if groups.rows > 1:
        out[-2] = -(-shape[-2] // groups.rows)
    return tuple(out)


def _scale_dtype(granularity: int) -> torch.dtype:
    return torch.float8_e8m0fnu if granularity == _MX else torch.float32


def fp8_triton_usable(x: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Triton on GPUs and under the interpreter; the FNUZ types only exist in Triton on ROCm."""
    if out_dtype in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz) and torch.version.hip is None:
        return False
    return triton_runs_on(x.device)


def e8m0_scales_from_amax(amax: torch.Tensor, emax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MX scales: (multiplier ``2**-e`` for x, E8M0 ``2**e``) with ``e = floor(log2(amax)) - emax``
    clamped to [-127, 127], ``e = 0`` for all-zero groups and NaN for non-finite ones."""
    finite = torch.isfinite(amax)
    exponent = torch.where(amax > 0, torch.frexp(amax).exponent - 1 - emax, 0).clamp(-127, 127)
    exponent = torch.where(finite, exponent, 0)
    stored = torch.where(finite, torch.exp2(exponent.float()), torch.nan).to(torch.float8_e8m0fnu)
    return torch.exp2(-exponent.float()), stored


def tensorwise_multipliers(amax: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(multiplier for x, scale_inv) of any amax tensor under the rules of ``quantize_fp8``."""
    return _scales_from_amax(amax, fp8_dtype, mx=False)


def _scales_from_amax(
    amax: torch.Tensor, fp8_dtype: torch.dtype, mx: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(multiplier for x, stored scale_inv) from group amax values; see the module docstring rules."""
    finite = torch.isfinite(amax)
    if mx:
        return e8m0_scales_from_amax(amax, mx_emax(fp8_dtype))
    # tensor / tensor divisions: ``scalar / tensor`` is a reciprocal times the scalar in torch, which
    # rounds differently from the kernels' correctly rounded division
    fp8_max = torch.full_like(amax, torch.finfo(fp8_dtype).max)
    multiplier = torch.where(amax > 0, (fp8_max / amax).clamp(max=_FP32_MAX), 1.0)
    multiplier = torch.where(finite, multiplier, 1.0)
    return multiplier, torch.where(finite, torch.ones_like(multiplier) / multiplier, torch.nan)


def _saturate_cast(y: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    fp8_max = torch.finfo(fp8_dtype).max
    return y.clamp(-fp8_max, fp8_max).to(fp8_dtype)


def _quantize_2d_reference(
    x: torch.Tensor, fp8_dtype: torch.dtype, group_rows: int, group_cols: int, mx: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for the 2-D group kernel: pad to whole groups with zeros, reduce, scale, unpad."""
    rows, cols = x.shape
    whole_row = group_cols == 0  # one scale per row, 1 even for a row without elements
    group_cols = group_cols or max(cols, 1)
    n_r, n_c = -(-rows // group_rows), 1 if whole_row else -(-cols // group_cols)
    padded = torch.zeros(n_r * group_rows, n_c * group_cols, dtype=torch.float32, device=x.device)
    padded[:rows, :cols] = x
    tiles = padded.view(n_r, group_rows, n_c, group_cols)
    amax = tiles.abs().amax(dim=(1, 3))
    multiplier, stored = _scales_from_amax(amax, fp8_dtype, mx)
    q = _saturate_cast(tiles * multiplier[:, None, :, None], fp8_dtype)
    return q.view(n_r * group_rows, n_c * group_cols)[:rows, :cols], stored


def _long_rows(x: torch.Tensor, q: torch.Tensor, group_rows: int, group_cols: int, mx: bool) -> bool:
    """Whole-row scales over a few rows (at most ``_FEW_ROWS``, one grid axis of the cast) of at least
    ``_LONG_ROW`` elements, contiguous in and out (e.g. one scale per expert weight of a [G, N * K]
    view): too few rows to spread over the SMs."""
    rows, cols = x.shape
    return (
        not mx
        and group_rows == 1
        and group_cols == cols
        and cols >= _LONG_ROW
        and 0 < rows <= _FEW_ROWS
        and x.is_contiguous()
        and q.is_contiguous()
    )


def _quantize_2d(x, q, fp8_dtype, group_rows, group_cols, mx, triton_path, block_major=False) -> torch.Tensor:
    """Quantize the 2-D view ``x`` into the 2-D view ``q``; returns the (n_r, n_c) scales, stored
    block-major (each block's rows adjacent) when ``block_major``."""
    rows, cols = x.shape
    if not triton_path or cols == 0:
        q_ref, scale = _quantize_2d_reference(x, fp8_dtype, group_rows, group_cols, mx)
        q.copy_(q_ref)
        return to_block_major(scale) if block_major else scale
    group_cols = group_cols or cols
    if _long_rows(x, q, group_rows, group_cols, mx):
        # one program per row would stream a whole expert weight alone: the amaxes come from a
        # reduction over all SMs, then one cast over every row's slice
        amax = torch.linalg.vector_norm(x, float("inf"), dim=1, dtype=torch.float32)
        scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
        tensorwise_cast_fp8_triton(x, q, amax, scale)
        return scale
    shape = (-(-rows // group_rows), -(-cols // group_cols))
    dtype = torch.uint8 if mx else torch.float32
    scale = (
        _block_major_empty(*shape, dtype, x.device)
        if block_major
        else torch.empty(shape, dtype=dtype, device=x.device)
    )
    quantize_fp8_groups_triton(x, q, scale, group_cols, group_rows, mx_emax(fp8_dtype) if mx else None)
    return scale.view(torch.float8_e8m0fnu) if mx else scale


def _quantize(
    x: torch.Tensor,
    out_dtype: torch.dtype,
    granularity: int,
    block_size: int,
    axis: int,
    block_2d: bool,
    triton_path: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    if granularity == _TENSORWISE:
        x = x.contiguous()
        if x.numel() == 0:
            amax = torch.zeros((), dtype=torch.float32, device=x.device)
        else:
            amax = torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)
        if triton_path and x.numel():
            q = torch.empty_like(x, dtype=out_dtype)
            scale_inv = torch.empty((), dtype=torch.float32, device=x.device)
            tensorwise_cast_fp8_triton(x, q, amax, scale_inv)
            return q, scale_inv
        multiplier, scale_inv = _scales_from_amax(amax, out_dtype, mx=False)
        return _saturate_cast(x.float() * multiplier, out_dtype), scale_inv
    groups = _groups(x.shape, granularity, block_size, axis, block_2d)
    mx = granularity == _MX
    one_d = _one_d_blocks(groups)
    moved = x.movedim(groups.axis, -1)
    if x.dim() == 2 and groups.axis == 0:
        q = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        scale = _quantize_2d(moved, q.t(), out_dtype, groups.rows, groups.cols, mx, triton_path, one_d)
        return q, scale.t()
    x2d = moved.reshape(math.prod(moved.shape[:-1]), moved.shape[-1])
    q2d = torch.empty(x2d.shape, dtype=out_dtype, device=x.device)
    scale = _quantize_2d(x2d, q2d, out_dtype, groups.rows, groups.cols, mx, triton_path, one_d)
    if groups.rows > 1:
        return q2d.view(x.shape), scale
    q = q2d.view(moved.shape).movedim(-1, groups.axis).contiguous()
    scale = scale.view(*moved.shape[:-1], scale.shape[-1]).movedim(-1, groups.axis)
    return q, scale


def quantize_fp8_reference(
    x: torch.Tensor, out_dtype: torch.dtype, granularity: int, block_size: int, axis: int, block_2d: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The TORCH path of ``quantize_fp8`` (the numerics every kernel must reproduce bit for bit)."""
    return _quantize(x, out_dtype, granularity, block_size, axis, block_2d, triton_path=False)


def _one_d_blocks(groups: _Groups) -> bool:
    """1 x B groups (BLOCKWISE along one axis, MX): their scales are stored block-major."""
    return groups.rows == 1 and groups.cols > 0


def _block_major_empty(rows: int, blocks: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty (rows, blocks) scale tensor stored block-major: each block's rows adjacent in memory."""
    return torch.empty((blocks, rows), dtype=dtype, device=device).t()


def to_block_major(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` (rows, blocks) stored block-major, each block's rows adjacent (a copy unless it already
    is; E8M0 codes move as bytes): the layout cuBLASLt reads 1 x 128 scales in."""
    if scale.dtype == torch.float8_e8m0fnu:
        return to_block_major(scale.view(torch.uint8)).view(scale.dtype)
    return scale.t().contiguous().t()


def _with_trans_blocks(x: torch.Tensor, out_dtype: torch.dtype, granularity: int, block: int):
    """Both 1-D block quantizations from one read of ``x`` (the DeepSeek-V3 activation recipe): the C++
    kernel where it runs (``dual_block_cuda``), else Triton (which stores MX scales as raw bytes)."""
    q, scale, q_t, scale_t = with_trans_empty(*x.shape, out_dtype, granularity, block, x.device)
    if granularity == _MX:
        raw = (scale.view(torch.uint8), scale_t.view(torch.uint8))
        quantize_fp8_dual_blocks_triton(x, q, raw[0], q_t, raw[1], block, mx_emax(out_dtype))
    elif dual_block_cuda_usable(x, out_dtype, block):
        dual_block_cuda(x, PRODUCER_COPY, q, scale, q_t, scale_t)
    else:
        quantize_fp8_dual_blocks_triton(x, q, scale, q_t, scale_t, block, None)
    return q, scale, q_t, scale_t


def _with_trans_2d_blocks(x: torch.Tensor, out_dtype: torch.dtype, block: int, triton_path: bool):
    """B x B block quantization of a weight (M, K) or a stack of them (G, M, K), and the transposed
    copy (..., K, M); the scales serve both directions. Copies, never views: a custom op's outputs must
    not alias each other. On the Triton path each block is read once and written in both layouts."""
    if triton_path and block <= _TILE_MAX and x.stride(-1) == 1:
        outputs = _with_trans_2d_blocks_empty(x.shape, out_dtype, block, x.device)
        q, scale, q_t, scale_t = (t if x.dim() == 3 else t.unsqueeze(0) for t in outputs)
        quantize_fp8_with_trans_tiles_triton(
            x if x.dim() == 3 else x.unsqueeze(0), q, q_t, scale, scale_t, tile=block
        )
        return outputs
    if x.dim() == 3 and x.shape[1] % block:  # blocks would straddle two slices of a flat (G * M, K) view
        per_slice = [_with_trans_2d_blocks(w, out_dtype, block, triton_path) for w in x.unbind()]
        return tuple(torch.stack(parts) for parts in zip(*per_slice, strict=True))
    flat = x.reshape(-1, x.shape[-1])
    q, scale = _quantize(flat, out_dtype, _BLOCKWISE, block, 1, True, triton_path)
    q = q.view(x.shape)
    scale = scale.view(*x.shape[:-2], -(-x.shape[-2] // block), scale.shape[-1])
    contiguous = torch.contiguous_format
    q_t = transpose_triton(q) if triton_path else q.transpose(-2, -1).clone(memory_format=contiguous)
    return q, scale, q_t, scale.transpose(-2, -1).clone(memory_format=contiguous)


def _with_trans_2d_blocks_empty(shape: torch.Size, out_dtype: torch.dtype, block: int, device):
    """Empty ``(q, scale_inv, q_t, scale_inv_t)`` of ``_with_trans_2d_blocks`` for an (..., M, K) input."""
    *batch, m, k = shape
    blocks_m, blocks_k = -(-m // block), -(-k // block)
    q = torch.empty(shape, dtype=out_dtype, device=device)
    q_t = torch.empty((*batch, k, m), dtype=out_dtype, device=device)
    scale = torch.empty((*batch, blocks_m, blocks_k), dtype=torch.float32, device=device)
    scale_t = torch.empty((*batch, blocks_k, blocks_m), dtype=torch.float32, device=device)
    return q, scale, q_t, scale_t


def _with_trans(x, out_dtype, granularity, block_size, block_2d, triton_path):
    if granularity == _BLOCKWISE and block_2d:
        return _with_trans_2d_blocks(x, out_dtype, block_size, triton_path)
    if granularity == _TENSORWISE and triton_path and x.numel():
        q, q_t, scale = tensorwise_with_trans_triton(x.contiguous().unsqueeze(0), out_dtype)
        return q[0], scale.view(()), q_t[0], scale.view(()).clone()
    if granularity == _TENSORWISE:
        q, scale = _quantize(x, out_dtype, granularity, block_size, 1, block_2d, triton_path)
        # copies, never views: a custom op's outputs must not alias each other
        contiguous = torch.contiguous_format
        return q, scale, q.t().clone(memory_format=contiguous), scale.t().clone(memory_format=contiguous)
    if triton_path and granularity in (_BLOCKWISE, _MX):
        return _with_trans_blocks(x, out_dtype, granularity, block_size)
    q, scale = _quantize(x, out_dtype, granularity, block_size, 1, block_2d, triton_path)
    groups = _groups(x.shape, granularity, block_size, 1, block_2d)
    q_t = torch.empty((x.shape[1], x.shape[0]), dtype=out_dtype, device=x.device)
    mx, one_d = granularity == _MX, _one_d_blocks(groups)
    scale_t = _quantize_2d(x.t(), q_t, out_dtype, groups.rows, groups.cols, mx, triton_path, one_d)
    return q, scale, q_t, scale_t


def tensorwise_with_trans_triton(x: torch.Tensor, out_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """``(q [B, R, C], q_t [B, C, R], scale_inv [B])`` for a contiguous non-empty x [B, R, C], one scale per
    slice ``b`` (a tensor, or each expert of a weight stack): one amax reduction, then each tile read once
    and written in both layouts."""
    amax = torch.linalg.vector_norm(x.reshape(x.shape[0], -1), float("inf"), dim=1, dtype=torch.float32)
    q = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    q_t = torch.empty((x.shape[0], x.shape[2], x.shape[1]), dtype=out_dtype, device=x.device)
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    tile = _TILE_MAX if x.element_size() <= 2 else _TILE_MAX // 2
    quantize_fp8_with_trans_tiles_triton(x, q, q_t, scale, amax=amax, tile=tile)
    return q, q_t, scale


def quantize_fp8_with_trans_reference(
    x: torch.Tensor, out_dtype: torch.dtype, granularity: int, block_size: int, block_2d: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The TORCH path of ``quantize_fp8_with_trans``."""
    return _with_trans(x, out_dtype, granularity, block_size, block_2d, triton_path=False)


@custom_op("primus_turbo::quantize_fp8", mutates_args=())
def quantize_fp8_impl(
    x: torch.Tensor, out_dtype: torch.dtype, granularity: int, block_size: int, axis: int, block_2d: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale_inv)`` of ``x``; see ``ops.quantization.quantize_fp8``."""
    return _quantize(x, out_dtype, granularity, block_size, axis, block_2d, fp8_triton_usable(x, out_dtype))


@quantize_fp8_impl.register_fake
def _quantize_fp8_fake(x, out_dtype, granularity, block_size, axis, block_2d):
    shape = scale_inv_shape(x.shape, granularity, block_size, axis, block_2d)
    dtype = _scale_dtype(granularity)
    q = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if granularity == _TENSORWISE:
        return q, x.new_empty(shape, dtype=dtype)
    groups = _groups(x.shape, granularity, block_size, axis, block_2d)
    # scales are computed with the grouped dimension last, then moved back
    moved = [n for i, n in enumerate(shape) if i != groups.axis] + [shape[groups.axis]]
    if _one_d_blocks(groups):
        lead = moved[:-1]
        scale = _block_major_empty(math.prod(lead), moved[-1], dtype, x.device).view(moved)
        return q, scale.movedim(-1, groups.axis)
    if groups.axis == x.dim() - 1:
        return q, x.new_empty(shape, dtype=dtype)
    return q, x.new_empty(moved, dtype=dtype).movedim(-1, groups.axis)


@custom_op("primus_turbo::quantize_fp8_with_trans", mutates_args=())
def quantize_fp8_with_trans_impl(
    x: torch.Tensor, out_dtype: torch.dtype, granularity: int, block_size: int, block_2d: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row-wise ``(q, scale_inv)`` of ``x`` (M, K) and column-wise ones stored as (K, M)."""
    return _with_trans(x, out_dtype, granularity, block_size, block_2d, fp8_triton_usable(x, out_dtype))


def with_trans_empty(
    m: int, k: int, out_dtype: torch.dtype, granularity: int, block_size: int, device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty ``(q, scale_inv, q_t, scale_inv_t)`` shaped and laid out as ``quantize_fp8_with_trans``
    returns them for an (m, k) input without 2-D blocks (those: ``_with_trans_2d_blocks_empty``); the
    first two are also ``quantize_fp8``'s along axis 1."""
    dtype = _scale_dtype(granularity)
    row_scale = scale_inv_shape(torch.Size((m, k)), granularity, block_size, 1, False)
    col_scale = scale_inv_shape(torch.Size((k, m)), granularity, block_size, 1, False)
    if _one_d_blocks(_groups(torch.Size((m, k)), granularity, block_size, 1, False)):
        scales = (
            _block_major_empty(*row_scale, dtype, device),
            _block_major_empty(*col_scale, dtype, device),
        )
    else:
        scales = (
            torch.empty(row_scale, dtype=dtype, device=device),
            torch.empty(col_scale, dtype=dtype, device=device),
        )
    q = torch.empty((m, k), dtype=out_dtype, device=device)
    return q, scales[0], torch.empty((k, m), dtype=out_dtype, device=device), scales[1]


@quantize_fp8_with_trans_impl.register_fake
def _quantize_fp8_with_trans_fake(x, out_dtype, granularity, block_size, block_2d):
    if granularity == _BLOCKWISE and block_2d:
        return _with_trans_2d_blocks_empty(x.shape, out_dtype, block_size, x.device)
    return with_trans_empty(*x.shape, out_dtype, granularity, block_size, x.device)


EMIT_MODES = {_TENSORWISE: EMIT_TENSOR, _ROWWISE: EMIT_ROW, _BLOCKWISE: EMIT_BLOCK}


def fp8_producer_empty(
    shape: torch.Size, fp8_dtype: torch.dtype, granularity: int, block_size: int, columnwise: bool, device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty ``(q, scale_inv, q_t, scale_inv_t)`` of a fused FP8 producer with a (rows, H) output, laid
    out as ``quantize_fp8_with_trans`` returns them; without ``columnwise`` the last two are empty."""
    q, scale, q_t, scale_t = with_trans_empty(*shape, fp8_dtype, granularity, block_size, device)
    if not columnwise:
        q_t, scale_t = q_t.new_empty(0), scale_t.new_empty(0)
    return q, scale, q_t, scale_t


def fp8_producer_reference(
    y: torch.Tensor, fp8_dtype: torch.dtype, granularity: int, block_size: int, columnwise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The TORCH path of a fused FP8 producer: its output ``y`` quantized, laid out as
    ``fp8_producer_empty``."""
    if columnwise:
        return _with_trans(y, fp8_dtype, granularity, block_size, False, triton_path=False)
    q, scale = _quantize(y, fp8_dtype, granularity, block_size, 1, False, triton_path=False)
    return q, scale, q.new_empty(0), scale.new_empty(0)


def expand_scale(
    scale: torch.Tensor, shape: torch.Size, granularity: int, block_size: int, axis: int, block_2d: bool
) -> torch.Tensor:
    """fp32 scales of a tensor of ``shape``, broadcastable against it: each group's scale repeated over
    the group (2-D blocks tile the last two dimensions)."""
    scale = scale.float()
    if granularity in (_TENSORWISE, _ROWWISE):
        return scale
    groups = _groups(shape, granularity, block_size, axis, block_2d)
    scale = scale.repeat_interleave(groups.cols, dim=groups.axis).narrow(groups.axis, 0, shape[groups.axis])
    if groups.rows > 1:
        scale = scale.repeat_interleave(groups.rows, dim=-2).narrow(-2, 0, shape[-2])
    return scale


def dequantize_fp8_reference(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    granularity: int,
    block_size: int,
    axis: int,
    block_2d: bool,
) -> torch.Tensor:
    """``q * scale_inv`` with the scales expanded over their groups, in ``out_dtype``."""
    scale = expand_scale(scale_inv, q.shape, granularity, block_size, axis, block_2d)
    return (q.float() * scale).to(out_dtype).contiguous()


@custom_op("primus_turbo::dequantize_fp8", mutates_args=())
def dequantize_fp8_impl(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    granularity: int,
    block_size: int,
    axis: int,
    block_2d: bool,
) -> torch.Tensor:
    """``q * scale_inv`` (scales expanded over their groups) in ``out_dtype``."""
    return dequantize_fp8_reference(q, scale_inv, out_dtype, granularity, block_size, axis, block_2d)


@dequantize_fp8_impl.register_fake
def _dequantize_fp8_fake(q, scale_inv, out_dtype, granularity, block_size, axis, block_2d):
    return torch.empty(q.shape, dtype=out_dtype, device=q.device)
