"""Block-scaled FP8 GEMM for Hopper in Gluon: 1 x 128 scales on A, 128 x 128 blocks on B (DeepSeek-V3).

``C (M, N) = sum_kb (A[:, kb] @ B[:, kb]^T) * sa[:, kb] * sb[n // 128, kb]`` with A (M, K) and B (N, K)
K-contiguous FP8 and K a multiple of 128. Each K-block's product must be scaled before it is added, so
the plain-Triton kernel waits for every wgmma and leaves the tensor cores idle while it scales. This
kernel keeps one wgmma in flight while it scales the previous one:

- a producer warp TMA-loads A and B tiles into a ring of NUM_STAGES shared-memory stages (``ready`` /
  ``empty`` mbarriers); eight consumer warps (two warpgroups, 128 x 128 tile) do the rest;
- each K-block's wgmma writes a fresh fp32 product tile (two alternate, ``p0`` / ``p1``); after issuing
  block k the consumers retire block k-1 (``warpgroup_mma_wait(1)``), release its stage and add it to
  the accumulator with one multiply-add per element (a 128-wide tile lies in one weight block, so the
  scale is ``sa[rows] * sb``);
- ptxas serializes every wgmma of a kernel when one stays in flight across a loop back-edge while other
  accumulator registers are read, so the K loop runs K_UNROLL blocks of straight-line code and drains
  at its end; the drained product is scaled after the next iteration's first wgmma is issued. The two
  ordering fences in ``_retire`` and the kernel prologue keep LLVM from copying in-flight registers,
  which would serialize the wgmmas too;
- the bf16/fp16/fp32 tile leaves through shared memory and a TMA store, which clips at M and N.

Gluon's API moves between Triton releases; the launcher falls back to the plain-Triton kernel (with a
warning) where this one does not compile.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

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
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from primus_turbo.triton.gemm.gemm_kernel import _tile_coords
from primus_turbo.triton.utils.device_info import is_sm90, num_sms
from primus_turbo.triton.utils.launch import cached_launch

__all__ = ["BlockSm90Config", "gemm_fp8_block_sm90", "sm90_block_kernel_usable"]

LOG = logging.getLogger(__name__)
SCALE_BLOCK = 128
# names that moved after Triton 3.6: the CTA-wide barrier (gl.barrier) and the TMA copies (async_load,
# async_store)
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
_GL_DTYPES = {
    torch.float8_e4m3fn: gl.float8e4nv,
    torch.float8_e5m2: gl.float8e5,
    torch.bfloat16: gl.bfloat16,
    torch.float16: gl.float16,
    torch.float32: gl.float32,
}


@dataclass(frozen=True)
class BlockSm90Config:
    """Launch choices: the 128 x 128 tile is fixed (two consumer warpgroups, one weight block wide)."""

    num_stages: int = 4
    k_unroll: int = 8
    group_m: int = 8


@gluon.constexpr_function
def _mma_layout(BLOCK_M, BLOCK_N, num_warps):
    """wgmma accumulator layout: warps stacked along M, 16 rows each."""
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 32]
    )


@gluon.jit
def _scales(sa_rows, m_mask, sb_row, kb, stride_sak, stride_sbk):
    """This K-block's scale per tile row: sa[rows, kb] * sb[tile's weight block, kb]."""
    sa = gl.load(sa_rows + kb * stride_sak, mask=m_mask, other=0.0)
    return sa * gl.load(sb_row + kb * stride_sbk)


@gluon.jit
def _retire(acc, p, scale):
    """acc += p * scale[:, None]. The result passes through a wgmma wait (one group may stay in flight,
    as the caller has) only as an ordering fence: without it LLVM sinks the multiply-adds below the next
    wgmma that reuses p's registers, and the register copies that follow serialize every wgmma."""
    acc = acc + p * gl.expand_dims(scale, 1)
    return warpgroup_mma_wait(num_outstanding=1, deps=(acc,))


@gluon.jit
def _unit(
    acc,
    p0,
    p1,
    scale,
    scale_last,
    cons,
    kb,
    a_bufs,
    b_bufs,
    ready,
    empty,
    sa_rows,
    m_mask,
    sb_row,
    stride_sak,
    stride_sbk,
    X: gl.constexpr,
    RETIRE: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):
    """Issue K-block kb's wgmma into product tile X (0: p0, 1: p1), then retire the previous block's
    product (the other tile): RETIRE 0 none (a tile's first block), 1 already drained, 2 wait for it
    with this block's wgmma left in flight."""
    slot = cons % NUM_STAGES
    mbarrier.wait(ready.index(slot), (cons // NUM_STAGES) & 1)
    scale_last = scale
    scale = _scales(sa_rows, m_mask, sb_row, kb, stride_sak, stride_sbk)
    b = b_bufs.index(slot).permute((1, 0))
    if X == 0:
        p0 = warpgroup_mma(a_bufs.index(slot), b, p0, use_acc=False, is_async=True)
        if RETIRE == 2:
            p1 = warpgroup_mma_wait(num_outstanding=1, deps=(p1,))
    else:
        p1 = warpgroup_mma(a_bufs.index(slot), b, p1, use_acc=False, is_async=True)
        if RETIRE == 2:
            p0 = warpgroup_mma_wait(num_outstanding=1, deps=(p0,))
    # the previous block's wgmma has retired in both warpgroups: its stage goes back to the producer
    # (mbarrier.arrive is issued by one thread, hence the barrier first)
    _cta_barrier()
    mbarrier.arrive(empty.index((cons + NUM_STAGES - 1) % NUM_STAGES), pred=cons > 0)
    if RETIRE != 0:
        if X == 0:
            acc = _retire(acc, p1, scale_last)
        else:
            acc = _retire(acc, p0, scale_last)
    return acc, p0, p1, scale, scale_last, cons + 1


@gluon.jit
def _tile_mainloop(
    acc,
    p0,
    p1,
    cons,
    k_tiles,
    a_bufs,
    b_bufs,
    ready,
    empty,
    sa_rows,
    m_mask,
    sb_row,
    stride_sak,
    stride_sbk,
    K_UNROLL: gl.constexpr,
    PRO: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):
    """Every K-block of one tile: PRO = 1 + (k_tiles - 1) % K_UNROLL blocks first (their last product
    lands in p1), then K_UNROLL blocks per iteration, alternating p0 / p1 and draining at the end."""
    scale = _scales(sa_rows, m_mask, sb_row, 0, stride_sak, stride_sbk)
    scale_last = scale
    for q in gl.static_range(PRO):
        acc, p0, p1, scale, scale_last, cons = _unit(
            acc,
            p0,
            p1,
            scale,
            scale_last,
            cons,
            q,
            a_bufs,
            b_bufs,
            ready,
            empty,
            sa_rows,
            m_mask,
            sb_row,
            stride_sak,
            stride_sbk,
            (PRO - q) % 2,
            0 if q == 0 else 2,
            NUM_STAGES,
        )
    p1 = warpgroup_mma_wait(num_outstanding=0, deps=(p1,))
    for it in range((k_tiles - PRO) // K_UNROLL):
        base = PRO + it * K_UNROLL
        for q in gl.static_range(K_UNROLL):
            acc, p0, p1, scale, scale_last, cons = _unit(
                acc,
                p0,
                p1,
                scale,
                scale_last,
                cons,
                base + q,
                a_bufs,
                b_bufs,
                ready,
                empty,
                sa_rows,
                m_mask,
                sb_row,
                stride_sak,
                stride_sbk,
                q % 2,
                1 if q == 0 else 2,
                NUM_STAGES,
            )
        p1 = warpgroup_mma_wait(num_outstanding=0, deps=(p1,))
    return _retire(acc, p1, scale), p0, p1, cons


@gluon.jit
def _consumer(
    a_desc,
    b_desc,
    c_desc,
    sa_ptr,
    sb_ptr,
    a_bufs,
    b_bufs,
    c_smem,
    ready,
    empty,
    M,
    N,
    K,
    stride_sam,
    stride_sak,
    stride_sbn,
    stride_sbk,
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
    pid = gl.program_id(0)
    num_progs = gl.num_programs(0)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = K // BLOCK_K
    my_tiles = (num_pid_m * num_pid_n - pid + num_progs - 1) // num_progs
    cons = gl.to_tensor(0)
    # the product tiles live in one register set for the whole kernel; materialized before any wgmma,
    # or LLVM sinks p1's zero-fill behind the first (in-flight) one and ptxas serializes them all
    p0 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
    p1 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
    p0, p1 = warpgroup_mma_wait(num_outstanding=0, deps=(p0, p1))
    for t in range(my_tiles):
        pid_m, pid_n = _tile_coords(pid + t * num_progs, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_layout)
        sb_row = sb_ptr + (pid_n * BLOCK_N // BLOCK_K) * stride_sbn
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
            offs_m < M,
            sb_row,
            stride_sak,
            stride_sbk,
            K_UNROLL,
            PRO,
            NUM_STAGES,
        )
        tma.store_wait(pendings=0)  # the previous tile's store has read c_smem
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        _tma_store(c_desc, [pid_m * BLOCK_M, pid_n * BLOCK_N], c_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def load_stage(
    a_desc, b_desc, a_bufs, b_bufs, ready, empty, prod, a_row, a_col, b_row, b_col, NUM_STAGES: gl.constexpr
):
    """The producer's step ``prod``: wait until the consumers release its stage (at once on the first
    round), TMA-load the A tile at (a_row, a_col) and the B tile at (b_row, b_col) into it, and return
    the next step."""
    slot = prod % NUM_STAGES
    mbarrier.wait(empty.index(slot), ((prod // NUM_STAGES) & 1) ^ 1)
    bar = ready.index(slot)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    _tma_load(a_desc, [a_row, a_col], bar, a_bufs.index(slot))
    _tma_load(b_desc, [b_row, b_col], bar, b_bufs.index(slot))
    return prod + 1


@gluon.jit
def _producer(
    a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr
):
    """The worker partition: TMA loads of every (tile, K-block) of this program into the stage ring."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    pid = gl.program_id(0)
    num_progs = gl.num_programs(0)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = K // BLOCK_K
    my_tiles = (num_pid_m * num_pid_n - pid + num_progs - 1) // num_progs
    prod = 0
    for t in range(my_tiles):
        pid_m, pid_n = _tile_coords(pid + t * num_progs, num_pid_m, num_pid_n, GROUP_M)
        for kb in range(k_tiles):
            prod = load_stage(
                a_desc, b_desc, a_bufs, b_bufs, ready, empty, prod,
                pid_m * BLOCK_M, kb * BLOCK_K, pid_n * BLOCK_N, kb * BLOCK_K, NUM_STAGES,
            )  # fmt: skip


@gluon.jit
def stage_ring(a_desc, b_desc, c_desc, NUM_STAGES: gl.constexpr, CONSUMERS: gl.constexpr = 1):
    """Shared memory of a TMA-fed kernel: NUM_STAGES (A, B) stages of the descriptors' block shapes with
    their ``ready`` / ``empty`` mbarriers, and one output tile. With CONSUMERS > 1 partitions consuming
    the stages independently, a stage is free once each has arrived, and each gets its own output tile
    (``c_smem`` [CONSUMERS, ...])."""
    a_shape: gl.constexpr = a_desc.block_type.shape
    b_shape: gl.constexpr = b_desc.block_type.shape
    c_shape: gl.constexpr = c_desc.block_type.shape
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, a_shape[0], a_shape[1]], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES, b_shape[0], b_shape[1]], b_desc.layout)
    if CONSUMERS == 1:
        c_smem = gl.allocate_shared_memory(c_desc.dtype, c_shape, c_desc.layout)
    else:
        c_smem = gl.allocate_shared_memory(c_desc.dtype, [CONSUMERS, c_shape[0], c_shape[1]], c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    return a_bufs, b_bufs, c_smem, ready, empty


@gluon.jit
def drop_ring(ready, empty, NUM_STAGES: gl.constexpr):
    """Invalidate the stage ring's mbarriers at the kernel's end."""
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


@functools.lru_cache(maxsize=None)
def _shared_layout(block: tuple[int, ...], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The default swizzled shared-memory layout of ``block`` tiles, built once per shape and dtype (its
    construction costs more host time than the descriptor around it)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), _GL_DTYPES[dtype])


def tma_descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A host TMA descriptor of ``t`` (2-D, unit last stride) with ``block`` tiles in the default
    swizzled shared-memory layout."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, _shared_layout(tuple(block), t.dtype))


@cached_launch
@gluon.jit
def _gemm_fp8_block_sm90_kernel(
    a_desc,
    b_desc,
    c_desc,
    sa_ptr,
    sb_ptr,
    M,
    N,
    K,
    stride_sam,
    stride_sak,
    stride_sbn,
    stride_sbk,
    GROUP_M: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    K_UNROLL: gl.constexpr,
    PRO: gl.constexpr,
    num_warps: gl.constexpr,
):
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]  # the scale block: one K-block per scale
    gl.static_assert(BLOCK_K % BLOCK_N == 0, "a tile's columns lie in one weight block")
    gl.static_assert(K_UNROLL % 2 == 0, "an iteration's products alternate p0 / p1 evenly")
    a_bufs, b_bufs, c_smem, ready, empty = stage_ring(a_desc, b_desc, c_desc, NUM_STAGES)
    gl.warp_specialize(
        [
            (
                _consumer,
                (
                    a_desc,
                    b_desc,
                    c_desc,
                    sa_ptr,
                    sb_ptr,
                    a_bufs,
                    b_bufs,
                    c_smem,
                    ready,
                    empty,
                    M,
                    N,
                    K,
                    stride_sam,
                    stride_sak,
                    stride_sbn,
                    stride_sbk,
                    GROUP_M,
                    NUM_STAGES,
                    K_UNROLL,
                    PRO,
                    num_warps,
                ),
            ),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M, NUM_STAGES)),
        ],
        [1],
        [24],
    )
    drop_ring(ready, empty, NUM_STAGES)


_TILE = 128
_failed: set[tuple] = set()


def sm90_block_kernel_usable(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out: torch.Tensor
) -> bool:
    """Whether this kernel takes the call: an sm_90 CUDA GPU, FP8 operands with unit stride along K and
    16-byte aligned rows, K a multiple of 128, a TMA-storable output, 32-bit scale offsets, and no earlier
    compile failure for these dtypes."""
    if not is_sm90(out.device):
        return False
    m, k = a.shape
    if (
        k % SCALE_BLOCK
        or a.dtype not in _GL_DTYPES
        or b.dtype not in _GL_DTYPES
        or out.dtype not in _GL_DTYPES
    ):
        return False
    if (a.dtype, b.dtype, out.dtype) in _failed:
        return False
    aligned = all(
        t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 for t in (a, b, out)
    ) and all(t.data_ptr() % 16 == 0 for t in (a, b, out))
    offsets = max(a_scale.stride(0) * m, a_scale.stride(1) * (k // SCALE_BLOCK)) + b_scale.numel()
    return aligned and offsets < 2**31


def gemm_fp8_block_sm90(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out: torch.Tensor,
    config: BlockSm90Config | None = None,
) -> bool:
    """Write ``(a * a_scale) @ (b * b_scale)^T`` into ``out`` (M, N); False (nothing written) where this
    Triton's Gluon cannot compile the kernel. ``a`` (M, K) has fp32 scales (M, K / 128), any strides
    (K-block-major is the fast layout); ``b`` (N, K) has (ceil(N / 128), K / 128). Check
    ``sm90_block_kernel_usable`` first."""
    config = config or BlockSm90Config()
    m, k = a.shape
    n = b.shape[0]
    if m == 0 or n == 0:
        return True
    k_tiles = k // SCALE_BLOCK

    tiles = triton.cdiv(m, _TILE) * triton.cdiv(n, _TILE)
    grid = (min(tiles, num_sms(out.device)),)
    try:
        _gemm_fp8_block_sm90_kernel[grid](
            tma_descriptor(a, [_TILE, SCALE_BLOCK]),
            tma_descriptor(b, [_TILE, SCALE_BLOCK]),
            tma_descriptor(out, [_TILE, _TILE]),
            a_scale,
            b_scale,
            m,
            n,
            k,
            *a_scale.stride(),
            *b_scale.stride(),
            GROUP_M=config.group_m,
            NUM_STAGES=config.num_stages,
            K_UNROLL=config.k_unroll,
            PRO=1 + (k_tiles - 1) % config.k_unroll,
            num_warps=8,
        )
    except triton.CompilationError as exc:
        _failed.add((a.dtype, b.dtype, out.dtype))
        LOG.warning(
            "Gluon block-scaled FP8 GEMM does not compile with triton %s: %s", triton.__version__, exc
        )
        return False
    return True
