"""FP8 quantization with one scale per group of elements, in Triton.

The launchers take a 2-D view ``x`` (R, C) whose last dimension holds the groups: a whole row
(row-wise scaling), ``1 x B`` blocks (activations), ``B x B`` blocks (weights) or MX blocks of 32
with power-of-two E8M0 scales. Any strides work, so a column-wise quantization is the same launch on
the transposed view. Scale rules (shared with the TORCH reference in ``kernels/quantization``):

- ``scale = fp8_max / amax`` (capped at the fp32 maximum), ``scale = 1`` for an all-zero group;
- a group holding NaN or +-inf gets ``scale_inv = NaN`` (E8M0: the NaN code 0xFF), so whatever is
  computed from it is NaN rather than silently finite; its elements are scaled by 1;
- ``q = clamp(x * scale, -fp8_max, fp8_max)`` rounded to nearest even; NaN stays NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from primus_turbo.triton.utils.device_info import fp8_cast_saturates
from primus_turbo.triton.utils.launch import cached_launch

__all__ = [
    "e8m0_scale",
    "quantize_fp8_dual_blocks_triton",
    "quantize_fp8_groups_triton",
    "quantize_fp8_with_trans_tiles_triton",
    "tensorwise_cast_fp8_triton",
]

_FP32_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def e8m0_scale(amax, bad, EMAX: tl.constexpr):
    """MX scale of groups with ``amax`` and ``bad`` non-finite values: (multiplier 2**-e applied to x,
    E8M0 code of 2**e) with ``e = floor(log2(amax)) - EMAX`` clamped to [-127, 127]; 0xFF when bad."""
    exp = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    shared = tl.where(amax > 0, exp - EMAX, 0)
    shared = tl.minimum(tl.maximum(shared, -127), 127)
    shared = tl.where(bad > 0, 0, shared)
    multiplier = ((127 - shared) << 23).to(tl.float32, bitcast=True)
    return multiplier, tl.where(bad > 0, 255, shared + 127).to(tl.uint8)


@triton.jit
def _group_scale(amax, bad, FP8_MAX: tl.constexpr, MX: tl.constexpr, MX_EMAX: tl.constexpr):
    """(multiplier applied to x, stored scale) from a group's amax and non-finite count."""
    if MX:
        multiplier, stored = e8m0_scale(amax, bad, MX_EMAX)
    else:
        safe_amax = tl.where(amax > 0, amax, 1.0)
        ratio = tl.math.div_rn(FP8_MAX + tl.zeros_like(amax), safe_amax)
        multiplier = tl.where(amax > 0, tl.minimum(ratio, _FP32_MAX), 1.0)
        multiplier = tl.where(bad > 0, 1.0, multiplier)
        stored = tl.where(
            bad > 0, float("nan"), tl.math.div_rn(tl.full(multiplier.shape, 1.0, tl.float32), multiplier)
        )
    return multiplier, stored


@triton.jit
def _saturate(y, FP8_MAX: tl.constexpr, CAST_SATURATES: tl.constexpr = False):
    """y clamped to +-FP8_MAX, NaN kept: the FP8 cast's input. Where the cast saturates by itself
    (``fp8_cast_saturates``), a no-op: the clamp is a quarter of a quantization kernel's instructions."""
    if CAST_SATURATES:
        return y
    return tl.where(y != y, y, tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX))


@cached_launch
@triton.jit
def _quantize_groups_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    R,
    C,
    stride_xr,
    stride_xc,
    stride_qr,
    stride_qc,
    stride_sr,
    stride_sc,
    GROUP_C,
    FP8_MAX: tl.constexpr,
    GROUP_R: tl.constexpr,
    MX: tl.constexpr,
    MX_EMAX: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    CAST_SATURATES: tl.constexpr,
):
    """One program: BLOCK_R rows x one column group. GROUP_R == 1 gives each row its own scale;
    GROUP_R == BLOCK_R makes the whole BLOCK_R x GROUP_C tile one group (2-D blocks)."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    row_ok = rows < R
    c_begin = pid_c * GROUP_C
    c_end = tl.minimum(c_begin + GROUP_C, C)
    amax = tl.zeros([BLOCK_R], dtype=tl.float32)
    bad = tl.zeros([BLOCK_R], dtype=tl.int32)
    for c0 in range(c_begin, c_end, BLOCK_C):
        cols = (c0 + tl.arange(0, BLOCK_C)).to(tl.int64)
        mask = row_ok[:, None] & (cols < c_end)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0)
        mag = tl.abs(x.to(tl.float32))
        nonfinite = (mag != mag) | (mag == float("inf"))
        bad += tl.sum(nonfinite.to(tl.int32), axis=1)
        amax = tl.maximum(amax, tl.max(tl.where(nonfinite, 0.0, mag), axis=1))
    if GROUP_R > 1:
        amax = tl.zeros([BLOCK_R], dtype=tl.float32) + tl.max(amax, axis=0)
        bad = tl.zeros([BLOCK_R], dtype=tl.int32) + tl.sum(bad, axis=0)
    multiplier, stored = _group_scale(amax, bad, FP8_MAX, MX, MX_EMAX)
    for c0 in range(c_begin, c_end, BLOCK_C):
        cols = (c0 + tl.arange(0, BLOCK_C)).to(tl.int64)
        mask = row_ok[:, None] & (cols < c_end)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0)
        q = _saturate(x.to(tl.float32) * multiplier[:, None], FP8_MAX, CAST_SATURATES)
        tl.store(
            q_ptr + rows[:, None] * stride_qr + cols[None, :] * stride_qc,
            q.to(q_ptr.dtype.element_ty),
            mask=mask,
        )
    if GROUP_R > 1:
        first = tl.arange(0, BLOCK_R) == 0
        s_offs = pid_r * stride_sr + pid_c * stride_sc + tl.zeros([BLOCK_R], dtype=tl.int64)
        tl.store(s_ptr + s_offs, stored, mask=first)
    else:
        tl.store(s_ptr + rows * stride_sr + pid_c * stride_sc, stored, mask=row_ok)


@triton.jit
def _nan_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _group_amax(mag, AXIS: tl.constexpr, N_GROUPS: tl.constexpr, GROUP: tl.constexpr, TILE: tl.constexpr):
    """NaN-propagating amax of the GROUP-long groups along AXIS of a square tile: NaN or inf exactly
    where a group holds such a value. Shape (TILE,) for one group per tile, else (N_GROUPS, TILE) /
    (TILE, N_GROUPS)."""
    if N_GROUPS == 1:
        amax = tl.reduce(mag, AXIS, _nan_max)
    elif AXIS == 1:
        amax = tl.reduce(tl.reshape(mag, (TILE, N_GROUPS, GROUP)), 2, _nan_max)
    else:
        amax = tl.reduce(tl.reshape(mag, (N_GROUPS, GROUP, TILE)), 1, _nan_max)
    return amax


@triton.jit
def _scale_groups(
    x, multiplier, AXIS: tl.constexpr, N_GROUPS: tl.constexpr, GROUP: tl.constexpr, TILE: tl.constexpr
):
    """x (TILE, TILE) times each group's multiplier, as laid out by ``_group_amax``."""
    if N_GROUPS == 1 and AXIS == 1:
        y = x * multiplier[:, None]
    elif N_GROUPS == 1:
        y = x * multiplier[None, :]
    elif AXIS == 1:
        y = tl.reshape(tl.reshape(x, (TILE, N_GROUPS, GROUP)) * multiplier[:, :, None], (TILE, TILE))
    else:
        y = tl.reshape(tl.reshape(x, (N_GROUPS, GROUP, TILE)) * multiplier[:, None, :], (TILE, TILE))
    return y


@triton.jit
def _quantize_along(
    x,
    amax,
    lines,
    lines_ok,
    tile_index,
    length,
    s_ptr,
    stride_line,
    stride_group,
    AXIS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MX: tl.constexpr,
    MX_EMAX: tl.constexpr,
    GROUP: tl.constexpr,
    N_GROUPS: tl.constexpr,
    TILE: tl.constexpr,
    CAST_SATURATES: tl.constexpr,
):
    """One direction of the dual quantization: x (TILE, TILE) scaled by its groups along AXIS (amax from
    ``_group_amax``) and saturated; the scale of each line's group goes to ``s_ptr + line * stride_line +
    group * stride_group``. ``lines`` are the tile's rows (AXIS 1) or columns (AXIS 0), ``tile_index`` the
    tile's position along the grouped dimension of ``length`` elements."""
    bad = ((amax != amax) | (amax == float("inf"))).to(tl.int32)
    multiplier, stored = _group_scale(amax, bad, FP8_MAX, MX, MX_EMAX)
    q = _saturate(_scale_groups(x, multiplier, AXIS, N_GROUPS, GROUP, TILE), FP8_MAX, CAST_SATURATES)
    if N_GROUPS == 1:
        tl.store(s_ptr + lines * stride_line + tile_index * stride_group, stored, mask=lines_ok)
    else:
        groups = tile_index.to(tl.int64) * N_GROUPS + tl.arange(0, N_GROUPS)
        if AXIS == 1:
            per_line = stored
        else:
            per_line = tl.trans(stored)
        s_mask = lines_ok[:, None] & (groups < tl.cdiv(length, GROUP))[None, :]
        tl.store(s_ptr + lines[:, None] * stride_line + groups[None, :] * stride_group, per_line, mask=s_mask)
    return q


@cached_launch
@triton.jit
def _quantize_dual_blocks_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    qt_ptr,
    st_ptr,
    M,
    K,
    stride_xm,
    stride_xk,
    stride_sm,
    stride_sk,
    stride_stk,
    stride_stm,
    FP8_MAX: tl.constexpr,
    MX: tl.constexpr,
    MX_EMAX: tl.constexpr,
    GROUP: tl.constexpr,
    N_GROUPS: tl.constexpr,
    TILE: tl.constexpr,
    CAST_SATURATES: tl.constexpr,
):
    """One TILE x TILE tile of x (M, K), read once: 1 x GROUP groups along K go to ``q`` (M, K) and
    ``s`` (M, K / GROUP); GROUP x 1 groups along M go, transposed, to ``qt`` (K, M) and ``st``
    (K, M / GROUP). ``q`` and ``qt`` are contiguous; the scales take any strides. Addresses are 32-bit
    offsets from the tile's corner, and the non-finite test rides on NaN-propagating maxima: both keep
    the kernel within 128 registers, two programs per SM."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    r = tl.arange(0, TILE)
    rows = pid_m.to(tl.int64) * TILE + r
    cols = pid_k.to(tl.int64) * TILE + r
    rows_ok = rows < M
    cols_ok = cols < K
    mask = rows_ok[:, None] & cols_ok[None, :]
    x_tile = x_ptr + pid_m.to(tl.int64) * TILE * stride_xm + pid_k.to(tl.int64) * TILE * stride_xk
    x = tl.load(x_tile + r[:, None] * stride_xm + r[None, :] * stride_xk, mask=mask, other=0.0)
    x = x.to(tl.float32)
    mag = tl.abs(x)
    amax = _group_amax(mag, 1, N_GROUPS, GROUP, TILE)
    amax_t = _group_amax(mag, 0, N_GROUPS, GROUP, TILE)
    q = _quantize_along(
        x,
        amax,
        rows,
        rows_ok,
        pid_k,
        K,
        s_ptr,
        stride_sm,
        stride_sk,
        1,
        FP8_MAX,
        MX,
        MX_EMAX,
        GROUP,
        N_GROUPS,
        TILE,
        CAST_SATURATES,
    )
    q_tile = q_ptr + pid_m.to(tl.int64) * TILE * K + pid_k * TILE
    tl.store(q_tile + r[:, None] * K + r[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    q_t = _quantize_along(
        x,
        amax_t,
        cols,
        cols_ok,
        pid_m,
        M,
        st_ptr,
        stride_stk,
        stride_stm,
        0,
        FP8_MAX,
        MX,
        MX_EMAX,
        GROUP,
        N_GROUPS,
        TILE,
        CAST_SATURATES,
    )
    qt_tile = qt_ptr + pid_k.to(tl.int64) * TILE * M + pid_m * TILE
    tl.store(
        qt_tile + r[:, None] * M + r[None, :], tl.trans(q_t).to(qt_ptr.dtype.element_ty), mask=tl.trans(mask)
    )


@cached_launch
@triton.jit
def _tensorwise_cast_kernel(
    x_ptr,
    q_ptr,
    amax_ptr,
    scale_inv_ptr,
    N,
    FP8_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
    CAST_SATURATES: tl.constexpr,
):
    """q = saturate(x * multiplier) for contiguous slices of N elements (axis 1 of the grid: one slice
    per amax, e.g. one per expert weight), the multiplier derived in every program from its slice's
    amax (``_group_scale``'s rules); the slice's first program also stores scale_inv. Deriving it here
    instead of in torch saves a string of one-element launches per quantization."""
    pid = tl.program_id(0)
    group = tl.program_id(1)
    amax = tl.load(amax_ptr + group)
    bad = ((amax != amax) | (amax == float("inf"))).to(tl.int32)
    multiplier, stored = _group_scale(amax, bad, FP8_MAX, False, 0)
    if pid == 0:
        tl.store(scale_inv_ptr + group, stored)
    offs = group.to(tl.int64) * N + pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK) < N
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    q = _saturate(x * multiplier, FP8_MAX, CAST_SATURATES)
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def finite_tile_amax(x):
    """(amax of the finite magnitudes of a 2-D tile, its count of NaN / inf values): the inputs of a 2-D
    block's ``_group_scale``."""
    mag = tl.abs(x)
    nonfinite = (mag != mag) | (mag == float("inf"))
    bad = tl.sum(tl.sum(nonfinite.to(tl.int32), axis=1), axis=0)
    amax = tl.max(tl.max(tl.where(nonfinite, 0.0, mag), axis=1), axis=0)
    return amax, bad


@triton.jit
def store_tile_with_trans(
    x, multiplier, q_ptr, q_t_ptr, r, c, rows, cols, mask, FP8_MAX: tl.constexpr, CAST_SATURATES: tl.constexpr
):
    """The fp32 tile ``x`` at rows ``r`` and columns ``c`` of a [rows, cols] matrix, times ``multiplier``
    and saturated, stored in ``q`` [rows, cols] and transposed in ``q_t`` [cols, rows] (a uint8 view: the
    transposed copy moves as bytes, as the plain transpose kernel does)."""
    q = _saturate(x * multiplier, FP8_MAX, CAST_SATURATES).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + r[:, None] * cols + c[None, :], q, mask=mask)
    bits = tl.trans(q.to(tl.uint8, bitcast=True))
    tl.store(q_t_ptr + c[:, None] * rows + r[None, :], bits, mask=tl.trans(mask))


@cached_launch
@triton.jit
def _quantize_with_trans_tiles_kernel(
    x_ptr,
    q_ptr,
    q_t_ptr,
    s_ptr,
    s_t_ptr,
    amax_ptr,
    rows,
    cols,
    stride_xb,
    stride_xr,
    stride_sb,
    stride_sr,
    stride_stb,
    stride_str,
    FP8_MAX: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_2D: tl.constexpr,
    CAST_SATURATES: tl.constexpr,
):
    """One TILE x TILE tile of slice ``b`` of x [B, rows, cols], read once, written twice: ``q`` [B, rows,
    cols] and its transpose ``q_t`` [B, cols, rows] (both contiguous). BLOCK_2D: the tile is one scale
    group (its scale_inv at (b, tile row, tile column) of ``s`` and transposed of ``s_t``); otherwise
    slice b's multiplier comes from ``amax_ptr[b]`` and its first tile stores scale_inv at ``s_ptr[b]``."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    r = (pid_r * TILE + tl.arange(0, TILE)).to(tl.int64)
    c = (pid_c * TILE + tl.arange(0, TILE)).to(tl.int64)
    mask = (r < rows)[:, None] & (c < cols)[None, :]
    x = tl.load(x_ptr + b * stride_xb + r[:, None] * stride_xr + c[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    if BLOCK_2D:
        amax, bad = finite_tile_amax(x)
        multiplier, stored = _group_scale(amax, bad, FP8_MAX, False, 0)
        tl.store(s_ptr + b * stride_sb + pid_r * stride_sr + pid_c, stored)
        tl.store(s_t_ptr + b * stride_stb + pid_c * stride_str + pid_r, stored)
    else:
        amax = tl.load(amax_ptr + b)
        bad = ((amax != amax) | (amax == float("inf"))).to(tl.int32)
        multiplier, stored = _group_scale(amax, bad, FP8_MAX, False, 0)
        if pid_r == 0 and pid_c == 0:
            tl.store(s_ptr + b, stored)
    size = rows.to(tl.int64) * cols
    store_tile_with_trans(
        x, multiplier, q_ptr + b * size, q_t_ptr + b * size, r, c, rows, cols, mask, FP8_MAX, CAST_SATURATES
    )


def quantize_fp8_with_trans_tiles_triton(
    x: torch.Tensor,
    q: torch.Tensor,
    q_t: torch.Tensor,
    scale: torch.Tensor,
    scale_t: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
    tile: int = 128,
) -> None:
    """Quantize x [B, R, C] (unit last stride) into contiguous ``q`` [B, R, C] and ``q_t`` [B, C, R] in one
    read. Without ``amax``: ``tile`` x ``tile`` blocks, each its own scale group, ``scale`` [B, R / tile,
    C / tile] and ``scale_t`` [B, C / tile, R / tile] (unit last strides). With ``amax`` [B] (fp32, one
    per slice): slice b scaled from ``amax[b]``, its scale_inv written to ``scale`` [B]."""
    batch, rows, cols = x.shape
    if x.numel() == 0:
        return
    block_2d = amax is None
    s_strides = (scale.stride(0), scale.stride(1)) if block_2d else (0, 0)
    st_strides = (scale_t.stride(0), scale_t.stride(1)) if block_2d else (0, 0)
    _quantize_with_trans_tiles_kernel[(triton.cdiv(rows, tile), triton.cdiv(cols, tile), batch)](
        x,
        q,
        q_t.view(torch.uint8),
        scale,
        scale if scale_t is None else scale_t,
        scale if amax is None else amax,
        rows,
        cols,
        x.stride(0),
        x.stride(1),
        *s_strides,
        *st_strides,
        FP8_MAX=torch.finfo(q.dtype).max,
        TILE=tile,
        BLOCK_2D=block_2d,
        CAST_SATURATES=fp8_cast_saturates(x.device, q.dtype),
        num_warps=8 if tile >= 128 else 4,
    )


def quantize_fp8_groups_triton(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    group_cols: int,
    group_rows: int = 1,
    mx_emax: int | None = None,
) -> None:
    """Quantize the 2-D view ``x`` into ``q`` (same shape, any strides) with one scale per group.

    Groups are ``group_rows x group_cols`` tiles along the last dimension (``group_cols = C`` for a
    whole row). ``scale`` is (ceil(R / group_rows), ceil(C / group_cols)): fp32 ``scale_inv`` values,
    or uint8 E8M0 exponents when ``mx_emax`` (the element format's largest exponent) is given.
    """
    rows, cols = x.shape
    if rows == 0 or cols == 0:
        return
    fp8_max = torch.finfo(q.dtype).max
    block_c = min(triton.next_power_of_2(group_cols), 256 if group_rows == 1 else 128)
    block_r = group_rows if group_rows > 1 else max(1, min(32, 4096 // block_c))
    grid = (triton.cdiv(rows, block_r), triton.cdiv(cols, group_cols))
    _quantize_groups_kernel[grid](
        x,
        q,
        scale,
        rows,
        cols,
        *x.stride(),
        *q.stride(),
        *scale.stride(),
        group_cols,
        FP8_MAX=fp8_max,
        GROUP_R=group_rows,
        MX=mx_emax is not None,
        MX_EMAX=mx_emax or 0,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        CAST_SATURATES=fp8_cast_saturates(x.device, q.dtype),
        num_warps=8 if block_r * block_c >= 8192 else 4,
    )


def quantize_fp8_dual_blocks_triton(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    q_t: torch.Tensor,
    scale_t: torch.Tensor,
    group: int,
    mx_emax: int | None = None,
) -> None:
    """Both 1-D block quantizations of a 2-D ``x`` (M, K) in one read: ``q`` (M, K) with ``scale``
    (M, K / group) along K, and ``q_t`` (K, M) with ``scale_t`` (K, M / group) along M. ``q`` and
    ``q_t`` are contiguous, the scales any strides; scales are fp32, or uint8 E8M0 codes when
    ``mx_emax`` is given."""
    m, k = x.shape
    if m == 0 or k == 0:
        return
    tile = max(group, 64)
    _quantize_dual_blocks_kernel[(triton.cdiv(m, tile), triton.cdiv(k, tile))](
        x,
        q,
        scale,
        q_t,
        scale_t,
        m,
        k,
        *x.stride(),
        *scale.stride(),
        *scale_t.stride(),
        FP8_MAX=torch.finfo(q.dtype).max,
        MX=mx_emax is not None,
        MX_EMAX=mx_emax or 0,
        GROUP=group,
        N_GROUPS=tile // group,
        TILE=tile,
        CAST_SATURATES=fp8_cast_saturates(x.device, q.dtype),
        num_warps=8 if tile >= 128 else 4,
    )


def tensorwise_cast_fp8_triton(
    x: torch.Tensor, q: torch.Tensor, amax: torch.Tensor, scale_inv: torch.Tensor
) -> None:
    """``q = saturate(x * fp8_max / amax)`` elementwise for contiguous ``x``/``q`` split into
    ``amax.numel()`` equal slices (one tensor, or one slice per expert of a [G, ...] weight), each with
    its fp32 ``amax`` (NaN or inf when the slice holds such values); writes each slice's ``scale_inv``
    (``amax``'s shape). ``x`` must not be empty."""
    groups = amax.numel()
    n = x.numel() // groups
    block = 4096
    _tensorwise_cast_kernel[(triton.cdiv(n, block), groups)](
        x,
        q,
        amax,
        scale_inv,
        n,
        FP8_MAX=torch.finfo(q.dtype).max,
        BLOCK=block,
        CAST_SATURATES=fp8_cast_saturates(x.device, q.dtype),
        num_warps=8,
    )
