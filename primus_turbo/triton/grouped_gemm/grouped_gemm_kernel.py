"""Grouped GEMM for MoE experts in Triton, with group offsets read on the device (no host sync).

- ``grouped_gemm_triton``: ``out[rows of g] = a[rows of g] @ op(b[g])`` for ``a`` [T, K] and ``b``
  [G, K, N] (or [G, N, K], read transposed through strides). A persistent grid walks the groups on the
  device: tile ``i`` of the concatenated tile list goes to program ``i % NUM_SMS``, so skewed routing
  spreads evenly and empty groups cost nothing.
- ``grouped_gemm_variable_k_triton``: ``out[g] = lhs[rows of g]^T @ rhs[rows of g]`` for ``lhs``
  [T, P] and ``rhs`` [T, Q] (the weight gradient: the reduction runs over each group's tokens); one
  program per (group, output tile), so the grid is known without the group sizes.

On Hopper every launcher here runs a Gluon kernel where it takes the call (``grouped_gemm_sm90`` for
bf16/fp16, ``grouped_gemm_fp8_sm90`` for FP8), and the plain-Triton kernels here elsewhere.

Operands come as views of any strides. FP8 ones should have the reduction dimension contiguous
(K-major weights, token-major wgrad operands): Hopper's FP8 MMA reads only that layout, and the others
ran 4-8x slower on H200.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from primus_turbo.triton.utils.autotune import KeepAccumulatedOutput, tuning_bench
from primus_turbo.triton.utils.device_info import interpreter_active, kernel_autotune_enabled, num_sms

try:  # Gluon (Triton >= 3.6 on CUDA): the Hopper kernels for the forward, dgrad and wgrad
    from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_sm90 import (
        SCALE_BLOCK,
        grouped_gemm_fp8_sm90,
        grouped_gemm_fp8_variable_k_sm90,
        grouped_sm90_usable,
        grouped_variable_k_sm90_usable,
    )
    from primus_turbo.triton.grouped_gemm.grouped_gemm_sm90 import (
        Sm90Tiles,
        grouped_gemm_sm90,
        grouped_gemm_variable_k_sm90,
        grouped_sm90_16bit_usable,
        grouped_variable_k_sm90_16bit_usable,
    )
except (ImportError, AttributeError):  # a Triton without Gluon, or with a Gluon API this file predates
    grouped_gemm_fp8_sm90 = grouped_sm90_usable = None
    grouped_gemm_fp8_variable_k_sm90 = grouped_variable_k_sm90_usable = None
    grouped_gemm_sm90 = grouped_gemm_variable_k_sm90 = Sm90Tiles = None
    grouped_sm90_16bit_usable = grouped_variable_k_sm90_16bit_usable = None
    SCALE_BLOCK = 128

__all__ = [
    "grouped_fp8_scale_block",
    "grouped_fp8_sm90_takes",
    "grouped_gemm_fp8_triton",
    "grouped_gemm_fp8_variable_k_triton",
    "grouped_gemm_triton",
    "grouped_gemm_variable_k_triton",
]


def _configs() -> list[triton.Config]:
    if interpreter_active():
        shapes = [(32, 32, 32, 1, 4)]
    elif torch.version.hip is not None:
        shapes = [(256, 256, 64, 2, 8), (128, 128, 64, 2, 4), (64, 128, 64, 2, 4)]
    else:
        shapes = [
            (128, 256, 64, 3, 8),
            (128, 128, 64, 4, 8),
            (128, 128, 64, 4, 4),
            (64, 128, 64, 4, 4),
            (128, 128, 32, 4, 4),
        ]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_stages=s, num_warps=w)
        for bm, bn, bk, s, w in shapes
    ]


def _fp8_configs() -> list[triton.Config]:
    if interpreter_active():
        shapes = [(32, 32, 32, 1, 4)]
    elif torch.version.hip is not None:
        shapes = [(256, 256, 128, 2, 8), (128, 128, 128, 2, 8), (64, 128, 128, 2, 4)]
    else:
        shapes = [(128, 128, 128, 4, 8), (128, 256, 128, 3, 8), (64, 128, 128, 4, 4)]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_stages=s, num_warps=w)
        for bm, bn, bk, s, w in shapes
    ]


def _prune(configs: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
    return configs if kernel_autotune_enabled() else configs[:1]


_keep_output = KeepAccumulatedOutput("out_ptr")


@triton.jit(do_not_specialize=["G"])
def _grouped_gemm_jit(
    a_ptr,
    b_ptr,
    c_ptr,
    offs_ptr,
    a_scale_ptr,
    b_scale_ptr,
    G,
    N,
    K,
    stride_am,
    stride_bg,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_sam,
    stride_sak,
    stride_sbg,
    stride_sbn,
    stride_sbk,
    DTYPES: tl.constexpr,
    TRANS_B: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SCALED: tl.constexpr,
    A_ROWWISE: tl.constexpr,
    PER_BLOCK: tl.constexpr,
    NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Persistent walk over the groups' tiles (see the module docstring). With SCALED the operands are
    FP8: the MMA promotes to fp32 every K-block, and the scales (one or per row for ``a``; one per
    expert or per output column for ``b``) apply once to the finished tile. With PER_BLOCK (block
    scaling, BLOCK_K = the scale block) ``a`` has one scale per (row, K-block) and ``b`` one per
    (expert, output-column block, K-block), and each K-block's product is scaled before it is added."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles_before = tl.zeros((), dtype=tl.int64)  # int64, like the group offsets
    for g in range(G):
        start = tl.load(offs_ptr + g)
        end = tl.load(offs_ptr + g + 1)
        group_tiles = tl.cdiv(end - start, BLOCK_M) * num_pid_n
        first = (pid - tiles_before % NUM_SMS + NUM_SMS) % NUM_SMS
        g64 = start - start + g  # int64, like the offsets
        for t in range(first, group_tiles, NUM_SMS):
            rows = start + (t // num_pid_n) * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = (t % num_pid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
            row_ok = rows < end
            col_ok = cols < N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < K
                a = tl.load(
                    a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0,
                )
                b = tl.load(
                    b_ptr + g64 * stride_bg + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                    mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0,
                )
                if PER_BLOCK:
                    kb = k0 // BLOCK_K
                    sa = tl.load(a_scale_ptr + rows * stride_sam + kb * stride_sak, mask=row_ok, other=0.0)
                    sb_ptr = b_scale_ptr + g64 * stride_sbg + kb * stride_sbk
                    if BLOCK_K % BLOCK_N == 0:
                        # the tile's columns lie in one weight block: one multiply-add per element
                        sb = tl.load(sb_ptr + ((t % num_pid_n) * BLOCK_N // BLOCK_K) * stride_sbn)
                        acc += tl.dot(a, b) * (sa * sb)[:, None]
                    else:
                        sb = tl.load(sb_ptr + (cols // BLOCK_K) * stride_sbn, mask=col_ok, other=0.0)
                        acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
                elif SCALED:
                    acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
                else:
                    acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            if SCALED and not PER_BLOCK:
                if A_ROWWISE:
                    sa = tl.load(a_scale_ptr + rows, mask=row_ok, other=0.0)
                else:
                    sa = tl.load(a_scale_ptr) + tl.zeros([BLOCK_M], dtype=tl.float32)
                sb = tl.load(b_scale_ptr + g64 * stride_sbg + cols * stride_sbn, mask=col_ok, other=0.0)
                acc = acc * (sa[:, None] * sb[None, :])
            c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :]
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
        tiles_before += group_tiles


@triton.jit
def _variable_k_block(
    acc,
    lhs_ptr,
    rhs_ptr,
    lhs_scale_ptr,
    rhs_scale_ptr,
    k0,
    start,
    end,
    block_row,
    ps,
    qs,
    p_ok,
    q_ok,
    stride_lt,
    stride_lp,
    stride_rt,
    stride_rq,
    stride_ls,
    stride_rs,
    PARTIAL: tl.constexpr,
    SCALED: tl.constexpr,
    PER_BLOCK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """acc plus the product over tokens k0 .. k0 + BLOCK_K. Only a PARTIAL block (a group's first or
    last) masks tokens: a mask that varies along the contiguous token dimension of a token-major
    operand turns its 16-byte loads into single bytes."""
    ks = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
    if PARTIAL:
        k_ok = (ks >= start) & (ks < end)
        lhs_mask = p_ok[:, None] & k_ok[None, :]
        rhs_mask = k_ok[:, None] & q_ok[None, :]
    else:
        lhs_mask = p_ok[:, None]
        rhs_mask = q_ok[None, :]
    lhs = tl.load(lhs_ptr + ps[:, None] * stride_lp + ks[None, :] * stride_lt, mask=lhs_mask, other=0.0)
    rhs = tl.load(rhs_ptr + ks[:, None] * stride_rt + qs[None, :] * stride_rq, mask=rhs_mask, other=0.0)
    if PER_BLOCK:
        sl = tl.load(lhs_scale_ptr + block_row * stride_ls + ps, mask=p_ok, other=0.0)
        sr = tl.load(rhs_scale_ptr + block_row * stride_rs + qs, mask=q_ok, other=0.0)
        acc += tl.dot(lhs, rhs) * (sl[:, None] * sr[None, :])
    elif SCALED:
        acc = tl.dot(lhs, rhs, acc, max_num_imprecise_acc=BLOCK_K)
    else:
        acc = tl.dot(lhs, rhs, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit(do_not_specialize=["G"])
def _grouped_variable_k_jit(
    lhs_ptr,
    rhs_ptr,
    out_ptr,
    offs_ptr,
    lhs_scale_ptr,
    rhs_scale_ptr,
    block_base_ptr,
    G,
    P,
    Q,
    stride_lt,
    stride_lp,
    stride_rt,
    stride_rq,
    stride_og,
    stride_op,
    stride_ls,
    stride_rs,
    ACCUMULATE: tl.constexpr,
    DTYPES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SCALED: tl.constexpr,
    PER_COLUMN: tl.constexpr,
    PER_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program per (group, output tile): BLOCK_M tiles P, BLOCK_N tiles Q and BLOCK_K walks the
    group's tokens in blocks aligned to multiples of BLOCK_K: a partial first and last block around
    full ones, which load whole 16-byte pieces of token-major operands (see the module docstring).
    With SCALED the operands are FP8 and their scales (one, or one per (group, column)) are constant
    along the reduction, so they apply once to the finished tile. With PER_BLOCK (BLOCK_K = the scale
    block) every aligned block the group touches has its own scale row (``block_base[g]`` is the
    group's first), and each block's product is scaled before it is added."""
    g = tl.program_id(0)
    tile = tl.program_id(1)
    num_pid_q = tl.cdiv(Q, BLOCK_N)
    ps = ((tile // num_pid_q) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    qs = ((tile % num_pid_q) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    p_ok = ps < P
    q_ok = qs < Q
    start = tl.load(offs_ptr + g)
    end = tl.load(offs_ptr + g + 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    block_row = start
    if PER_BLOCK:
        block_row = tl.load(block_base_ptr + g)
    lo = ((start + BLOCK_K - 1) // BLOCK_K) * BLOCK_K  # the first full block's start
    hi = (end // BLOCK_K) * BLOCK_K  # the last full block's end
    if end > start:
        if start < lo:  # the partial first block (the only one when the group lies inside a block)
            acc = _variable_k_block(
                acc, lhs_ptr, rhs_ptr, lhs_scale_ptr, rhs_scale_ptr, lo - BLOCK_K, start, end, block_row,
                ps, qs, p_ok, q_ok, stride_lt, stride_lp, stride_rt, stride_rq, stride_ls, stride_rs,
                True, SCALED, PER_BLOCK, DOT_PRECISION, BLOCK_K,
            )  # fmt: skip
            block_row += 1
        for k0 in range(lo, hi, BLOCK_K):
            acc = _variable_k_block(
                acc, lhs_ptr, rhs_ptr, lhs_scale_ptr, rhs_scale_ptr, k0, start, end, block_row,
                ps, qs, p_ok, q_ok, stride_lt, stride_lp, stride_rt, stride_rq, stride_ls, stride_rs,
                False, SCALED, PER_BLOCK, DOT_PRECISION, BLOCK_K,
            )  # fmt: skip
            block_row += 1
        if (hi < end) & (hi >= lo):  # the partial last block, unless the first one was it
            acc = _variable_k_block(
                acc, lhs_ptr, rhs_ptr, lhs_scale_ptr, rhs_scale_ptr, hi, start, end, block_row,
                ps, qs, p_ok, q_ok, stride_lt, stride_lp, stride_rt, stride_rq, stride_ls, stride_rs,
                True, SCALED, PER_BLOCK, DOT_PRECISION, BLOCK_K,
            )  # fmt: skip
    if SCALED and not PER_BLOCK:
        if PER_COLUMN:
            sl = tl.load(lhs_scale_ptr + g * P + ps, mask=p_ok, other=0.0)
            sr = tl.load(rhs_scale_ptr + g * Q + qs, mask=q_ok, other=0.0)
        else:
            sl = tl.load(lhs_scale_ptr) + tl.zeros([BLOCK_M], dtype=tl.float32)
            sr = tl.load(rhs_scale_ptr) + tl.zeros([BLOCK_N], dtype=tl.float32)
        acc = acc * (sl[:, None] * sr[None, :])
    out_ptrs = out_ptr + g.to(tl.int64) * stride_og + ps[:, None] * stride_op + qs[None, :]
    mask = p_ok[:, None] & q_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


_grouped_gemm_kernel = triton.autotune(
    configs=_configs(),
    key=["N", "K", "G", "DTYPES", "TRANS_B"],
    prune_configs_by={"early_config_prune": _prune},
    do_bench=tuning_bench,
)(_grouped_gemm_jit)
_grouped_gemm_fp8_kernel = triton.autotune(
    configs=_fp8_configs(),
    key=["N", "K", "G", "DTYPES", "TRANS_B", "A_ROWWISE", "PER_BLOCK"],
    prune_configs_by={"early_config_prune": _prune},
    do_bench=tuning_bench,
)(_grouped_gemm_jit)
_grouped_gemm_variable_k_kernel = triton.autotune(
    configs=_configs(),
    key=["P", "Q", "G", "DTYPES", "ACCUMULATE"],
    prune_configs_by={"early_config_prune": _prune},
    pre_hook=_keep_output.save,
    post_hook=_keep_output.restore,
    do_bench=tuning_bench,
)(_grouped_variable_k_jit)
_grouped_gemm_fp8_variable_k_kernel = triton.autotune(
    configs=_fp8_configs(),
    key=["P", "Q", "G", "DTYPES", "PER_COLUMN", "PER_BLOCK", "ACCUMULATE"],
    prune_configs_by={"early_config_prune": _prune},
    pre_hook=_keep_output.save,
    post_hook=_keep_output.restore,
    do_bench=tuning_bench,
)(_grouped_variable_k_jit)


def _launch(kernel, grid, *args, **kwargs) -> None:
    """Through the autotuner, or with the first config directly when autotuning is off (the autotuner
    would still time a lone config, per shape, and that breaks CUDA-graph capture)."""
    if kernel_autotune_enabled():
        kernel[grid](*args, **kwargs)
        return
    config = kernel.configs[0]
    params = {**kwargs, **config.all_kwargs()}
    grid = grid(params) if callable(grid) else grid
    kernel.fn[grid](*args, **params)


@functools.lru_cache(maxsize=None)
def _unused_scale(device: torch.device) -> torch.Tensor:
    """Placeholder for the scale pointers of an unscaled (bf16/fp16/fp32) launch."""
    return torch.ones((), dtype=torch.float32, device=device)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def grouped_gemm_triton(
    a: torch.Tensor, b: torch.Tensor, group_offs: torch.Tensor, trans_b: bool
) -> torch.Tensor:
    """[T, N] output of the grouped GEMM; ``a`` [T, K] with a unit column stride, ``group_offs`` the
    int64 [G + 1] exclusive prefix sum of the group sizes (on the device)."""
    tokens, k = a.shape
    groups = b.shape[0]
    n = b.shape[1] if trans_b else b.shape[2]
    out = torch.empty((tokens, n), dtype=a.dtype, device=a.device)
    if tokens == 0 or n == 0:
        return out
    if k == 0 or groups == 0:
        return out.zero_()
    if (
        grouped_gemm_sm90 is not None
        and grouped_sm90_16bit_usable(a, b, trans_b, Sm90Tiles())
        and grouped_gemm_sm90(a, b, group_offs, trans_b, out)
    ):
        return out
    stride_bk, stride_bn = (b.stride(2), b.stride(1)) if trans_b else (b.stride(1), b.stride(2))
    sms = num_sms(a.device)
    unused = _unused_scale(a.device)
    _launch(
        _grouped_gemm_kernel,
        (sms,),
        a,
        b,
        out,
        group_offs,
        unused,
        unused,
        groups,
        n,
        k,
        a.stride(0),
        b.stride(0),
        stride_bk,
        stride_bn,
        out.stride(0),
        0,
        0,
        0,
        0,
        0,
        DTYPES=str(a.dtype),
        TRANS_B=trans_b,
        DOT_PRECISION=_precision(a.dtype),
        SCALED=False,
        A_ROWWISE=False,
        PER_BLOCK=False,
        NUM_SMS=sms,
    )
    return out


def grouped_gemm_variable_k_triton(
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    group_offs: torch.Tensor,
    out: torch.Tensor,
    accumulate: bool = False,
) -> torch.Tensor:
    """``out[g] (+)= lhs[rows of g]^T @ rhs[rows of g]`` into ``out`` [G, P, Q]; ``lhs`` [T, P] and
    ``rhs`` [T, Q] of any strides; a group without rows gives zeros (or leaves ``out``)."""
    groups, p, q = out.shape
    if groups == 0 or p == 0 or q == 0:
        return out
    if (
        lhs.shape[0] > 0
        and grouped_gemm_variable_k_sm90 is not None
        and grouped_variable_k_sm90_16bit_usable(lhs, rhs, out)
        and grouped_gemm_variable_k_sm90(lhs, rhs, group_offs, out, accumulate)
    ):
        return out

    def grid(meta: dict) -> tuple[int, int]:
        return (groups, triton.cdiv(p, meta["BLOCK_M"]) * triton.cdiv(q, meta["BLOCK_N"]))

    unused = _unused_scale(lhs.device)
    _launch(
        _grouped_gemm_variable_k_kernel,
        grid,
        lhs,
        rhs,
        out,
        group_offs,
        unused,
        unused,
        group_offs,
        groups,
        p,
        q,
        *lhs.stride(),
        *rhs.stride(),
        out.stride(0),
        out.stride(1),
        0,
        0,
        ACCUMULATE=accumulate,
        DTYPES=f"{lhs.dtype}->{out.dtype}",
        DOT_PRECISION=_precision(lhs.dtype),
        SCALED=False,
        PER_COLUMN=False,
        PER_BLOCK=False,
    )
    return out


def grouped_fp8_scale_block() -> int:
    """The block size the block-scaled FP8 grouped kernels take (their BLOCK_K)."""
    return _fp8_configs()[0].kwargs["BLOCK_K"]


def _sm90_scales(a, a_scale, b, b_scale, trans_b: bool, out_dtype: torch.dtype, block_size: int):
    """The Hopper Gluon kernel's (weights, a scale, b scale, column scale) arguments where it takes the
    call (block scaling with 128-blocks, or scales constant along K: one or one per row for ``a``, one
    per expert or per output column for ``b``); None where it does not."""
    weights = b if trans_b else b.transpose(1, 2)  # [G, N, K]
    if grouped_gemm_fp8_sm90 is None or not grouped_sm90_usable(a, weights, out_dtype):
        return None
    out_axis, k_axis = (1, 2) if trans_b else (2, 1)
    if block_size:
        if block_size != SCALE_BLOCK or a.shape[1] % SCALE_BLOCK:
            return None
        sb = (b_scale, b_scale.stride(0), b_scale.stride(out_axis), b_scale.stride(k_axis))
        return weights, (a_scale, *a_scale.stride()), sb, None
    sa = (a_scale, a_scale.stride(0) if a_scale.dim() else 0, 0)
    if b_scale.numel() == b.shape[0]:
        return weights, sa, (b_scale, b_scale.stride(0), 0, 0), None
    columns = (b_scale, b_scale.stride(0), b_scale.stride(out_axis))
    return weights, sa, (_unused_scale(a.device), 0, 0, 0), columns


def grouped_fp8_sm90_takes(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    trans_b: bool,
    out_dtype: torch.dtype,
    block_size: int = 0,
) -> bool:
    """Whether ``grouped_gemm_fp8_triton`` runs this call on the Hopper Gluon kernel."""
    return _sm90_scales(a, a_scale, b, b_scale, trans_b, out_dtype, block_size) is not None


def grouped_gemm_fp8_triton(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    group_offs: torch.Tensor,
    trans_b: bool,
    out_dtype: torch.dtype,
    block_size: int = 0,
) -> torch.Tensor:
    """[T, N] grouped product of FP8 ``a`` [T, K] and FP8 ``b`` [G, K, N] (or [G, N, K]).

    Scales: ``a_scale`` 0-d or [T, 1] and ``b_scale`` one per expert or one per output column per
    expert; or, with ``block_size`` (= ``grouped_fp8_scale_block()``), ``a_scale`` [T, K / block] and
    ``b_scale`` the expert's block grid, [G, K / block, N / block] (or [G, N / block, K / block]).
    """
    tokens, k = a.shape
    groups = b.shape[0]
    n = b.shape[1] if trans_b else b.shape[2]
    out = torch.empty((tokens, n), dtype=out_dtype, device=a.device)
    if tokens == 0 or n == 0:
        return out
    if k == 0 or groups == 0:
        return out.zero_()
    out_axis, k_axis = (1, 2) if trans_b else (2, 1)
    a_scale, b_scale = a_scale.float(), b_scale.float()
    sm90 = _sm90_scales(a, a_scale, b, b_scale, trans_b, out_dtype, block_size)
    if sm90 is not None:
        weights, sa, sb, columns = sm90
        if grouped_gemm_fp8_sm90(a, sa, weights, sb, group_offs, out, columns):
            return out
    stride_bk, stride_bn = (b.stride(2), b.stride(1)) if trans_b else (b.stride(1), b.stride(2))
    stride_sbn = b_scale.stride(out_axis) if b_scale.shape[out_axis] > 1 else 0
    stride_sbk = b_scale.stride(k_axis) if block_size else 0
    stride_sam, stride_sak = a_scale.stride() if block_size else (0, 0)
    sms = num_sms(a.device)
    _launch(
        _grouped_gemm_fp8_kernel,
        (sms,),
        a,
        b,
        out,
        group_offs,
        a_scale,
        b_scale,
        groups,
        n,
        k,
        a.stride(0),
        b.stride(0),
        stride_bk,
        stride_bn,
        out.stride(0),
        stride_sam,
        stride_sak,
        b_scale.stride(0),
        stride_sbn,
        stride_sbk,
        DTYPES=f"{a.dtype}x{b.dtype}->{out_dtype}",
        TRANS_B=trans_b,
        DOT_PRECISION="tf32",
        SCALED=True,
        A_ROWWISE=a_scale.dim() > 0,
        PER_BLOCK=bool(block_size),
        NUM_SMS=sms,
    )
    return out


def grouped_gemm_fp8_variable_k_triton(
    lhs: torch.Tensor,
    lhs_scale: torch.Tensor,
    rhs: torch.Tensor,
    rhs_scale: torch.Tensor,
    group_offs: torch.Tensor,
    out_dtype: torch.dtype,
    block_base: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """[G, P, Q] = per group ``(lhs * s)^T (rhs * s)`` of FP8 ``lhs`` [T, P] and ``rhs`` [T, Q] (views,
    fastest token-major) with 0-d scales or contiguous [G, P] / [G, Q] per-(group, column) scales; or,
    with ``block_base`` (the int64 [G] first scale row of each group), [rows, P] / [rows, Q] scales with
    one row per ``grouped_fp8_scale_block()`` tokens of a group (``quantize_fp8_group_blocks``). With
    ``out`` ([G, P, Q], unit last stride) the products are added into it (fused wgrad accumulation)
    and ``out`` is returned; every program writes its whole tile, so a fresh output needs no zeroing."""
    groups = group_offs.numel() - 1
    p, q = lhs.shape[1], rhs.shape[1]
    accumulate = out is not None
    if out is None:
        out = torch.empty((groups, p, q), dtype=out_dtype, device=lhs.device)
    if groups == 0 or p == 0 or q == 0:
        return out
    if lhs.shape[0] == 0:
        return out if accumulate else out.zero_()

    def grid(meta: dict) -> tuple[int, int]:
        return (groups, triton.cdiv(p, meta["BLOCK_M"]) * triton.cdiv(q, meta["BLOCK_N"]))

    lhs_scale, rhs_scale = lhs_scale.float().contiguous(), rhs_scale.float().contiguous()
    per_block = block_base is not None
    if (
        grouped_gemm_fp8_variable_k_sm90 is not None
        and grouped_variable_k_sm90_usable(lhs, rhs, out)
        and grouped_gemm_fp8_variable_k_sm90(
            lhs, lhs_scale, rhs, rhs_scale, group_offs, out, accumulate, block_base
        )
    ):
        return out
    _launch(
        _grouped_gemm_fp8_variable_k_kernel,
        grid,
        lhs,
        rhs,
        out,
        group_offs,
        lhs_scale,
        rhs_scale,
        block_base if per_block else group_offs,
        groups,
        p,
        q,
        *lhs.stride(),
        *rhs.stride(),
        out.stride(0),
        out.stride(1),
        lhs_scale.stride(0) if per_block else 0,
        rhs_scale.stride(0) if per_block else 0,
        ACCUMULATE=accumulate,
        DTYPES=f"{lhs.dtype}x{rhs.dtype}->{out.dtype}",
        DOT_PRECISION="tf32",
        SCALED=True,
        PER_COLUMN=lhs_scale.dim() > 0,
        PER_BLOCK=per_block,
    )
    return out
