"""Flash attention forward and backward in Triton (FlashAttention-2 style, exp2 softmax).

Logical shapes: q [B, Sq, Hq, Dqk], k [B, Sk, Hkv, Dqk], v [B, Sk, Hkv, Dv], any batch/sequence/head
strides and unit stride along the head dimension, so bshd, sbhd and bhsd views run without copies.
Query head ``h`` reads key/value head ``h // (Hq / Hkv)`` (GQA/MQA).

Masking is one rule: query ``i`` sees key ``j`` when ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``
(a negative bound is unbounded), so causal is ``right = 0`` aligned to the bottom-right corner and
sliding windows come for free; key blocks outside that band are skipped, not masked. An optional
per-head sink adds ``exp(sink[h])`` to every softmax denominator with a zero value row. A query row
that sees no key (and has no sink) gets a zero output and ``lse = -inf``.

The backward recomputes P from the saved log-sum-exp: one kernel per key block accumulates dK and dV
over every query head of its group and every query block (no atomics, so it is deterministic; a grid
smaller than the GPU splits the group into shares whose fp32 partial sums are added in a fixed order), and
one kernel per query block accumulates dQ. A q/k head dim between powers of two runs as two tiles (192 =
128 + 64) rather than one padded tile.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from primus_turbo.triton.utils.device_info import interpreter_active, num_sms
from primus_turbo.triton.utils.launch import cached_launch

__all__ = [
    "FP8_BLOCK",
    "MAX_HEAD_DIM",
    "Launch",
    "Varlen",
    "default_fp8_launch",
    "default_launches",
    "flash_attn_bwd_triton",
    "flash_attn_fwd_triton",
]

MAX_HEAD_DIM = 256
FP8_BLOCK = 128  # tokens per FP8 scale block; forward tiles divide it, so each tile has one scale
_LOG2E = tl.constexpr(1.4426950408889634)


class Launch(NamedTuple):
    """One kernel's tiles: rows of its own operand (queries, or keys for dK/dV) per program, rows of the
    other per loop step, warps and software-pipeline stages of the loop."""

    block: int
    step: int
    warps: int
    stages: int


def default_launches(d_qk: int, d_v: int) -> tuple[Launch, Launch, Launch]:
    """(forward, dK/dV, dQ) launches: 16-row tiles under the interpreter; else the fastest of
    ``bench_attention_configs`` on an H200 at 4096 and 8192 tokens (docs/performance.md), for heads up to
    128 wide and for DeepSeek's 192/128 (one of q/k and v padded to 256); smaller tiles where both are."""
    if interpreter_active():
        tile = Launch(16, 16, 4, 1)
        return tile, tile, tile
    width = triton.next_power_of_2(d_qk) + triton.next_power_of_2(d_v)
    if width > 384:  # 256-wide q/k and v tiles: smaller blocks keep the pipelines in shared memory
        return Launch(64, 32, 8, 3), Launch(32, 32, 8, 3), Launch(64, 32, 8, 3)
    if width > 256:
        return Launch(128, 64, 8, 3), Launch(128, 32, 8, 3), Launch(128, 64, 8, 3)
    return Launch(128, 64, 8, 3), Launch(64, 32, 4, 3), Launch(128, 64, 8, 3)


def default_fp8_launch() -> Launch:
    """The FP8 forward's launch, for every head width: 16-row tiles under the interpreter; else the
    fastest of ``bench_attention_configs --kernels fwd_fp8`` on an H200 at 128/128 and 192/128
    (docs/performance.md)."""
    if interpreter_active():
        return Launch(16, 16, 4, 1)
    return Launch(64, 64, 4, 3)  # one warpgroup per program: programs on an SM overlap softmax and MMA


@triton.jit
def _key_range(
    start_m,
    S_Q,
    S_K,
    WINDOW_LEFT,
    WINDOW_RIGHT,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """[lo, hi) of the keys any query of block ``start_m`` may see; lo is aligned to BLOCK_N."""
    diag = S_K - S_Q
    lo = start_m * 0
    hi = S_K + lo
    if HAS_RIGHT:
        hi = tl.minimum(S_K, tl.maximum(start_m + BLOCK_M + diag + WINDOW_RIGHT, 0))
    if HAS_LEFT:
        lo = tl.maximum(start_m + diag - WINDOW_LEFT, 0) // BLOCK_N * BLOCK_N
    return lo, hi


@triton.jit
def _longest_first(pid, programs):
    """The query block a program takes: the last first. The grid starts programs in order, and with a
    causal mask the last query blocks see the most keys, so the longest programs start first and short
    ones fill the tail."""
    return programs - 1 - pid


@triton.jit
def _band(rows, cols, S_Q, S_K, WINDOW_LEFT, WINDOW_RIGHT, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Which (query row, key col) pairs the window lets through (cols < S_K included)."""
    diag = S_K - S_Q
    ok = (cols[None, :] < S_K) & (rows[:, None] >= 0)
    if HAS_RIGHT:
        ok = ok & (cols[None, :] <= rows[:, None] + diag + WINDOW_RIGHT)
    if HAS_LEFT:
        ok = ok & (cols[None, :] >= rows[:, None] + diag - WINDOW_LEFT)
    return ok


@triton.jit
def _sequence(cu_ptr, b, S, VARLEN: tl.constexpr):
    """(first row, length) of sequence ``b``: from the cumulative lengths when VARLEN, else (0, S)."""
    if VARLEN:
        first = tl.load(cu_ptr + b)
        return first.to(tl.int64), tl.load(cu_ptr + b + 1) - first
    return (b * 0).to(tl.int64), S


@triton.jit
def _head(ptr, b, h, s0, stride_b, stride_h, stride_s):
    """Pointer to row ``s0`` of head ``h`` of batch ``b`` in a tensor with (batch, seq, head) strides."""
    return ptr + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h + s0 * stride_s


@triton.jit
def _tile(base, rows, row_ok, stride_s, d, D):
    """(pointers, mask) of the [rows, d] tile below ``base``, masked to valid rows and the first D dims."""
    return base + rows[:, None].to(tl.int64) * stride_s + d[None, :], row_ok[:, None] & (d < D)[None, :]


@triton.jit
def _full_keys(
    start_m,
    seq_q,
    seq_k,
    lo,
    hi,
    WINDOW_LEFT,
    WINDOW_RIGHT,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """[b, c) within [lo, hi): the key blocks every row of query block ``start_m`` sees whole (inside the
    window and the sequence), which run without masks; [lo, b) and [c, hi) need them."""
    diag = seq_k - seq_q
    b = lo
    c = seq_k // BLOCK_N * BLOCK_N
    if HAS_RIGHT:
        c = tl.minimum(c, tl.maximum(start_m + diag + WINDOW_RIGHT + 1, 0) // BLOCK_N * BLOCK_N)
    if HAS_LEFT:
        b = tl.maximum(
            b, tl.cdiv(tl.maximum(start_m + BLOCK_M - 1 + diag - WINDOW_LEFT, 0), BLOCK_N) * BLOCK_N
        )
    b = tl.minimum(b, hi)
    c = tl.minimum(tl.maximum(c, b), hi)
    return b, c


@triton.jit
def _full_queries(
    start_n,
    seq_q,
    seq_k,
    lo,
    hi,
    WINDOW_LEFT,
    WINDOW_RIGHT,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """[b, c) within [lo, hi): the query blocks that see all of key block ``start_n`` (inside the window
    and both sequences), which run without masks; [lo, b) and [c, hi) need them."""
    diag = seq_k - seq_q
    b = lo
    c = seq_q // BLOCK_M * BLOCK_M
    if HAS_RIGHT:
        b = tl.maximum(
            b, tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - diag - WINDOW_RIGHT, 0), BLOCK_M) * BLOCK_M
        )
    if HAS_LEFT:
        c = tl.minimum(c, tl.maximum(start_n - diag + WINDOW_LEFT + 1, 0) // BLOCK_M * BLOCK_M)
    c = tl.where(start_n + BLOCK_N <= seq_k, c, lo)  # a partial key block is masked throughout
    b = tl.minimum(b, hi)
    c = tl.minimum(tl.maximum(c, b), hi)
    return b, c


@triton.jit
def _part(part: tl.constexpr, lo, full_lo, full_hi, hi):
    """Part 0, 1 or 2 of [lo, hi): masked blocks before the whole ones, the whole ones, the masked rest."""
    if part == 0:
        return lo, full_lo
    if part == 1:
        return full_lo, full_hi
    return full_hi, hi


@triton.jit
def _load_tile(base, rows, row_ok, stride_s, d, D, MASK_ROWS: tl.constexpr, EVEN_D: tl.constexpr, stride_d=1):
    """The [rows, d] tile below ``base``; zeros outside the valid rows (MASK_ROWS) and the first D dims."""
    ptrs = base + rows[:, None].to(tl.int64) * stride_s + d[None, :] * stride_d
    if MASK_ROWS:
        if EVEN_D:
            return tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        return tl.load(ptrs, mask=row_ok[:, None] & (d < D)[None, :], other=0.0)
    if EVEN_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(d < D)[None, :], other=0.0)


@triton.jit
def _load_qk(
    base,
    rows,
    row_ok,
    stride_s,
    D_QK,
    MASK_ROWS: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    SPLIT_QK: tl.constexpr,
    BLOCK_DQK2: tl.constexpr,
):
    """A q or k tile as (its first BLOCK_DQK dims, the next BLOCK_DQK2) when SPLIT_QK, so that a head dim
    such as 192 runs as 128 + 64 instead of padded to 256; else (the tile, the tile again)."""
    first = _load_tile(base, rows, row_ok, stride_s, tl.arange(0, BLOCK_DQK), D_QK, MASK_ROWS, EVEN_D)
    if SPLIT_QK:
        d2 = tl.arange(0, BLOCK_DQK2)
        second = _load_tile(base + BLOCK_DQK, rows, row_ok, stride_s, d2, D_QK - BLOCK_DQK, MASK_ROWS, EVEN_D)
    else:
        second = first
    return first, second


@triton.jit
def _dot_qk(a, b, a2, b2, SPLIT_QK: tl.constexpr):
    """a b, plus a2 b2 over the second part of a split head dim."""
    out = tl.dot(a, b)
    if SPLIT_QK:
        out = tl.dot(a2, b2, out)
    return out


@triton.jit
def _store_qk(
    base,
    rows,
    row_ok,
    stride_s,
    D_QK,
    x,
    x2,
    BLOCK_DQK: tl.constexpr,
    SPLIT_QK: tl.constexpr,
    BLOCK_DQK2: tl.constexpr,
):
    """Store a dq or dk tile held as ``_load_qk`` parts."""
    ptrs, mask = _tile(base, rows, row_ok, stride_s, tl.arange(0, BLOCK_DQK), D_QK)
    tl.store(ptrs, x.to(base.dtype.element_ty), mask=mask)
    if SPLIT_QK:
        d2 = tl.arange(0, BLOCK_DQK2)
        ptrs, mask = _tile(base + BLOCK_DQK, rows, row_ok, stride_s, d2, D_QK - BLOCK_DQK)
        tl.store(ptrs, x2.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _fwd_keys(
    acc,
    m_i,
    l_i,
    acc_unit,
    q,
    q2,
    k_base,
    v_base,
    lo,
    hi,
    rows,
    seq_q,
    seq_k,
    stride_ks,
    stride_vs,
    stride_vd,
    D_QK,
    D_V,
    scale_log2,
    ks_ptr,
    vs_ptr,
    kv_scales,
    WINDOW_LEFT,
    WINDOW_RIGHT,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    MASK: tl.constexpr,
    FP8: tl.constexpr,
    P_LOG2: tl.constexpr,
    EVEN_D: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    SPLIT_QK: tl.constexpr,
    BLOCK_DQK2: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Online softmax over key blocks [lo, hi); MASK applies the window and sequence bounds (the blocks
    ``_full_keys`` leaves out), where a row may also see no key at all.

    The row max is taken on the raw products (the scale is positive), so that scaling and subtracting it
    are one FMA per score. P (and so l) carries a factor 2^P_LOG2: FP8 sets it to the largest power of two
    the FP8 type holds (256 for E4M3FN, 128 for E4M3FNUZ), which keeps small probabilities out of its
    subnormal range, and the output divides it out. FP8 also keeps ``acc`` in units of the last v block's
    scale (``acc_unit``): a change of block rescales it with the softmax correction, and P V accumulates
    in place."""
    d_v = tl.arange(0, BLOCK_DV)
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        cols = start_n + tl.arange(0, BLOCK_N)
        col_ok = cols < seq_k
        k, k2 = _load_qk(k_base, cols, col_ok, stride_ks, D_QK, MASK, EVEN_D, BLOCK_DQK, SPLIT_QK, BLOCK_DQK2)
        v = _load_tile(v_base, cols, col_ok, stride_vs, d_v, D_V, MASK, EVEN_D, stride_vd)
        s = _dot_qk(q, tl.trans(k), q2, tl.trans(k2), SPLIT_QK)
        c = scale_log2
        if FP8:
            c = scale_log2 * tl.load(ks_ptr + kv_scales + start_n // SCALE_BLOCK)
        if MASK:
            s = tl.where(
                _band(rows, cols, seq_q, seq_k, WINDOW_LEFT, WINDOW_RIGHT, HAS_LEFT, HAS_RIGHT),
                s,
                float("-inf"),
            )
            m_new = tl.maximum(m_i, tl.max(s, axis=1) * c)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, axis=1) * c)
            m_safe = m_new
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s * c - (m_safe - P_LOG2)[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP8:
            v_scale = tl.load(vs_ptr + kv_scales + start_n // SCALE_BLOCK)
            alpha = alpha * (acc_unit / v_scale)
            acc_unit = v_scale
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, m_i, l_i, acc_unit


@cached_launch
@triton.jit
def _attn_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    sink_ptr,
    o_ptr,
    lse_ptr,
    cu_q_ptr,
    cu_k_ptr,
    qs_ptr,
    ks_ptr,
    vs_ptr,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ob,
    stride_os,
    stride_oh,
    stride_lb,
    stride_lh,
    H_Q,
    GROUP,
    S_Q,
    S_K,
    D_QK,
    D_V,
    scale_log2,
    WINDOW_LEFT,
    WINDOW_RIGHT,
    VARLEN: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_SINK: tl.constexpr,
    FP8: tl.constexpr,
    P_LOG2: tl.constexpr,
    EVEN_D: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    SPLIT_QK: tl.constexpr,
    BLOCK_DQK2: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    bh = tl.program_id(0)  # batch x heads on axis 0: its limit is 2^31 - 1, axis 1's only 65535
    m_block = _longest_first(tl.program_id(1), tl.num_programs(1))
    start_m = m_block * BLOCK_M
    b = bh // H_Q
    h = bh % H_Q
    hk = h // GROUP
    q0, seq_q = _sequence(cu_q_ptr, b, S_Q, VARLEN)
    k0, seq_k = _sequence(cu_k_ptr, b, S_K, VARLEN)
    rows = start_m + tl.arange(0, BLOCK_M)
    d_v = tl.arange(0, BLOCK_DV)
    row_ok = rows < seq_q
    q_base = _head(q_ptr, b, h, q0, stride_qb, stride_qh, stride_qs)
    q, q2 = _load_qk(q_base, rows, row_ok, stride_qs, D_QK, True, EVEN_D, BLOCK_DQK, SPLIT_QK, BLOCK_DQK2)
    k_base = _head(k_ptr, b, hk, k0, stride_kb, stride_kh, stride_ks)
    v_base = _head(v_ptr, b, hk, k0, stride_vb, stride_vh, stride_vs)
    kv_scales = 0
    if FP8:  # one scale per (batch, head, SCALE_BLOCK tokens) of q, k and v; a tile lies in one block
        q_blocks = tl.cdiv(S_Q, SCALE_BLOCK)
        kv_scales = (b * (H_Q // GROUP) + hk).to(tl.int64) * tl.cdiv(S_K, SCALE_BLOCK)
        scale_log2 = scale_log2 * tl.load(qs_ptr + bh.to(tl.int64) * q_blocks + start_m // SCALE_BLOCK)
    if HAS_SINK:
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(sink_ptr + h).to(tl.float32) * _LOG2E
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.math.exp2(P_LOG2)
    else:
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    acc_unit = tl.full((), 1.0, tl.float32)  # acc's unit: 1, or for FP8 the last v block's scale
    lo, hi = _key_range(
        start_m, seq_q, seq_k, WINDOW_LEFT, WINDOW_RIGHT, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N
    )
    hi = tl.where(start_m < seq_q, hi, lo)
    full_lo, full_hi = _full_keys(
        start_m, seq_q, seq_k, lo, hi, WINDOW_LEFT, WINDOW_RIGHT, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N
    )
    for part in tl.static_range(3):  # masked blocks left of the whole ones, the whole ones, masked right
        first, last = _part(part, lo, full_lo, full_hi, hi)
        acc, m_i, l_i, acc_unit = _fwd_keys(
            acc, m_i, l_i, acc_unit, q, q2, k_base, v_base, first, last, rows, seq_q, seq_k, stride_ks,
            stride_vs, stride_vd, D_QK, D_V, scale_log2, ks_ptr, vs_ptr, kv_scales, WINDOW_LEFT, WINDOW_RIGHT,
            HAS_LEFT, HAS_RIGHT, part != 1, FP8, P_LOG2, EVEN_D, SCALE_BLOCK, BLOCK_N, BLOCK_DQK, SPLIT_QK,
            BLOCK_DQK2, BLOCK_DV, NUM_STAGES,
        )  # fmt: skip
    seen = l_i > 0
    out = acc * (acc_unit / tl.where(seen, l_i, 1.0))[:, None]
    o_ptrs, o_mask = _tile(
        _head(o_ptr, b, h, q0, stride_ob, stride_oh, stride_os), rows, row_ok, stride_os, d_v, D_V
    )
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=o_mask)
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0)) - P_LOG2) / _LOG2E, float("-inf"))
    tl.store(lse_ptr + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q0 + rows, lse, mask=row_ok)


@triton.jit
def _dkdv_queries(
    dk,
    dk2,
    dv,
    k,
    k2,
    v,
    q_base,
    do_base,
    lse_ptr,
    delta_ptr,
    lo,
    hi,
    cols,
    seq_q,
    seq_k,
    stride_qs,
    stride_dos,
    D_QK,
    D_V,
    scale_log2,
    WINDOW_LEFT,
    WINDOW_RIGHT,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    MASK: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    SPLIT_QK: tl.constexpr,
    BLOCK_DQK2: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """dK and dV of one key block over query blocks [lo, hi) of one head; MASK as in ``_fwd_keys``."""
    d_v = tl.arange(0, BLOCK_DV)
    for start_m in tl.range(lo, hi, BLOCK_M, num_stages=NUM_STAGES):
        rows = start_m + tl.arange(0, BLOCK_M)
        row_ok = rows < seq_q
        q, q2 = _load_qk(q_base, rows, row_ok, stride_qs, D_QK, MASK, EVEN_D, BLOCK_DQK, SPLIT_QK, BLOCK_DQK2)
        do = _load_tile(do_base, rows, row_ok, stride_dos, d_v, D_V, MASK, EVEN_D)
        s_t = _dot_qk(k, tl.trans(q), k2, tl.trans(q2), SPLIT_QK) * scale_log2  # [BLOCK_N, BLOCK_M]
        if MASK:
            lse = tl.load(lse_ptr + rows, mask=row_ok, other=float("-inf"))
            delta = tl.load(delta_ptr + rows, mask=row_ok, other=0.0)
            # rows that saw no key have lse = -inf: their P is 0, not exp(-inf + inf)
            lse2 = tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)
            band = tl.trans(_band(rows, cols, seq_q, seq_k, WINDOW_LEFT, WINDOW_RIGHT, HAS_LEFT, HAS_RIGHT))
            p_t = tl.where(band, tl.math.exp2(s_t - lse2[None, :]), 0.0)
        else:
            lse2 = tl.load(lse_ptr + rows) * _LOG2E
            delta = tl.load(delta_ptr + rows)
            p_t = tl.math.exp2(s_t - lse2[None, :])
        dv += tl.dot(p_t.to(do.dtype), do)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk += tl.dot(ds_t, q)
        if SPLIT_QK:
            dk2 += tl.dot(ds_t, q2)
    return dk, dk2, dv


@cached_launch
@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dk_ptr,
    dv_ptr,
    cu_q_ptr,
    cu_k_ptr,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_dob,
    stride_dos,
    stride_doh,
    stride_dkb,
    stride_dks,
    stride_dkh,
    stride_dvb,
    stride_dvs,
    stride_dvh,
    stride_dk_split,
    stride_dv_split,
    stride_lb,
    stride_lh,
    H_Q,
    H_KV,
    GROUP,
    SPLITS,
    S_Q,
    S_K,
    D_QK,
    D_V,
    scale,
    WINDOW_LEFT,
    WINDOW_RIGHT,
    VARLEN: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    EVEN_D: tl.constexpr,
    PAIRED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    SPLIT_QK: tl.constexpr,
    BLOCK_DQK2: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    bhk = tl.program_id(0) // SPLITS
    split = tl.program_id(0) % SPLITS
    pid_n = tl.program_id(1)
    b = bhk // H_KV
    hk = bhk % H_KV
    # SPLITS > 1: this program takes one share of the group's query heads and writes partial sums
    heads = tl.cdiv(GROUP, SPLITS)
    g_lo = split * heads
    g_hi = tl.minimum(g_lo + heads, GROUP)
    dk_ptr += split.to(tl.int64) * stride_dk_split
    dv_ptr += split.to(tl.int64) * stride_dv_split
    q0, seq_q = _sequence(cu_q_ptr, b, S_Q, VARLEN)
    k0, seq_k = _sequence(cu_k_ptr, b, S_K, VARLEN)
    if PAIRED:  # key blocks n and last - n: under a causal mask their query counts add up to a constant
        last = tl.cdiv(seq_k, BLOCK_N) - 1
        blocks = tl.where(last - pid_n > pid_n, 2, 1)
    else:
        last = pid_n
        blocks = 1
    for t in range(blocks):
        _dkdv_block(
            tl.where(t == 0, pid_n, last - pid_n) * BLOCK_N, b, hk, q0, seq_q, k0, seq_k, q_ptr, k_ptr, v_ptr,
            do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks,
            stride_kh, stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh, stride_dkb,
            stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh, stride_lb, stride_lh, GROUP, g_lo,
            g_hi, D_QK, D_V, scale, WINDOW_LEFT, WINDOW_RIGHT, HAS_LEFT, HAS_RIGHT, EVEN_D, BLOCK_M, BLOCK_N,
            BLOCK_DQK, SPLIT_QK, BLOCK_DQK2, BLOCK_DV, NUM_STAGES,
        )  # fmt: skip


@triton.jit
def _dkdv_block(
    start_n,
    b,
    hk,
    q0,
    seq_q,
    k0,
    seq_k,
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dk_ptr,
    dv_ptr,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_dob,
    stride_dos,
    stride_doh,
    stride_dkb,
    stride_dks,
    stride_dkh,
    stride_dvb,
    stride_dvs,
    stride_dvh,
    stride_lb,
    stride_lh,
    GROUP,
    g_lo,
    g_hi,
    D_QK,
    D_V,
    scale,
    WINDOW_LEFT,
    WINDOW_RIGHT,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    SPLIT_QK: tl.constexpr,
    BLOCK_DQK2: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """dK and dV of key block ``start_n`` of kv head ``hk``, summed over query heads [g_lo, g_hi) of its
    group."""
    cols = start_n + tl.arange(0, BLOCK_N)
    col_ok = cols < seq_k
    d_v = tl.arange(0, BLOCK_DV)
    k_base = _head(k_ptr, b, hk, k0, stride_kb, stride_kh, stride_ks)
    k, k2 = _load_qk(k_base, cols, col_ok, stride_ks, D_QK, True, EVEN_D, BLOCK_DQK, SPLIT_QK, BLOCK_DQK2)
    v_base = _head(v_ptr, b, hk, k0, stride_vb, stride_vh, stride_vs)
    v = _load_tile(v_base, cols, col_ok, stride_vs, d_v, D_V, True, EVEN_D)
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
    dk2 = tl.zeros([BLOCK_N, BLOCK_DQK2], dtype=tl.float32)  # unused unless SPLIT_QK
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    # queries that may see this key block: i in [j - diag - right, j - diag + left]
    diag = seq_k - seq_q
    q_lo = start_n * 0
    q_hi = seq_q + q_lo
    if HAS_RIGHT:
        q_lo = tl.maximum(start_n - diag - WINDOW_RIGHT, 0) // BLOCK_M * BLOCK_M
    if HAS_LEFT:
        q_hi = tl.minimum(seq_q, tl.maximum(start_n + BLOCK_N - diag + WINDOW_LEFT, 0))
    q_hi = tl.where(start_n < seq_k, q_hi, q_lo)
    full_lo, full_hi = _full_queries(
        start_n, seq_q, seq_k, q_lo, q_hi, WINDOW_LEFT, WINDOW_RIGHT, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N
    )
    scale_log2 = scale * _LOG2E
    for g in range(g_lo, g_hi):
        h = hk * GROUP + g
        q_base = _head(q_ptr, b, h, q0, stride_qb, stride_qh, stride_qs)
        do_base = _head(do_ptr, b, h, q0, stride_dob, stride_doh, stride_dos)
        stat = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q0
        for part in tl.static_range(3):  # masked query blocks, the whole ones, masked again
            first, last = _part(part, q_lo, full_lo, full_hi, q_hi)
            dk, dk2, dv = _dkdv_queries(
                dk, dk2, dv, k, k2, v, q_base, do_base, lse_ptr + stat, delta_ptr + stat, first, last, cols,
                seq_q, seq_k, stride_qs, stride_dos, D_QK, D_V, scale_log2, WINDOW_LEFT, WINDOW_RIGHT,
                HAS_LEFT, HAS_RIGHT, part != 1, EVEN_D, BLOCK_M, BLOCK_DQK, SPLIT_QK, BLOCK_DQK2, BLOCK_DV,
                NUM_STAGES,
            )  # fmt: skip
    dk_base = _head(dk_ptr, b, hk, k0, stride_dkb, stride_dkh, stride_dks)
    _store_qk(
        dk_base, cols, col_ok, stride_dks, D_QK, dk * scale, dk2 * scale, BLOCK_DQK, SPLIT_QK, BLOCK_DQK2
    )
    dv_ptrs, dv_mask = _tile(
        _head(dv_ptr, b, hk, k0, stride_dvb, stride_dvh, stride_dvs), cols, col_ok, stride_dvs, d_v, D_V
    )
    tl.store(dv_ptrs, dv.to(dv_ptr.dtype.element_ty), mask=dv_mask)


@triton.jit
def _dq_keys(
    dq,
    dq2,
    q,
    q2,
    do,
    lse2,
    delta,
    k_base,
    v_base,
    lo,
    hi,
    rows,
    seq_q,
    seq_k,
    stride_ks,
    stride_vs,
    D_QK,
    D_V,
    scale_log2,
    WINDOW_LEFT,
    WINDOW_RIGHT,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    MASK: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    SPLIT_QK: tl.constexpr,
    BLOCK_DQK2: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """dQ of one query block over key blocks [lo, hi); MASK as in ``_fwd_keys``."""
    d_v = tl.arange(0, BLOCK_DV)
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        cols = start_n + tl.arange(0, BLOCK_N)
        col_ok = cols < seq_k
        k, k2 = _load_qk(k_base, cols, col_ok, stride_ks, D_QK, MASK, EVEN_D, BLOCK_DQK, SPLIT_QK, BLOCK_DQK2)
        v = _load_tile(v_base, cols, col_ok, stride_vs, d_v, D_V, MASK, EVEN_D)
        s = _dot_qk(q, tl.trans(k), q2, tl.trans(k2), SPLIT_QK) * scale_log2
        if MASK:
            band = _band(rows, cols, seq_q, seq_k, WINDOW_LEFT, WINDOW_RIGHT, HAS_LEFT, HAS_RIGHT)
            p = tl.where(band, tl.math.exp2(s - lse2[:, None]), 0.0)
        else:
            p = tl.math.exp2(s - lse2[:, None])
        dp = tl.dot(do, tl.trans(v))
        ds = (p * (dp - delta[:, None])).to(k.dtype)
        dq += tl.dot(ds, k)
        if SPLIT_QK:
            dq2 += tl.dot(ds, k2)
    return dq, dq2


@cached_launch
@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dq_ptr,
    cu_q_ptr,
    cu_k_ptr,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ob,
    stride_os,
    stride_oh,
    stride_dob,
    stride_dos,
    stride_doh,
    stride_dqb,
    stride_dqs,
    stride_dqh,
    stride_lb,
    stride_lh,
    H_Q,
    GROUP,
    S_Q,
    S_K,
    D_QK,
    D_V,
    scale,
    WINDOW_LEFT,
    WINDOW_RIGHT,
    VARLEN: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    SPLIT_QK: tl.constexpr,
    BLOCK_DQK2: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    bh = tl.program_id(0)  # batch x heads on axis 0: its limit is 2^31 - 1, axis 1's only 65535
    start_m = _longest_first(tl.program_id(1), tl.num_programs(1)) * BLOCK_M
    b = bh // H_Q
    h = bh % H_Q
    hk = h // GROUP
    q0, seq_q = _sequence(cu_q_ptr, b, S_Q, VARLEN)
    k0, seq_k = _sequence(cu_k_ptr, b, S_K, VARLEN)
    rows = start_m + tl.arange(0, BLOCK_M)
    row_ok = rows < seq_q
    d_v = tl.arange(0, BLOCK_DV)
    q_base = _head(q_ptr, b, h, q0, stride_qb, stride_qh, stride_qs)
    q, q2 = _load_qk(q_base, rows, row_ok, stride_qs, D_QK, True, EVEN_D, BLOCK_DQK, SPLIT_QK, BLOCK_DQK2)
    do_base = _head(do_ptr, b, h, q0, stride_dob, stride_doh, stride_dos)
    do = _load_tile(do_base, rows, row_ok, stride_dos, d_v, D_V, True, EVEN_D)
    o = _load_tile(_head(o_ptr, b, h, q0, stride_ob, stride_oh, stride_os), rows, row_ok, stride_os, d_v, D_V,
                   True, EVEN_D)  # fmt: skip
    # delta = rowsum(dO * O) of these rows, written here for the dK/dV kernel that runs next
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    stat_base = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q0
    tl.store(delta_ptr + stat_base + rows, delta, mask=row_ok)
    lse = tl.load(lse_ptr + stat_base + rows, mask=row_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)
    scale_log2 = scale * _LOG2E
    k_base = _head(k_ptr, b, hk, k0, stride_kb, stride_kh, stride_ks)
    v_base = _head(v_ptr, b, hk, k0, stride_vb, stride_vh, stride_vs)
    dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)
    dq2 = tl.zeros([BLOCK_M, BLOCK_DQK2], dtype=tl.float32)  # unused unless SPLIT_QK
    lo, hi = _key_range(
        start_m, seq_q, seq_k, WINDOW_LEFT, WINDOW_RIGHT, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N
    )
    hi = tl.where(start_m < seq_q, hi, lo)
    full_lo, full_hi = _full_keys(
        start_m, seq_q, seq_k, lo, hi, WINDOW_LEFT, WINDOW_RIGHT, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N
    )
    for part in tl.static_range(3):  # as in the forward
        first, last = _part(part, lo, full_lo, full_hi, hi)
        dq, dq2 = _dq_keys(
            dq, dq2, q, q2, do, lse2, delta, k_base, v_base, first, last, rows, seq_q, seq_k, stride_ks,
            stride_vs, D_QK, D_V, scale_log2, WINDOW_LEFT, WINDOW_RIGHT, HAS_LEFT, HAS_RIGHT, part != 1,
            EVEN_D, BLOCK_N, BLOCK_DQK, SPLIT_QK, BLOCK_DQK2, BLOCK_DV, NUM_STAGES,
        )  # fmt: skip
    dq_base = _head(dq_ptr, b, h, q0, stride_dqb, stride_dqh, stride_dqs)
    _store_qk(
        dq_base, rows, row_ok, stride_dqs, D_QK, dq * scale, dq2 * scale, BLOCK_DQK, SPLIT_QK, BLOCK_DQK2
    )


class Varlen(NamedTuple):
    """Packed sequences: int32 cumulative lengths [B + 1] of queries and keys, and the longest of each."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def _bsh(t: torch.Tensor) -> tuple[int, int, int]:
    """Batch, sequence and head strides of a [B, S, H, D] tensor, or (0, token, head) of packed [T, H, D]."""
    strides = t.stride()
    if len(strides) == 3:
        return 0, strides[0], strides[1]
    return strides[0], strides[1], strides[2]


def _dims(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, varlen: Varlen | None) -> tuple[int, ...]:
    """(B, Sq, Sk, Hq, Hkv, Dqk, Dv); for packed inputs B is the sequence count and S the longest."""
    if varlen is not None:
        b = varlen.cu_seqlens_q.numel() - 1
        return b, varlen.max_seqlen_q, varlen.max_seqlen_k, q.shape[1], k.shape[1], q.shape[2], v.shape[2]
    b, s_q, h_q, d_qk = q.shape
    return b, s_q, k.shape[1], h_q, k.shape[2], d_qk, v.shape[3]


def _bounded(window: int, s_q: int, s_k: int) -> int:
    """A window bound that covers every key is unbounded (-1): large values would overflow int32 index
    arithmetic in the kernels."""
    return -1 if window >= s_q + s_k else window


@functools.lru_cache(maxsize=None)
def _head_dims(d_qk: int, d_v: int) -> dict[str, int | bool]:
    """Head-dimension tile widths (powers of two, at least 16) and whether they cover the head dims exactly,
    so that loads need no mask along them. A q/k head dim between powers of two runs as two tiles, the
    largest power of two below it and the rest (192 = 128 + 64, 96 = 64 + 32), instead of one padded tile."""
    block_v = max(16, triton.next_power_of_2(d_v))
    block_qk, block_qk2 = max(16, triton.next_power_of_2(d_qk)), 16
    split = block_qk != d_qk and d_qk > 16
    if split:
        block_qk //= 2
        block_qk2 = max(16, triton.next_power_of_2(d_qk - block_qk))
    even = (block_qk + block_qk2 * split, block_v) == (d_qk, d_v)
    return dict(BLOCK_DQK=block_qk, SPLIT_QK=split, BLOCK_DQK2=block_qk2, BLOCK_DV=block_v, EVEN_D=even)


def _packing(varlen: Varlen | None, lse: torch.Tensor) -> tuple:
    """(cu_q, cu_k, lse batch stride, lse head stride, VARLEN) kernel arguments."""
    if varlen is None:
        return lse, lse, lse.stride(0), lse.stride(1), False
    return varlen.cu_seqlens_q, varlen.cu_seqlens_k, 0, lse.stride(0), True


def flash_attn_fwd_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sink: torch.Tensor | None,
    scale: float,
    window_left: int,
    window_right: int,
    out: torch.Tensor,
    varlen: Varlen | None = None,
    fp8_scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    launch: Launch | None = None,
) -> torch.Tensor:
    """Fill ``out`` [B, Sq, Hq, Dv] (any layout; packed [T, Hq, Dv] with ``varlen``) and return the
    natural-log ``lse``, fp32 [B, Hq, Sq] (packed: [Hq, T]).

    With ``fp8_scales`` (dense only) q, k and v are FP8 and the scales are the fp32 ``scale_inv`` of each
    ``FP8_BLOCK``-token block per head: [B, Hq, ceil(Sq / FP8_BLOCK)] for q, [B, Hkv, ...] for k and v;
    both products run on FP8 operands, and v may be stored sequence-contiguous (unit stride along S, the
    K-major operand FP8 tensor cores take for P V). ``launch`` overrides the tiles (tuning)."""
    b, s_q, s_k, h_q, h_kv, d_qk, d_v = _dims(q, k, v, varlen)
    window_left, window_right = _bounded(window_left, s_q, s_k), _bounded(window_right, s_q, s_k)
    shape = (h_q, q.shape[0]) if varlen is not None else (b, h_q, s_q)
    lse = torch.empty(shape, dtype=torch.float32, device=q.device)
    if lse.numel() == 0 or b * s_q == 0:
        return lse
    cu_q, cu_k, stride_lb, stride_lh, packed = _packing(varlen, lse)
    fp8 = fp8_scales is not None
    tiles = launch or (default_fp8_launch() if fp8 else default_launches(d_qk, d_v)[0])
    if fp8 and (FP8_BLOCK % tiles.block or FP8_BLOCK % tiles.step):
        raise ValueError(f"FP8 attention tiles must divide {FP8_BLOCK} tokens, got {tiles}")
    grid = (b * h_q, triton.cdiv(s_q, tiles.block))
    _attn_fwd_kernel[grid](
        q,
        k,
        v,
        sink if sink is not None else lse,
        out,
        lse,
        cu_q,
        cu_k,
        *(fp8_scales if fp8_scales is not None else (lse, lse, lse)),
        *_bsh(q),
        *_bsh(k),
        *_bsh(v),
        v.stride(-1),
        *_bsh(out),
        stride_lb,
        stride_lh,
        h_q,
        h_q // h_kv,
        s_q,
        s_k,
        d_qk,
        d_v,
        scale * _LOG2E.value,
        window_left,
        window_right,
        VARLEN=packed,
        HAS_LEFT=window_left >= 0,
        HAS_RIGHT=window_right >= 0,
        HAS_SINK=sink is not None,
        FP8=fp8,
        P_LOG2=float(math.floor(math.log2(torch.finfo(v.dtype).max))) if fp8 else 0.0,
        SCALE_BLOCK=FP8_BLOCK,
        BLOCK_M=tiles.block,
        BLOCK_N=tiles.step,
        NUM_STAGES=tiles.stages,
        num_warps=tiles.warps,
        **_head_dims(d_qk, d_v),
    )
    return lse


def _group_splits(group: int, programs: int, sms: int) -> int:
    """Shares to split each group's query heads into across dK/dV programs: 1 while the grid fills the
    GPU; else enough for about two programs per multiprocessor (a causal grid's programs differ in
    length, so one wave of them leaves most multiprocessors idle at its end)."""
    if programs >= sms or group == 1:
        return 1
    heads = triton.cdiv(group, min(group, triton.cdiv(2 * sms, programs)))
    return triton.cdiv(group, heads)


def flash_attn_bwd_triton(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    window_left: int,
    window_right: int,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    varlen: Varlen | None = None,
    launch: tuple[Launch, Launch] | None = None,
) -> torch.Tensor:
    """Fill ``dq``, ``dk``, ``dv`` (layouts of q, k, v) from the forward's ``out`` and fp32 ``lse``, and
    return ``delta`` = rowsum(dO * O), fp32 and shaped like ``lse``. The dQ kernel runs first and writes
    delta for the dK/dV kernel, so no pass of its own reads O and dO. ``launch`` overrides the (dK/dV, dQ)
    tiles (tuning)."""
    b, s_q, s_k, h_q, h_kv, d_qk, d_v = _dims(q, k, v, varlen)
    window_left, window_right = _bounded(window_left, s_q, s_k), _bounded(window_right, s_q, s_k)
    delta = torch.empty_like(lse)
    cu_q, cu_k, stride_lb, stride_lh, packed = _packing(varlen, lse)
    dkdv, dq_tiles = launch or default_launches(d_qk, d_v)[1:]
    flags = dict(
        VARLEN=packed, HAS_LEFT=window_left >= 0, HAS_RIGHT=window_right >= 0, **_head_dims(d_qk, d_v)
    )
    if s_q and b * h_q:
        _attn_bwd_dq_kernel[(b * h_q, triton.cdiv(s_q, dq_tiles.block))](
            q, k, v, out, do, lse, delta, dq, cu_q, cu_k,
            *_bsh(q), *_bsh(k), *_bsh(v), *_bsh(out), *_bsh(do), *_bsh(dq), stride_lb, stride_lh,
            h_q, h_q // h_kv, s_q, s_k, d_qk, d_v, scale, window_left, window_right,
            BLOCK_M=dq_tiles.block, BLOCK_N=dq_tiles.step, NUM_STAGES=dq_tiles.stages,
            num_warps=dq_tiles.warps, **flags,
        )  # fmt: skip
    if s_k and b * h_kv:
        key_blocks = triton.cdiv(s_k, dkdv.block)
        programs, sms = b * h_kv * key_blocks, num_sms(q.device)
        # pair key blocks where a right bound makes their work uneven and half the grid still fills the GPU
        paired = window_right >= 0 and (interpreter_active() or programs >= 2 * sms)
        splits = 1 if paired else _group_splits(h_q // h_kv, programs, sms)
        dk_to, dv_to, split_strides = dk, dv, (0, 0)
        if splits > 1:  # fp32 partial sums per share of each group's query heads, added below in fixed order
            sums = [torch.empty((splits, *t.shape), dtype=torch.float32, device=t.device) for t in (dk, dv)]
            dk_to, dv_to, split_strides = sums[0][0], sums[1][0], (sums[0].stride(0), sums[1].stride(0))
        _attn_bwd_dkdv_kernel[(b * h_kv * splits, triton.cdiv(key_blocks, 2) if paired else key_blocks)](
            q, k, v, do, lse, delta, dk_to, dv_to, cu_q, cu_k,
            *_bsh(q), *_bsh(k), *_bsh(v), *_bsh(do), *_bsh(dk_to), *_bsh(dv_to), *split_strides,
            stride_lb, stride_lh, h_q, h_kv, h_q // h_kv, splits, s_q, s_k, d_qk, d_v, scale, window_left,
            window_right, PAIRED=paired, BLOCK_M=dkdv.step, BLOCK_N=dkdv.block, NUM_STAGES=dkdv.stages,
            num_warps=dkdv.warps, **flags,
        )  # fmt: skip
        if splits > 1:
            dk.copy_(sums[0].sum(0))
            dv.copy_(sums[1].sum(0))
    return delta
