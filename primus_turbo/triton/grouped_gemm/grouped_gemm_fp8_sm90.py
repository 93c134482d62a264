"""Grouped FP8 GEMM for Hopper in Gluon: the forward and dgrad of the MoE experts.

``out[rows of g] = sum_kb (a[rows, kb] @ b[g][:, kb]^T) * sa[rows, kb] * sb[g, tile, kb]`` for ``a``
[T, K] and the expert weights as [G, N, K], both K-contiguous FP8, with the group offsets read on the
device. It is the block-scaled kernel of ``triton/gemm/gemm_fp8_block_sm90.py`` (a TMA producer warp, two
consumer warpgroups that keep one wgmma in flight while they scale the previous K-block) under a
grouped tile schedule:

- one persistent program per SM walks the concatenated tile list of all groups: the tiles of group g
  follow those of the groups before it, and tile ``i`` goes to program ``i % programs``, so skewed
  routing spreads evenly and empty groups cost nothing; inside a group GROUP_M row tiles are walked
  per column tile for L2 reuse;
- ``a`` is one TMA descriptor over [T, K]: a tile that runs past its group's end loads the next
  group's rows (or zeros past T), which only reach output rows it does not store;
- the weights are one descriptor over [G * N, K]; a column tile past N reads the next expert's rows
  into columns it does not store;
- whole row tiles leave through shared memory and a TMA store; a group's partial last row tile is
  stored through masked pointers, so it never writes the next group's rows.

Scales per K-block and tile: block scaling (1 x 128 on ``a``, 128 x 128 on the weights) or any scale
that is constant along K and across a tile's columns (one for ``a`` or one per row, one per expert),
given as strides (0 where a scale does not vary); per-column weight scales (the row-wise recipe)
multiply the finished tile.
"""

from __future__ import annotations

import logging

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from primus_turbo.triton.gemm.gemm_fp8_block_sm90 import (
    _GL_DTYPES,
    SCALE_BLOCK,
    BlockSm90Config,
    _cta_barrier,
    _mma_layout,
    _tile_mainloop,
    _tma_store,
    drop_ring,
    load_stage,
    stage_ring,
    tma_descriptor,
)
from primus_turbo.triton.gemm.gemm_kernel import _tile_coords
from primus_turbo.triton.utils.device_info import is_sm90, num_sms
from primus_turbo.triton.utils.launch import cached_launch

__all__ = [
    "SCALE_BLOCK",
    "grouped_gemm_fp8_sm90",
    "grouped_gemm_fp8_variable_k_sm90",
    "grouped_sm90_usable",
    "grouped_variable_k_sm90_usable",
]

LOG = logging.getLogger(__name__)
_TILE = 128
_failed: set[tuple] = set()


@gluon.jit
def _group_bounds(offs_ptr, g, tiles_before, num_pid_n, BLOCK_M: gl.constexpr):
    """Group g's rows [start, end), its row tiles, its tile count and this program's first tile in it."""
    start = gl.load(offs_ptr + g).to(gl.int32)
    end = gl.load(offs_ptr + g + 1).to(gl.int32)
    num_pid_m = gl.cdiv(end - start, BLOCK_M)
    num_progs = gl.num_programs(0)
    first = (gl.program_id(0) - tiles_before % num_progs + num_progs) % num_progs
    return start, end, num_pid_m, num_pid_m * num_pid_n, first


@gluon.jit
def _store_tile(
    acc,
    c_desc,
    c_smem,
    c_ptr,
    rows,
    cols,
    row0,
    col0,
    rows_end,
    N,
    stride_cm,
    WHOLE,
    ACCUMULATE: gl.constexpr,
):
    """A finished tile into ``out``: through shared memory and a TMA store at (row0, col0) when it is
    WHOLE (every row below ``rows_end``; the descriptor clips columns at N) and not accumulated, else
    through pointers masked to rows below ``rows_end`` and columns below N, adding what ``out`` holds
    when ACCUMULATE."""
    if (not ACCUMULATE) and WHOLE:
        tma.store_wait(pendings=0)  # the previous tile's store has read c_smem
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        _tma_store(c_desc, [row0, col0], c_smem)
    else:
        ptrs = c_ptr + gl.expand_dims(rows.to(gl.int64) * stride_cm, 1) + gl.expand_dims(cols, 0)
        mask = gl.expand_dims(rows < rows_end, 1) & gl.expand_dims(cols < N, 0)
        if ACCUMULATE:
            acc = acc + gl.load(ptrs, mask=mask, other=0.0).to(gl.float32)
        gl.store(ptrs, acc.to(c_desc.dtype), mask=mask)


@gluon.jit
def _grouped_consumer(
    a_desc,
    b_desc,
    c_desc,
    c_ptr,
    offs_ptr,
    sa_ptr,
    sb_ptr,
    sc_ptr,
    a_bufs,
    b_bufs,
    c_smem,
    ready,
    empty,
    G,
    N,
    K,
    stride_cm,
    stride_sam,
    stride_sak,
    stride_sbg,
    stride_sbn,
    stride_sbk,
    stride_scg,
    stride_scn,
    COL_SCALE: gl.constexpr,
    GROUP_M: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    K_UNROLL: gl.constexpr,
    PRO: gl.constexpr,
    num_warps: gl.constexpr,
):
    """The default partition: wgmma, scaling and the epilogue of this program's tiles."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    mma_layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, num_warps)
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    num_progs = gl.num_programs(0)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)  # TMA zero-fills a partial last K-block
    cons = gl.to_tensor(0)
    # materialized before any wgmma (see the dense kernel's consumer)
    p0 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
    p1 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
    p0, p1 = warpgroup_mma_wait(num_outstanding=0, deps=(p0, p1))
    tiles_before = gl.to_tensor(0)
    for g in range(G):
        start, end, num_pid_m, group_tiles, first = _group_bounds(
            offs_ptr, g, tiles_before, num_pid_n, BLOCK_M
        )
        for t in range(first, group_tiles, num_progs):
            pid_m, pid_n = _tile_coords(t, num_pid_m, num_pid_n, GROUP_M)
            row0 = start + pid_m * BLOCK_M
            offs_m = row0 + gl.arange(0, BLOCK_M, layout=row_layout)
            m_mask = offs_m < end
            sb_row = sb_ptr + g * stride_sbg + (pid_n * BLOCK_N // BLOCK_K) * stride_sbn
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
            acc, p0, p1, cons = _tile_mainloop(
                acc,
                p0,
                p1,
                cons,
                k_tiles,
                a_bufs,
                b_bufs,
                ready,
                empty,
                sa_ptr + offs_m * stride_sam,
                m_mask,
                sb_row,
                stride_sak,
                stride_sbk,
                K_UNROLL,
                PRO,
                NUM_STAGES,
            )
            offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
            if COL_SCALE:
                sc = gl.load(sc_ptr + g * stride_scg + offs_n * stride_scn, mask=offs_n < N, other=0.0)
                acc = acc * gl.expand_dims(sc, 0)
            whole = row0 + BLOCK_M <= end
            _store_tile(
                acc,
                c_desc,
                c_smem,
                c_ptr,
                offs_m,
                offs_n,
                row0,
                pid_n * BLOCK_N,
                end,
                N,
                stride_cm,
                whole,
                False,
            )
        tiles_before += group_tiles
    tma.store_wait(pendings=0)


@gluon.jit
def _grouped_producer(
    a_desc,
    b_desc,
    a_bufs,
    b_bufs,
    ready,
    empty,
    offs_ptr,
    G,
    N,
    K,
    GROUP_M: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):
    """The worker partition: TMA loads of every (tile, K-block) of this program into the stage ring."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    num_progs = gl.num_programs(0)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)  # TMA zero-fills a partial last K-block
    prod = gl.to_tensor(0)
    tiles_before = gl.to_tensor(0)
    for g in range(G):
        start, end, num_pid_m, group_tiles, first = _group_bounds(
            offs_ptr, g, tiles_before, num_pid_n, BLOCK_M
        )
        for t in range(first, group_tiles, num_progs):
            pid_m, pid_n = _tile_coords(t, num_pid_m, num_pid_n, GROUP_M)
            row0 = start + pid_m * BLOCK_M
            b_row = g * N + pid_n * BLOCK_N
            for kb in range(k_tiles):
                prod = load_stage(
                    a_desc, b_desc, a_bufs, b_bufs, ready, empty, prod,
                    row0, kb * BLOCK_K, b_row, kb * BLOCK_K, NUM_STAGES,
                )  # fmt: skip
        tiles_before += group_tiles


@cached_launch
@gluon.jit
def _grouped_gemm_fp8_sm90_kernel(
    a_desc,
    b_desc,
    c_desc,
    c_ptr,
    offs_ptr,
    sa_ptr,
    sb_ptr,
    sc_ptr,
    G,
    N,
    K,
    stride_cm,
    stride_sam,
    stride_sak,
    stride_sbg,
    stride_sbn,
    stride_sbk,
    stride_scg,
    stride_scn,
    COL_SCALE: gl.constexpr,
    GROUP_M: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    K_UNROLL: gl.constexpr,
    PRO: gl.constexpr,
    num_warps: gl.constexpr,
):
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    gl.static_assert(BLOCK_K % BLOCK_N == 0, "a tile's columns lie in one weight block")
    gl.static_assert(K_UNROLL % 2 == 0, "an iteration's products alternate p0 / p1 evenly")
    a_bufs, b_bufs, c_smem, ready, empty = stage_ring(a_desc, b_desc, c_desc, NUM_STAGES)
    gl.warp_specialize(
        [
            (
                _grouped_consumer,
                (
                    a_desc,
                    b_desc,
                    c_desc,
                    c_ptr,
                    offs_ptr,
                    sa_ptr,
                    sb_ptr,
                    sc_ptr,
                    a_bufs,
                    b_bufs,
                    c_smem,
                    ready,
                    empty,
                    G,
                    N,
                    K,
                    stride_cm,
                    stride_sam,
                    stride_sak,
                    stride_sbg,
                    stride_sbn,
                    stride_sbk,
                    stride_scg,
                    stride_scn,
                    COL_SCALE,
                    GROUP_M,
                    NUM_STAGES,
                    K_UNROLL,
                    PRO,
                    num_warps,
                ),
            ),
            (
                _grouped_producer,
                (a_desc, b_desc, a_bufs, b_bufs, ready, empty, offs_ptr, G, N, K, GROUP_M, NUM_STAGES),
            ),
        ],
        [1],
        [24],
    )
    drop_ring(ready, empty, NUM_STAGES)


def _aligned(t: torch.Tensor) -> bool:
    """A TMA-describable 2-D view: unit last stride, 16-byte aligned rows and base."""
    return t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def grouped_sm90_usable(a: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether this kernel takes the product of ``a`` [T, K] and ``weights`` [G, N, K]: an sm_90 CUDA
    GPU, FP8 operands, weights contiguous (one [G * N, K] descriptor), 16-byte aligned rows of ``a``,
    the weights and the output (K a multiple of 16, N of 8 for bf16), and no earlier compile failure.
    Block scaling also needs K to be a multiple of 128; other scalings take a partial last K-block."""
    if not is_sm90(a.device):
        return False
    k, n = a.shape[1], weights.shape[1]
    if k == 0 or k % 16 or a.dtype not in _GL_DTYPES or weights.dtype not in _GL_DTYPES:
        return False
    if out_dtype not in _GL_DTYPES or (n * torch.finfo(out_dtype).bits // 8) % 16:
        return False
    if (a.dtype, weights.dtype, out_dtype) in _failed:
        return False
    return weights.is_contiguous() and _aligned(a) and weights.data_ptr() % 16 == 0


def grouped_gemm_fp8_sm90(
    a: torch.Tensor,
    a_scale: tuple[torch.Tensor, int, int],
    weights: torch.Tensor,
    b_scale: tuple[torch.Tensor, int, int, int],
    group_offs: torch.Tensor,
    out: torch.Tensor,
    col_scale: tuple[torch.Tensor, int, int] | None = None,
    config: BlockSm90Config | None = None,
) -> bool:
    """Write the grouped product of ``a`` [T, K] and ``weights`` [G, N, K] into ``out`` [T, N]; False
    (nothing written) where this Triton's Gluon cannot compile the kernel. Scales come as (tensor,
    strides): ``a_scale`` (sa, stride per row, stride per K-block) and ``b_scale`` (sb, stride per
    expert, per 128-column block, per K-block), 0 where a scale does not vary; ``col_scale`` (sc, stride
    per expert, per output column) multiplies the finished tile (row-wise weight scales). Check
    ``grouped_sm90_usable`` first."""
    config = config or BlockSm90Config()
    tokens, k = a.shape
    groups, n, _ = weights.shape
    sa, stride_sam, stride_sak = a_scale
    sb, stride_sbg, stride_sbn, stride_sbk = b_scale
    sc, stride_scg, stride_scn = col_scale if col_scale is not None else (sb, 0, 0)
    k_tiles = triton.cdiv(k, SCALE_BLOCK)

    try:
        _grouped_gemm_fp8_sm90_kernel[(num_sms(a.device),)](
            tma_descriptor(a, [_TILE, SCALE_BLOCK]),
            tma_descriptor(weights.view(groups * n, k), [_TILE, SCALE_BLOCK]),
            tma_descriptor(out, [_TILE, _TILE]),
            out,
            group_offs,
            sa,
            sb,
            sc,
            groups,
            n,
            k,
            out.stride(0),
            stride_sam,
            stride_sak,
            stride_sbg,
            stride_sbn,
            stride_sbk,
            stride_scg,
            stride_scn,
            COL_SCALE=col_scale is not None,
            GROUP_M=config.group_m,
            NUM_STAGES=config.num_stages,
            K_UNROLL=config.k_unroll,
            PRO=1 + (k_tiles - 1) % config.k_unroll,
            num_warps=8,
        )
    except triton.CompilationError as exc:
        _failed.add((a.dtype, weights.dtype, out.dtype))
        LOG.warning("Gluon grouped FP8 GEMM does not compile with triton %s: %s", triton.__version__, exc)
        return False
    return True


@gluon.jit
def _mask_tokens(tile, t0, start, end, BLOCK_K: gl.constexpr, num_warps: gl.constexpr):
    """Zero the tokens outside [start, end) of a [rows, BLOCK_K] token-major stage tile: a group's
    partial first or last block, which TMA loaded together with its neighbours' tokens."""
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [num_warps, 1], [1, 0])
    tokens = t0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
    keep = gl.expand_dims((tokens >= start) & (tokens < end), 0)
    x = tile.load(layout)
    bits = x.to(gl.int8, bitcast=True)
    tile.store(gl.where(keep, bits, gl.zeros_like(bits)).to(x.dtype, bitcast=True))


@gluon.jit
def _mask_partial_block(a_tile, b_tile, t0, start, end, num_warps: gl.constexpr):
    """Zero both operands' tokens outside [start, end) when the token block at t0 is a group's partial
    first or last one, and make the stores visible to the wgmma that follows."""
    BLOCK_K: gl.constexpr = a_tile.type.shape[1]
    if (t0 < start) | (t0 + BLOCK_K > end):
        _mask_tokens(a_tile, t0, start, end, BLOCK_K, num_warps)
        _mask_tokens(b_tile, t0, start, end, BLOCK_K, num_warps)
        fence_async_shared()
        _cta_barrier()


@gluon.jit
def _variable_k_tile(tile, offs_ptr, tiles_per_group, num_pid_m, num_pid_n, BLOCK_K, GROUP_M: gl.constexpr):
    """Tile ``tile``'s group, output tile coordinates, first aligned token block and block count."""
    g = tile // tiles_per_group
    pid_m, pid_n = _tile_coords(tile % tiles_per_group, num_pid_m, num_pid_n, GROUP_M)
    start = gl.load(offs_ptr + g).to(gl.int32)
    end = gl.load(offs_ptr + g + 1).to(gl.int32)
    first = (start // BLOCK_K) * BLOCK_K
    blocks = gl.where(end > start, (end - first + BLOCK_K - 1) // BLOCK_K, 0)
    return g, pid_m, pid_n, start, end, first, blocks


@gluon.jit
def _variable_k_consumer(
    a_desc,
    b_desc,
    c_desc,
    c_ptr,
    offs_ptr,
    sl_ptr,
    sr_ptr,
    a_bufs,
    b_bufs,
    c_smem,
    ready,
    empty,
    G,
    P,
    Q,
    PER_COLUMN: gl.constexpr,
    ACCUMULATE: gl.constexpr,
    GROUP_M: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """The default partition: wgmma over each tile's token blocks with one left in flight, the scales
    (constant along the tokens) on the finished tile, and the epilogue."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    mma_layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, num_warps)
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    num_pid_m = gl.cdiv(P, BLOCK_M)
    num_pid_n = gl.cdiv(Q, BLOCK_N)
    tiles_per_group = num_pid_m * num_pid_n
    cons = gl.to_tensor(0)
    for tile in range(gl.program_id(0), G * tiles_per_group, gl.num_programs(0)):
        g, pid_m, pid_n, start, end, first, blocks = _variable_k_tile(
            tile, offs_ptr, tiles_per_group, num_pid_m, num_pid_n, BLOCK_K, GROUP_M
        )
        offs_p = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_layout)
        offs_q = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
        for i in range(blocks):
            slot = cons % NUM_STAGES
            mbarrier.wait(ready.index(slot), (cons // NUM_STAGES) & 1)
            t0 = first + i * BLOCK_K
            _mask_partial_block(a_bufs.index(slot), b_bufs.index(slot), t0, start, end, num_warps)
            acc = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            # the previous block's wgmma has retired in both warpgroups: its stage goes back
            _cta_barrier()
            mbarrier.arrive(empty.index((cons + NUM_STAGES - 1) % NUM_STAGES), pred=i > 0)
            cons += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        _cta_barrier()
        mbarrier.arrive(empty.index((cons + NUM_STAGES - 1) % NUM_STAGES), pred=blocks > 0)
        if PER_COLUMN:
            sl = gl.load(sl_ptr + g * P + offs_p, mask=offs_p < P, other=0.0)
            sr = gl.load(sr_ptr + g * Q + offs_q, mask=offs_q < Q, other=0.0)
            acc = acc * gl.expand_dims(sl, 1) * gl.expand_dims(sr, 0)
        else:
            acc = acc * (gl.load(sl_ptr) * gl.load(sr_ptr))
        # out [G, P, Q] as [G * P, Q] rows
        whole = pid_m * BLOCK_M + BLOCK_M <= P
        rows = g * P + offs_p
        _store_tile(
            acc, c_desc, c_smem, c_ptr, rows, offs_q, g * P + pid_m * BLOCK_M, pid_n * BLOCK_N, g * P + P, Q,
            Q, whole, ACCUMULATE,
        )  # fmt: skip
    tma.store_wait(pendings=0)


@gluon.jit
def _variable_k_producer(
    a_desc,
    b_desc,
    a_bufs,
    b_bufs,
    ready,
    empty,
    offs_ptr,
    G,
    P,
    Q,
    GROUP_M: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    TOKENS_FIRST: gl.constexpr,
):
    """The worker partition of the variable-K kernels: TMA loads of every (tile, token block) of this
    program, in [columns, tokens] boxes of token-major operands, or with TOKENS_FIRST in [tokens,
    columns] boxes of row-major ones."""
    if TOKENS_FIRST:
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    else:
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    num_pid_m = gl.cdiv(P, BLOCK_M)
    num_pid_n = gl.cdiv(Q, BLOCK_N)
    tiles_per_group = num_pid_m * num_pid_n
    prod = gl.to_tensor(0)
    for tile in range(gl.program_id(0), G * tiles_per_group, gl.num_programs(0)):
        g, pid_m, pid_n, start, end, first, blocks = _variable_k_tile(
            tile, offs_ptr, tiles_per_group, num_pid_m, num_pid_n, BLOCK_K, GROUP_M
        )
        for i in range(blocks):
            t0 = first + i * BLOCK_K
            if TOKENS_FIRST:
                prod = load_stage(
                    a_desc, b_desc, a_bufs, b_bufs, ready, empty, prod,
                    t0, pid_m * BLOCK_M, t0, pid_n * BLOCK_N, NUM_STAGES,
                )  # fmt: skip
            else:
                prod = load_stage(
                    a_desc, b_desc, a_bufs, b_bufs, ready, empty, prod,
                    pid_m * BLOCK_M, t0, pid_n * BLOCK_N, t0, NUM_STAGES,
                )  # fmt: skip


@cached_launch
@gluon.jit
def _grouped_variable_k_sm90_kernel(
    a_desc,
    b_desc,
    c_desc,
    c_ptr,
    offs_ptr,
    sl_ptr,
    sr_ptr,
    G,
    P,
    Q,
    PER_COLUMN: gl.constexpr,
    ACCUMULATE: gl.constexpr,
    GROUP_M: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    a_bufs, b_bufs, c_smem, ready, empty = stage_ring(a_desc, b_desc, c_desc, NUM_STAGES)
    gl.warp_specialize(
        [
            (
                _variable_k_consumer,
                (
                    a_desc,
                    b_desc,
                    c_desc,
                    c_ptr,
                    offs_ptr,
                    sl_ptr,
                    sr_ptr,
                    a_bufs,
                    b_bufs,
                    c_smem,
                    ready,
                    empty,
                    G,
                    P,
                    Q,
                    PER_COLUMN,
                    ACCUMULATE,
                    GROUP_M,
                    NUM_STAGES,
                    num_warps,
                ),
            ),
            (
                _variable_k_producer,
                (a_desc, b_desc, a_bufs, b_bufs, ready, empty, offs_ptr, G, P, Q, GROUP_M, NUM_STAGES, False),
            ),
        ],
        [1],
        [24],
    )
    drop_ring(ready, empty, NUM_STAGES)


@gluon.jit
def _block_wgrad_consumer(
    shared,
    sizes,
    WG: gl.constexpr,
    ACCUMULATE: gl.constexpr,
    GROUP_M: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):
    """One of the block-scaled wgrad's two consumer warpgroups: rows [64 WG, 64 WG + 64) of every tile.
    Each token block's product is scaled by its row and column scales (one row of each per block,
    ``base[g]`` the group's first) before it is added, which leaves nothing in flight; the warpgroups
    run as separate partitions, each releasing a stage on its own, so one scales while the other's wgmma
    runs. Both mask a partial block's B tokens (writing the same bits) and each its own half of A."""
    (
        a_desc, b_desc, c_desc, c_ptr, offs_ptr, base_ptr, sl_ptr, sr_ptr,
        a_bufs, b_bufs, c_smem, ready, empty,
    ) = shared  # fmt: skip
    G, P, Q = sizes
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    HALF: gl.constexpr = BLOCK_M // 2
    mma_layout: gl.constexpr = _mma_layout(HALF, BLOCK_N, 4)
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    num_pid_m = gl.cdiv(P, BLOCK_M)
    num_pid_n = gl.cdiv(Q, BLOCK_N)
    tiles_per_group = num_pid_m * num_pid_n
    out_smem = c_smem.index(WG)
    cons = gl.to_tensor(0)
    prod = gl.zeros([HALF, BLOCK_N], gl.float32, mma_layout)
    for tile in range(gl.program_id(0), G * tiles_per_group, gl.num_programs(0)):
        g, pid_m, pid_n, start, end, first, blocks = _variable_k_tile(
            tile, offs_ptr, tiles_per_group, num_pid_m, num_pid_n, BLOCK_K, GROUP_M
        )
        row0 = pid_m * BLOCK_M + WG * HALF
        offs_p = row0 + gl.arange(0, HALF, layout=row_layout)
        offs_q = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
        p_ok = offs_p < P
        q_ok = offs_q < Q
        block_row = gl.load(base_ptr + g).to(gl.int32)
        acc = gl.zeros([HALF, BLOCK_N], gl.float32, mma_layout)
        for i in range(blocks):
            slot = cons % NUM_STAGES
            mbarrier.wait(ready.index(slot), (cons // NUM_STAGES) & 1)
            a_half = a_bufs.index(slot).slice(WG * HALF, HALF, dim=0)
            _mask_partial_block(a_half, b_bufs.index(slot), first + i * BLOCK_K, start, end, 4)
            # the block's scales load while its wgmma runs
            sl = gl.load(sl_ptr + (block_row + i) * P + offs_p, mask=p_ok, other=0.0)
            sr = gl.load(sr_ptr + (block_row + i) * Q + offs_q, mask=q_ok, other=0.0)
            b = b_bufs.index(slot).permute((1, 0))
            prod = warpgroup_mma(a_half, b, prod, use_acc=False, is_async=True)
            prod = warpgroup_mma_wait(num_outstanding=0, deps=(prod,))
            _cta_barrier()
            mbarrier.arrive(empty.index(slot))
            acc = acc + prod * (gl.expand_dims(sl, 1) * gl.expand_dims(sr, 0))
            cons += 1
        whole = row0 + HALF <= P
        _store_tile(
            acc, c_desc, out_smem, c_ptr, g * P + offs_p, offs_q, g * P + row0, pid_n * BLOCK_N, g * P + P, Q,
            Q, whole, ACCUMULATE,
        )  # fmt: skip
    tma.store_wait(pendings=0)


@cached_launch
@gluon.jit
def _grouped_block_wgrad_sm90_kernel(
    a_desc,
    b_desc,
    c_desc,
    c_ptr,
    offs_ptr,
    base_ptr,
    sl_ptr,
    sr_ptr,
    G,
    P,
    Q,
    ACCUMULATE: gl.constexpr,
    GROUP_M: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):
    # two consumer warpgroups: a stage is free once both have arrived; each has its own output tile
    a_bufs, b_bufs, c_smem, ready, empty = stage_ring(a_desc, b_desc, c_desc, NUM_STAGES, 2)
    shared = (
        a_desc, b_desc, c_desc, c_ptr, offs_ptr, base_ptr, sl_ptr, sr_ptr,
        a_bufs, b_bufs, c_smem, ready, empty,
    )  # fmt: skip
    sizes = (G, P, Q)
    gl.warp_specialize(
        [
            (_block_wgrad_consumer, (shared, sizes, 0, ACCUMULATE, GROUP_M, NUM_STAGES)),
            (_block_wgrad_consumer, (shared, sizes, 1, ACCUMULATE, GROUP_M, NUM_STAGES)),
            (
                _variable_k_producer,
                (a_desc, b_desc, a_bufs, b_bufs, ready, empty, offs_ptr, G, P, Q, GROUP_M, NUM_STAGES, False),
            ),
        ],
        [4, 1],
        [232, 24],
    )
    drop_ring(ready, empty, NUM_STAGES)


def grouped_variable_k_sm90_usable(lhs: torch.Tensor, rhs: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the variable-K kernel takes ``lhs`` [T, P] and ``rhs`` [T, Q] (token-major FP8 views:
    their transposes TMA-describable) into ``out`` [G, P, Q] (contiguous)."""
    if not is_sm90(lhs.device):
        return False
    if lhs.dtype not in _GL_DTYPES or rhs.dtype not in _GL_DTYPES or out.dtype not in _GL_DTYPES:
        return False
    if (lhs.dtype, rhs.dtype, out.dtype, "variable-k") in _failed:
        return False
    row_bytes = out.shape[2] * out.element_size()
    return _aligned(lhs.t()) and _aligned(rhs.t()) and out.is_contiguous() and row_bytes % 16 == 0


def grouped_gemm_fp8_variable_k_sm90(
    lhs: torch.Tensor,
    lhs_scale: torch.Tensor,
    rhs: torch.Tensor,
    rhs_scale: torch.Tensor,
    group_offs: torch.Tensor,
    out: torch.Tensor,
    accumulate: bool,
    block_base: torch.Tensor | None = None,
    config: BlockSm90Config | None = None,
) -> bool:
    """``out[g] (+)= (lhs[rows of g] * sl)^T (rhs[rows of g] * sr)`` with 0-d scales or one per (group,
    column) ([G, P] / [G, Q], contiguous): the tensorwise and row-wise wgrad; or, with ``block_base``
    (int64 [G], each group's first scale row), one scale row per 128-token block of a group
    (``quantize_fp8_group_blocks``): the block recipe's. False (nothing written) where this Triton's
    Gluon cannot compile the kernel. Check ``grouped_variable_k_sm90_usable`` first."""
    config = config or BlockSm90Config()
    groups, p, q = out.shape

    tiles = groups * triton.cdiv(p, _TILE) * triton.cdiv(q, _TILE)
    grid = (min(tiles, num_sms(lhs.device)),)
    operands = (tma_descriptor(lhs.t(), [_TILE, _TILE]), tma_descriptor(rhs.t(), [_TILE, _TILE]))
    out_rows = out.view(groups * p, q)
    scales = (lhs_scale, rhs_scale, groups, p, q)
    launch = {"ACCUMULATE": accumulate, "GROUP_M": config.group_m, "NUM_STAGES": config.num_stages}
    try:
        if block_base is not None:  # one 64-row output tile per consumer warpgroup
            out_desc = tma_descriptor(out_rows, [_TILE // 2, _TILE])
            _grouped_block_wgrad_sm90_kernel[grid](
                *operands, out_desc, out, group_offs, block_base, *scales, **launch, num_warps=4
            )
        else:
            out_desc = tma_descriptor(out_rows, [_TILE, _TILE])
            _grouped_variable_k_sm90_kernel[grid](
                *operands, out_desc, out, group_offs, *scales, PER_COLUMN=lhs_scale.dim() > 0, **launch,
                num_warps=8,
            )  # fmt: skip
    except triton.CompilationError as exc:
        _failed.add((lhs.dtype, rhs.dtype, out.dtype, "variable-k"))
        LOG.warning(
            "Gluon grouped variable-K FP8 GEMM does not compile with triton %s: %s", triton.__version__, exc
        )
        return False
    return True
