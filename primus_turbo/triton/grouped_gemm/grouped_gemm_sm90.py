"""Grouped bf16/fp16 GEMMs for Hopper in Gluon: the MoE experts' forward, dgrad and wgrad.

The same structure as the FP8 kernels of ``grouped_gemm_fp8_sm90.py`` (a TMA producer warp feeding a ring
of shared-memory stages, two consumer warpgroups that keep one wgmma in flight, the persistent grouped
tile schedule, TMA stores for whole tiles and masked stores for a group's partial last row tile), with
16-bit operands, which wgmma also reads transposed from shared memory:

- ``grouped_gemm_sm90``: ``out[rows of g] = a[rows of g] @ op(b[g])`` for ``a`` [T, K] row-major and
  ``b`` [G, N, K] (K-major, ``trans_b``) or [G, K, N] (N-major): the forward in both weight layouts and
  the dgrad (which reads the forward's [G, N, K] weights N-major);
- ``grouped_gemm_variable_k_sm90``: ``out[g] (+)= lhs[rows of g]^T @ rhs[rows of g]`` for row-major
  ``lhs`` [T, P] and ``rhs`` [T, Q] (the wgrad): the token blocks load as [tokens, columns] tiles, ``lhs``'s
  read transposed; a group's partial first and last blocks zero the neighbouring groups' token rows in
  shared memory.
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
    _cta_barrier,
    drop_ring,
    load_stage,
    stage_ring,
    tma_descriptor,
)
from primus_turbo.triton.gemm.gemm_kernel import _tile_coords
from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_sm90 import (
    _aligned,
    _group_bounds,
    _store_tile,
    _variable_k_producer,
    _variable_k_tile,
)
from primus_turbo.triton.utils.device_info import is_sm90, num_sms
from primus_turbo.triton.utils.launch import cached_launch

__all__ = [
    "Sm90Tiles",
    "grouped_gemm_sm90",
    "grouped_gemm_variable_k_sm90",
    "grouped_sm90_16bit_usable",
    "grouped_variable_k_sm90_16bit_usable",
]

LOG = logging.getLogger(__name__)
_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}
_failed: set[tuple] = set()


class Sm90Tiles:
    """Launch choices: a BLOCK_M x BLOCK_N output tile (two consumer warpgroups), BLOCK_K-deep stages. Five
    stages by default: on an H200 (2026-12-01, ``bench_grouped_sm90_configs.py``) 1.02x-1.08x four at 6 of
    the 8 swept expert shapes, 0.97x at DeepSeek-V3 fc2 with skewed routing."""

    def __init__(self, block_n: int = 128, block_k: int = 64, num_stages: int = 5, group_m: int = 8) -> None:
        self.block_m, self.block_n, self.block_k = 128, block_n, block_k
        self.num_stages, self.group_m = num_stages, group_m


def _variable_k_tiles(out_dtype: torch.dtype) -> Sm90Tiles:
    """The variable-K kernel's default tiles: 128 x 256 in three stages for a 16-bit output (on an H200,
    2026-12-01, 1.02x-1.08x the 128 x 128 five-stage tile at the DeepSeek-V3, Qwen3-235B-A22B and
    GPT-OSS-20B expert shapes, ``bench_grouped_sm90_configs.py``); an fp32 output (``main_grad``) keeps
    128 x 128, whose output tile leaves shared memory for the stages."""
    return (
        Sm90Tiles(block_n=256, num_stages=3)
        if out_dtype in (torch.bfloat16, torch.float16)
        else Sm90Tiles(num_stages=4)
    )


@gluon.constexpr_function
def _mma16_layout(BLOCK_N, num_warps):
    """wgmma accumulator layout for 16-bit operands: warps stacked along M, 16 rows each."""
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
    )


@gluon.jit
def _issue(acc, a, b, cons, step, empty, NUM_STAGES: gl.constexpr):
    """acc += a @ b on the tensor cores, leaving this wgmma in flight; the previous one has retired, so
    its stage (``step`` > 0) goes back to the producer."""
    acc = warpgroup_mma(a, b, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
    _cta_barrier()  # mbarrier.arrive is issued by one thread
    mbarrier.arrive(empty.index((cons + NUM_STAGES - 1) % NUM_STAGES), pred=step > 0)
    return acc


@gluon.jit
def _drain(acc, cons, steps, empty, NUM_STAGES: gl.constexpr):
    """Retire the last wgmma of a tile and release its stage."""
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    _cta_barrier()
    mbarrier.arrive(empty.index((cons + NUM_STAGES - 1) % NUM_STAGES), pred=steps > 0)
    return acc


@gluon.jit
def _gemm_consumer(
    a_desc,
    c_desc,
    c_ptr,
    offs_ptr,
    a_bufs,
    b_bufs,
    c_smem,
    ready,
    empty,
    G,
    N,
    K,
    stride_cm,
    B_KMAJOR: gl.constexpr,
    BLOCK_N: gl.constexpr,
    GROUP_M: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """The default partition of ``grouped_gemm_sm90``: wgmma and the epilogue of this program's tiles."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    mma_layout: gl.constexpr = _mma16_layout(BLOCK_N, num_warps)
    num_progs = gl.num_programs(0)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    cons = gl.to_tensor(0)
    tiles_before = gl.to_tensor(0)
    for g in range(G):
        start, end, num_pid_m, group_tiles, first = _group_bounds(
            offs_ptr, g, tiles_before, num_pid_n, BLOCK_M
        )
        for t in range(first, group_tiles, num_progs):
            pid_m, pid_n = _tile_coords(t, num_pid_m, num_pid_n, GROUP_M)
            row0 = start + pid_m * BLOCK_M
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
            for kb in range(k_tiles):
                slot = cons % NUM_STAGES
                mbarrier.wait(ready.index(slot), (cons // NUM_STAGES) & 1)
                if B_KMAJOR:
                    b = b_bufs.index(slot).permute((1, 0))
                else:
                    b = b_bufs.index(slot)
                acc = _issue(acc, a_bufs.index(slot), b, cons, kb, empty, NUM_STAGES)
                cons += 1
            acc = _drain(acc, cons, k_tiles, empty, NUM_STAGES)
            offs_m = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
            offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
            whole = row0 + BLOCK_M <= end
            _store_tile(
                acc, c_desc, c_smem, c_ptr, offs_m, offs_n, row0, pid_n * BLOCK_N, end, N, stride_cm,
                whole, False,
            )  # fmt: skip
        tiles_before += group_tiles
    tma.store_wait(pendings=0)


@gluon.jit
def _gemm_producer(
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
    B_KMAJOR: gl.constexpr,
    BLOCK_N: gl.constexpr,
    GROUP_M: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):
    """The worker partition of ``grouped_gemm_sm90``: TMA loads of every (tile, K-block)."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    num_progs = gl.num_programs(0)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    prod = gl.to_tensor(0)
    tiles_before = gl.to_tensor(0)
    for g in range(G):
        start, end, num_pid_m, group_tiles, first = _group_bounds(
            offs_ptr, g, tiles_before, num_pid_n, BLOCK_M
        )
        for t in range(first, group_tiles, num_progs):
            pid_m, pid_n = _tile_coords(t, num_pid_m, num_pid_n, GROUP_M)
            row0 = start + pid_m * BLOCK_M
            for kb in range(k_tiles):
                if B_KMAJOR:  # [G * N, K]
                    b_row, b_col = g * N + pid_n * BLOCK_N, kb * BLOCK_K
                else:  # [G * K, N]
                    b_row, b_col = g * K + kb * BLOCK_K, pid_n * BLOCK_N
                prod = load_stage(
                    a_desc, b_desc, a_bufs, b_bufs, ready, empty, prod, row0, kb * BLOCK_K, b_row, b_col,
                    NUM_STAGES,
                )  # fmt: skip
        tiles_before += group_tiles


@cached_launch
@gluon.jit
def _grouped_gemm_sm90_kernel(
    a_desc,
    b_desc,
    c_desc,
    c_ptr,
    offs_ptr,
    G,
    N,
    K,
    stride_cm,
    B_KMAJOR: gl.constexpr,
    BLOCK_N: gl.constexpr,
    GROUP_M: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    a_bufs, b_bufs, c_smem, ready, empty = stage_ring(a_desc, b_desc, c_desc, NUM_STAGES)
    gl.warp_specialize(
        [
            (
                _gemm_consumer,
                (
                    a_desc,
                    c_desc,
                    c_ptr,
                    offs_ptr,
                    a_bufs,
                    b_bufs,
                    c_smem,
                    ready,
                    empty,
                    G,
                    N,
                    K,
                    stride_cm,
                    B_KMAJOR,
                    BLOCK_N,
                    GROUP_M,
                    NUM_STAGES,
                    num_warps,
                ),
            ),
            (
                _gemm_producer,
                (
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
                    B_KMAJOR,
                    BLOCK_N,
                    GROUP_M,
                    NUM_STAGES,
                ),
            ),
        ],
        [1],
        [24],
    )
    drop_ring(ready, empty, NUM_STAGES)


def grouped_sm90_16bit_usable(a: torch.Tensor, b: torch.Tensor, trans_b: bool, tiles: Sm90Tiles) -> bool:
    """Whether ``grouped_gemm_sm90`` takes ``a`` [T, K] and ``b``: an sm_90 GPU, bf16/fp16 operands of one
    dtype, ``b`` contiguous (one 2-D descriptor over all experts), 16-byte aligned rows, and for N-major
    weights K a multiple of BLOCK_K (a K-block must not reach into the next expert's rows)."""
    if not is_sm90(a.device) or a.dtype not in (torch.bfloat16, torch.float16) or b.dtype != a.dtype:
        return False
    k = a.shape[1]
    n = b.shape[1] if trans_b else b.shape[2]
    if k == 0 or (a.dtype, trans_b, "gemm") in _failed or not b.is_contiguous():
        return False
    if not trans_b and k % tiles.block_k:
        return False
    return _aligned(a) and b.data_ptr() % 16 == 0 and (k * 2) % 16 == 0 and (n * 2) % 16 == 0


def grouped_gemm_sm90(
    a: torch.Tensor,
    b: torch.Tensor,
    group_offs: torch.Tensor,
    trans_b: bool,
    out: torch.Tensor,
    tiles: Sm90Tiles | None = None,
) -> bool:
    """Write the grouped product into ``out`` [T, N]; False (nothing written) where this Triton's Gluon
    cannot compile the kernel. Check ``grouped_sm90_16bit_usable`` first."""
    tiles = tiles or Sm90Tiles()
    groups = b.shape[0]
    n = b.shape[1] if trans_b else b.shape[2]
    k = a.shape[1]
    if trans_b:
        b_desc = tma_descriptor(b.view(groups * n, k), [tiles.block_n, tiles.block_k])
    else:
        b_desc = tma_descriptor(b.view(groups * k, n), [tiles.block_k, tiles.block_n])
    try:
        _grouped_gemm_sm90_kernel[(num_sms(a.device),)](
            tma_descriptor(a, [tiles.block_m, tiles.block_k]),
            b_desc,
            tma_descriptor(out, [tiles.block_m, tiles.block_n]),
            out,
            group_offs,
            groups,
            n,
            k,
            out.stride(0),
            B_KMAJOR=trans_b,
            BLOCK_N=tiles.block_n,
            GROUP_M=tiles.group_m,
            NUM_STAGES=tiles.num_stages,
            num_warps=8,
        )
    except triton.CompilationError as exc:
        _failed.add((a.dtype, trans_b, "gemm"))
        LOG.warning("Gluon grouped GEMM does not compile with triton %s: %s", triton.__version__, exc)
        return False
    return True


@gluon.jit
def _mask_token_rows(tile, t0, start, end, num_warps: gl.constexpr):
    """Zero the token rows outside [start, end) of a [tokens, columns] 16-bit stage tile (a group's partial
    first or last block)."""
    TOKENS: gl.constexpr = tile.shape[0]
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    tokens = t0 + gl.arange(0, TOKENS, layout=gl.SliceLayout(1, layout))
    keep = gl.expand_dims((tokens >= start) & (tokens < end), 1)
    x = tile.load(layout)
    bits = x.to(gl.int16, bitcast=True)
    tile.store(gl.where(keep, bits, gl.zeros_like(bits)).to(x.dtype, bitcast=True))


@gluon.jit
def _variable_k_consumer(
    a_desc,
    b_desc,
    c_desc,
    c_ptr,
    offs_ptr,
    a_bufs,
    b_bufs,
    c_smem,
    ready,
    empty,
    G,
    P,
    Q,
    ACCUMULATE: gl.constexpr,
    GROUP_M: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """The default partition of ``grouped_gemm_variable_k_sm90``."""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[0]  # tokens per block
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    mma_layout: gl.constexpr = _mma16_layout(BLOCK_N, num_warps)
    num_pid_m = gl.cdiv(P, BLOCK_M)
    num_pid_n = gl.cdiv(Q, BLOCK_N)
    tiles_per_group = num_pid_m * num_pid_n
    cons = gl.to_tensor(0)
    for tile in range(gl.program_id(0), G * tiles_per_group, gl.num_programs(0)):
        g, pid_m, pid_n, start, end, first, blocks = _variable_k_tile(
            tile, offs_ptr, tiles_per_group, num_pid_m, num_pid_n, BLOCK_K, GROUP_M
        )
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
        for i in range(blocks):
            t0 = first + i * BLOCK_K
            slot = cons % NUM_STAGES
            mbarrier.wait(ready.index(slot), (cons // NUM_STAGES) & 1)
            if (t0 < start) | (t0 + BLOCK_K > end):
                _mask_token_rows(a_bufs.index(slot), t0, start, end, num_warps)
                _mask_token_rows(b_bufs.index(slot), t0, start, end, num_warps)
                fence_async_shared()
                _cta_barrier()
            acc = _issue(
                acc, a_bufs.index(slot).permute((1, 0)), b_bufs.index(slot), cons, i, empty, NUM_STAGES
            )
            cons += 1
        acc = _drain(acc, cons, blocks, empty, NUM_STAGES)
        offs_p = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
        offs_q = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
        whole = pid_m * BLOCK_M + BLOCK_M <= P  # out [G, P, Q] as [G * P, Q] rows
        _store_tile(
            acc, c_desc, c_smem, c_ptr, g * P + offs_p, offs_q, g * P + pid_m * BLOCK_M, pid_n * BLOCK_N,
            g * P + P, Q, Q, whole, ACCUMULATE,
        )  # fmt: skip
    tma.store_wait(pendings=0)


@cached_launch
@gluon.jit
def _grouped_variable_k_sm90_kernel(
    a_desc,
    b_desc,
    c_desc,
    c_ptr,
    offs_ptr,
    G,
    P,
    Q,
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
                    a_bufs,
                    b_bufs,
                    c_smem,
                    ready,
                    empty,
                    G,
                    P,
                    Q,
                    ACCUMULATE,
                    GROUP_M,
                    NUM_STAGES,
                    num_warps,
                ),
            ),
            (
                _variable_k_producer,
                (a_desc, b_desc, a_bufs, b_bufs, ready, empty, offs_ptr, G, P, Q, GROUP_M, NUM_STAGES, True),
            ),
        ],
        [1],
        [24],
    )
    drop_ring(ready, empty, NUM_STAGES)


def grouped_variable_k_sm90_16bit_usable(lhs: torch.Tensor, rhs: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``grouped_gemm_variable_k_sm90`` takes row-major 16-bit ``lhs`` [T, P] and ``rhs`` [T, Q]
    (one dtype, 16-byte aligned rows) into a contiguous ``out`` [G, P, Q] with 16-byte rows."""
    if not is_sm90(lhs.device) or lhs.dtype not in (torch.bfloat16, torch.float16) or rhs.dtype != lhs.dtype:
        return False
    if out.dtype not in _DTYPES or (lhs.dtype, out.dtype, "variable-k") in _failed:
        return False
    row_bytes = out.shape[2] * out.element_size()
    return _aligned(lhs) and _aligned(rhs) and out.is_contiguous() and row_bytes % 16 == 0


def grouped_gemm_variable_k_sm90(
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    group_offs: torch.Tensor,
    out: torch.Tensor,
    accumulate: bool,
    tiles: Sm90Tiles | None = None,
) -> bool:
    """``out[g] (+)= lhs[rows of g]^T @ rhs[rows of g]``; False (nothing written) where this Triton's Gluon
    cannot compile the kernel. Check ``grouped_variable_k_sm90_16bit_usable`` first."""
    groups, p, q = out.shape
    tiles = tiles or _variable_k_tiles(out.dtype)
    block_tokens = 64
    total = groups * triton.cdiv(p, tiles.block_m) * triton.cdiv(q, tiles.block_n)
    try:
        _grouped_variable_k_sm90_kernel[(min(total, num_sms(lhs.device)),)](
            tma_descriptor(lhs, [block_tokens, tiles.block_m]),
            tma_descriptor(rhs, [block_tokens, tiles.block_n]),
            tma_descriptor(out.view(groups * p, q), [tiles.block_m, tiles.block_n]),
            out,
            group_offs,
            groups,
            p,
            q,
            ACCUMULATE=accumulate,
            GROUP_M=tiles.group_m,
            NUM_STAGES=tiles.num_stages,
            num_warps=8,
        )
    except triton.CompilationError as exc:
        _failed.add((lhs.dtype, out.dtype, "variable-k"))
        LOG.warning(
            "Gluon grouped variable-K GEMM does not compile with triton %s: %s", triton.__version__, exc
        )
        return False
    return True
