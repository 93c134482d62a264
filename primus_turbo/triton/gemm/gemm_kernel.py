"""Dense GEMM ``C (+)= op(A) @ op(B)`` in Triton, fp32 accumulation.

Two kernels share one tile order (grouped along M for L2 reuse):
- a persistent kernel that streams tiles through TMA descriptors (Hopper and newer; the interpreter
  emulates TMA). Out-of-bounds TMA loads read zeros and stores are clipped, so any M, N, K works as
  long as every row stride is 16-byte aligned.
- a pointer kernel with masked loads for any strides and alignment (odd K, sliced inputs, ROCm).
Transposed operands are read through descriptors or strides, never copied.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from primus_turbo.triton.utils.autotune import KeepAccumulatedOutput, tuning_bench
from primus_turbo.triton.utils.device_info import (
    interpreter_active,
    kernel_autotune_enabled,
    max_shared_memory,
    num_sms,
    supports_tma,
)
from primus_turbo.triton.utils.launch import cached_launch

__all__ = ["clear_config_cache", "gemm_triton", "kernel_configs", "tma_compatible"]

_TL_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _tma_configs() -> list[triton.Config]:
    if interpreter_active():
        shapes = [
            (32, 32, 32, 4, 1, 4, False, False),
            (32, 32, 32, 4, 1, 4, False, True),
            (32, 32, 32, 4, 1, 4, True, True),
        ]
    else:
        shapes = [
            # BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, stages, warps, split epilogue, stream-K
            (128, 256, 64, 8, 3, 8, True, False),
            (256, 128, 64, 8, 3, 8, True, False),
            (128, 256, 64, 8, 4, 8, True, False),
            (128, 128, 64, 8, 4, 8, True, False),
            (128, 128, 64, 8, 5, 4, False, False),
            (128, 128, 128, 8, 3, 8, True, False),
            (64, 256, 64, 8, 4, 4, True, False),
            # narrow N or M (MLA down-projections, small micro-batches): more tiles to fill the SMs
            (128, 64, 64, 8, 5, 4, False, False),
            (64, 128, 64, 8, 5, 4, False, False),
            # stream-K: the last partial wave of tiles is split along K over every SM
            (128, 256, 64, 8, 4, 8, True, True),
            (128, 128, 64, 8, 4, 8, True, True),
            (128, 128, 64, 8, 5, 4, False, True),
            (128, 64, 64, 8, 5, 4, False, True),
            # fp32 operands, and fp32 accumulation into an existing output
            (128, 128, 32, 8, 3, 8, True, False),
        ]
    return [
        triton.Config(
            {
                "BLOCK_M": bm,
                "BLOCK_N": bn,
                "BLOCK_K": bk,
                "GROUP_M": gm,
                "EPILOGUE_SPLIT": split,
                "STREAM_K": stream_k,
            },
            num_stages=stages,
            num_warps=warps,
            pre_hook=_set_tma_block_shapes,
        )
        for bm, bn, bk, gm, stages, warps, split, stream_k in shapes
    ]


def _pointer_configs() -> list[triton.Config]:
    if interpreter_active():
        shapes = [(32, 32, 32, 4, 1, 4)]
    elif torch.version.hip is not None:
        # CDNA (gfx942/gfx950): large tiles, two LDS stages, 4-8 waves per block
        shapes = [
            (256, 256, 64, 8, 2, 8),
            (256, 128, 64, 8, 2, 8),
            (128, 128, 64, 8, 2, 4),
            (128, 64, 64, 8, 2, 4),
            (64, 64, 64, 8, 2, 4),
        ]
    else:
        shapes = [
            (128, 256, 64, 8, 3, 8),
            (128, 128, 64, 8, 4, 4),
            (128, 128, 32, 8, 4, 4),
            (64, 128, 64, 8, 4, 4),
            (64, 64, 32, 8, 4, 2),
        ]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm}, num_stages=s, num_warps=w)
        for bm, bn, bk, gm, s, w in shapes
    ]


_SMEM_SLACK = 1024  # barriers and alignment the estimate below does not count


def _smem_bytes(config: triton.Config, in_bytes: int, out_bytes: int, accumulate: bool) -> int:
    """Shared memory of a config: pipelined operand tiles plus the TMA epilogue tiles (store, and the
    load of the existing output when accumulating)."""
    kw = config.kwargs
    operands = config.num_stages * (kw["BLOCK_M"] + kw["BLOCK_N"]) * kw["BLOCK_K"] * in_bytes
    split = kw.get("EPILOGUE_SPLIT")
    epilogue = 0 if split is None else kw["BLOCK_M"] * (kw["BLOCK_N"] // (2 if split else 1)) * out_bytes
    return operands + epilogue * (2 if accumulate else 1)


def _wave_efficiency(num_tiles: int, num_sms: int) -> float:
    """Fraction of SM slots a data-parallel launch of ``num_tiles`` tiles keeps busy."""
    return num_tiles / (triton.cdiv(num_tiles, num_sms) * num_sms)


_STREAM_K_BELOW = 0.85  # untuned launches switch to stream-K under this wave efficiency


def _untuned_choice(configs: list[triton.Config], m: int, n: int, num_sms: int) -> triton.Config:
    """Without autotuning: the first config, or the first stream-K config when the first one would
    leave many SMs idle in its last wave."""
    first = configs[0]
    tiles = triton.cdiv(m, first.kwargs["BLOCK_M"]) * triton.cdiv(n, first.kwargs["BLOCK_N"])
    if _wave_efficiency(tiles, num_sms) < _STREAM_K_BELOW:
        return next((c for c in configs if c.kwargs.get("STREAM_K")), first)
    return first


def _fitting(
    configs: list[triton.Config], in_bytes: int, out_bytes: int, accumulate: bool, device: torch.device
) -> list[triton.Config]:
    """Configs whose operand and epilogue tiles fit the device's shared memory (LDS on AMD); fp32 and
    accumulation need smaller tiles. The last config is kept if none fits."""
    budget = max_shared_memory(device) - _SMEM_SLACK
    fitting = [c for c in configs if _smem_bytes(c, in_bytes, out_bytes, accumulate) <= budget]
    return fitting or configs[-1:]


def _prune_configs(configs: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
    """Autotune pruning: drop the configs that cannot fit in shared memory."""
    a, out = (
        named_args[name] for name in (("a_desc", "c_desc") if "a_desc" in named_args else ("a_ptr", "c_ptr"))
    )
    a, out = (t.base if isinstance(t, TensorDescriptor) else t for t in (a, out))
    return _fitting(configs, a.element_size(), out.element_size(), bool(kwargs.get("ACCUMULATE")), out.device)


def _untuned_config(
    kernel, a: torch.Tensor, out: torch.Tensor, accumulate: bool, m: int, n: int
) -> triton.Config:
    """The config launched without autotuning: chosen on the host, so no timing run ever happens (the
    autotuner would time even a single config, which costs time per shape and breaks graph capture)."""
    configs = _fitting(kernel.configs, a.element_size(), out.element_size(), accumulate, out.device)
    if "STREAM_K" not in configs[0].kwargs:
        return configs[0]
    return _untuned_choice(configs, m, n, num_sms(out.device))


def _set_tma_block_shapes(nargs: dict) -> None:
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bk, bm] if nargs["TRANS_A"] else [bm, bk]
    nargs["b_desc"].block_shape = [bn, bk] if nargs["TRANS_B"] else [bk, bn]
    nargs["c_desc"].block_shape = [bm, bn // 2] if nargs["EPILOGUE_SPLIT"] else [bm, bn]


_keep_tma_out = KeepAccumulatedOutput("c_desc")
_keep_pointer_out = KeepAccumulatedOutput("c_ptr")


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Map a linear tile id to (pid_m, pid_n), walking GROUP_M row-tiles per column for L2 reuse."""
    tiles_per_group = GROUP_M * num_pid_n
    group_id = tile_id // tiles_per_group
    first_m = group_id * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % tiles_per_group) % group_rows
    pid_n = (tile_id % tiles_per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _store_tile(c_desc, acc, off_m, off_n, ACCUMULATE: tl.constexpr):
    if ACCUMULATE:
        acc += c_desc.load([off_m, off_n]).to(tl.float32)
    c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


@triton.jit
def _epilogue(
    c_desc,
    acc,
    off_m,
    off_n,
    ACCUMULATE: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Store a finished fp32 tile (adding the existing output when accumulating), in two halves along
    N when split so the epilogue needs half the shared memory."""
    if EPILOGUE_SPLIT:
        halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
        acc_lo, acc_hi = tl.split(halves)
        _store_tile(c_desc, acc_lo, off_m, off_n, ACCUMULATE)
        _store_tile(c_desc, acc_hi, off_m, off_n + BLOCK_N // 2, ACCUMULATE)
    else:
        _store_tile(c_desc, acc, off_m, off_n, ACCUMULATE)


@triton.jit
def _mma_k_range(
    a_desc,
    b_desc,
    off_m,
    off_n,
    k_begin,
    k_end,
    TRANS_A: tl.constexpr,
    TRANS_B: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """fp32 sum over K-blocks [k_begin, k_end) of one output tile."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(k_begin, k_end):
        off_k = ki * BLOCK_K
        if TRANS_A:
            a = a_desc.load([off_k, off_m]).T
        else:
            a = a_desc.load([off_m, off_k])
        if TRANS_B:
            b = b_desc.load([off_n, off_k]).T
        else:
            b = b_desc.load([off_k, off_n])
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _add_partials(
    acc,
    partials_ptr,
    flags_ptr,
    pid,
    seg_begin,
    tile_begin,
    first_iter,
    per_sm,
    extra,
    col0,
    offs,
    TILE: tl.constexpr,
    CONSUME: tl.constexpr,
):
    """Add, lowest program last, the partial tiles of the programs below ``pid`` that cover the start of
    this tile (columns ``col0 + offs``), waiting for each one's flag; ``CONSUME`` resets the flag."""
    peer = pid - 1
    peer_begin = seg_begin
    while peer_begin > tile_begin:
        while tl.atomic_cas(flags_ptr + peer, 1, 0 if CONSUME else 1, sem="acquire") != 1:
            pass
        tl.debug_barrier()
        acc += tl.load(partials_ptr + peer * TILE + col0 + offs, cache_modifier=".cg")
        peer_begin = first_iter + peer * per_sm + tl.minimum(peer, extra)
        peer -= 1
    return acc


@triton.jit
def _owner_epilogue(
    c_desc,
    acc,
    partials_ptr,
    flags_ptr,
    pid,
    seg_begin,
    tile_begin,
    first_iter,
    per_sm,
    extra,
    off_m,
    off_n,
    ACCUMULATE: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Finish a stream-K tile: add the other programs' partials and store. With a split epilogue the two
    column halves are reduced one after the other, so a 128x256 tile never holds two full fp32 tiles in
    registers."""
    tile = BLOCK_M * BLOCK_N
    if EPILOGUE_SPLIT:
        halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
        acc_lo, acc_hi = tl.split(halves)
        offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N // 2)[None, :]
        acc_lo = _add_partials(
            acc_lo,
            partials_ptr,
            flags_ptr,
            pid,
            seg_begin,
            tile_begin,
            first_iter,
            per_sm,
            extra,
            0,
            offs,
            tile,
            False,
        )
        _store_tile(c_desc, acc_lo, off_m, off_n, ACCUMULATE)
        acc_hi = _add_partials(
            acc_hi,
            partials_ptr,
            flags_ptr,
            pid,
            seg_begin,
            tile_begin,
            first_iter,
            per_sm,
            extra,
            BLOCK_N // 2,
            offs,
            tile,
            True,
        )
        _store_tile(c_desc, acc_hi, off_m, off_n + BLOCK_N // 2, ACCUMULATE)
    else:
        offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        acc = _add_partials(
            acc,
            partials_ptr,
            flags_ptr,
            pid,
            seg_begin,
            tile_begin,
            first_iter,
            per_sm,
            extra,
            0,
            offs,
            tile,
            True,
        )
        _store_tile(c_desc, acc, off_m, off_n, ACCUMULATE)


@triton.autotune(
    configs=_tma_configs(),
    key=["M", "N", "K", "TRANS_A", "TRANS_B", "ACCUMULATE", "DTYPES"],
    prune_configs_by={"early_config_prune": _prune_configs},
    pre_hook=_keep_tma_out.save,
    post_hook=_keep_tma_out.restore,
    do_bench=tuning_bench,
)
@cached_launch
@triton.jit(do_not_specialize=["M", "N", "K"])
def _gemm_tma_persistent_kernel(
    a_desc,
    b_desc,
    c_desc,
    partials_ptr,
    flags_ptr,
    M,
    N,
    K,
    TRANS_A: tl.constexpr,
    TRANS_B: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    DTYPES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr,
    STREAM_K: tl.constexpr,
):
    """Persistent GEMM: whole tiles round-robin over the SMs; with STREAM_K the tiles of the last
    one-to-two waves are instead cut into equal runs of K-blocks, one run per SM.

    Stream-K: each program walks its run backwards. A run that ends inside a tile stores its fp32
    partial sum in ``partials_ptr[pid]`` and raises ``flags_ptr[pid]``; the program that computes a
    tile's last K-block owns the tile, adds the partials of the lower programs in a fixed order
    (deterministic), resets their flags and writes the output. Owners only wait on lower program ids,
    which start first on the GPU and run first under the interpreter. The grid is one program per SM,
    so every program is resident when the kernel has the GPU; kernels running alongside (communication
    overlap) can only delay an owner until their SMs free up.
    """
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    dp_tiles = num_tiles
    if STREAM_K:
        rem = num_tiles % NUM_SMS
        if rem != 0:
            dp_tiles = num_tiles - rem - NUM_SMS if num_tiles > NUM_SMS else 0
    for tile_id in tl.range(pid, dp_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = _mma_k_range(
            a_desc,
            b_desc,
            off_m,
            off_n,
            0,
            k_tiles,
            TRANS_A,
            TRANS_B,
            DOT_PRECISION,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
        )
        _epilogue(c_desc, acc, off_m, off_n, ACCUMULATE, EPILOGUE_SPLIT, BLOCK_M, BLOCK_N)
    if STREAM_K:
        first_iter = dp_tiles * k_tiles
        sk_iters = (num_tiles - dp_tiles) * k_tiles
        per_sm = sk_iters // NUM_SMS
        extra = sk_iters % NUM_SMS
        run_begin = first_iter + pid * per_sm + tl.minimum(pid, extra)
        it = run_begin + per_sm + (pid < extra).to(tl.int32)
        partial_offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        while it > run_begin:
            tile_id = (it - 1) // k_tiles
            tile_begin = tile_id * k_tiles
            seg_begin = tl.maximum(run_begin, tile_begin)
            pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            acc = _mma_k_range(
                a_desc,
                b_desc,
                off_m,
                off_n,
                seg_begin - tile_begin,
                it - tile_begin,
                TRANS_A,
                TRANS_B,
                DOT_PRECISION,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
            )
            if it - tile_begin < k_tiles:
                tl.store(partials_ptr + pid * BLOCK_M * BLOCK_N + partial_offs, acc)
                tl.debug_barrier()
                tl.atomic_xchg(flags_ptr + pid, 1, sem="release")
            else:
                _owner_epilogue(
                    c_desc,
                    acc,
                    partials_ptr,
                    flags_ptr,
                    pid,
                    seg_begin,
                    tile_begin,
                    first_iter,
                    per_sm,
                    extra,
                    off_m,
                    off_n,
                    ACCUMULATE,
                    EPILOGUE_SPLIT,
                    BLOCK_M,
                    BLOCK_N,
                )
            it = seg_begin


@triton.autotune(
    configs=_pointer_configs(),
    key=["M", "N", "K", "ACCUMULATE", "DTYPES"],
    prune_configs_by={"early_config_prune": _prune_configs},
    pre_hook=_keep_pointer_out.save,
    post_hook=_keep_pointer_out.restore,
    do_bench=tuning_bench,
)
@cached_launch
@triton.jit(do_not_specialize=["M"])
def _gemm_pointer_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    ACCUMULATE: tl.constexpr,
    DTYPES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    # int64 scalar bases for the tile, int32 offsets inside it: 2-D int64 pointer math costs registers
    first_m = pid_m * BLOCK_M
    first_n = pid_n * BLOCK_N
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + first_m.to(tl.int64) * stride_am + (rows[:, None] * stride_am + ks[None, :] * stride_ak)
    b_ptrs = b_ptr + first_n.to(tl.int64) * stride_bn + (ks[:, None] * stride_bk + cols[None, :] * stride_bn)
    m_ok = (first_m + rows) < M
    n_ok = (first_n + cols) < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(tl.cdiv(K, BLOCK_K)):
        k_left = K - ki * BLOCK_K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & (ks[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(ks[:, None] < k_left) & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_base = c_ptr + first_m.to(tl.int64) * stride_cm + first_n.to(tl.int64) * stride_cn
    c_ptrs = c_base + (rows[:, None] * stride_cm + cols[None, :] * stride_cn)
    c_mask = m_ok[:, None] & n_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def kernel_configs(use_tma: bool) -> list[triton.Config]:
    """The autotune configs of the TMA (``use_tma``) or pointer kernel, in priority order."""
    return list((_gemm_tma_persistent_kernel if use_tma else _gemm_pointer_kernel).configs)


def _row_major_tma_ok(t: torch.Tensor) -> bool:
    return (
        t.dim() == 2
        and t.stride(1) == 1
        and (t.stride(0) * t.element_size()) % 16 == 0
        and t.data_ptr() % 16 == 0
    )


def tma_compatible(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> bool:
    """Whether the TMA kernel can read ``a``, ``b`` (as stored) and write ``c``."""
    return supports_tma(c.device) and all(_row_major_tma_ok(t) for t in (a, b, c))


# The launch arguments of the config the autotuner (or the untuned heuristic) chose, per problem key.
# Later calls with the same key launch the compiled kernel directly: the autotuner's per-call work
# (argument dicts, key, hooks) is host time that short GEMMs cannot hide.
_chosen: dict[tuple, tuple[triton.Config, dict]] = {}
_MAX_PARTIAL_TILE = 128 * 256  # fp32 elements of the largest stream-K tile


@functools.lru_cache(maxsize=None)
def _unused_buffers(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Placeholders for the stream-K buffers of a data-parallel launch (same pointer types)."""
    return torch.empty(1, dtype=torch.float32, device=device), torch.empty(
        1, dtype=torch.int32, device=device
    )


_stream_k_state: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _stream_k_buffers(device: torch.device, sms: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-SM fp32 partial tiles and zeroed ready flags.

    The kernel resets every flag it consumes, so one pair per (device, stream) serves every launch in
    stream order. During CUDA-graph capture a fresh pair is made instead: its zero-fill is part of the
    graph, and a buffer first filled inside a capture would hold garbage outside it.
    """
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    buffers = None if capturing else _stream_k_state.get((device, stream))
    if buffers is None:
        partials = torch.empty(sms * _MAX_PARTIAL_TILE, dtype=torch.float32, device=device)
        buffers = (partials, torch.zeros(sms, dtype=torch.int32, device=device))
        if not capturing:
            _stream_k_state[(device, stream)] = buffers
    return buffers


def _persistent_programs(m: int, n: int, sms: int, meta: dict) -> int:
    """One program per SM; fewer when there are fewer tiles, except stream-K, which splits K over all."""
    if meta["STREAM_K"]:
        return sms
    return min(sms, triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]))


def _tma_descriptors(a, b, out, trans_a, trans_b, config: triton.Config) -> tuple[TensorDescriptor, ...]:
    bm, bn, bk = (config.kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
    return (
        TensorDescriptor(a, a.shape, a.stride(), [bk, bm] if trans_a else [bm, bk]),
        TensorDescriptor(b, b.shape, b.stride(), [bn, bk] if trans_b else [bk, bn]),
        TensorDescriptor(
            out, out.shape, out.stride(), [bm, bn // 2] if config.kwargs["EPILOGUE_SPLIT"] else [bm, bn]
        ),
    )


def _launch_tma(a, b, out, m, n, k, trans_a, trans_b, accumulate, dtypes, precision, config) -> None:
    sms = num_sms(out.device)
    flags = dict(TRANS_A=trans_a, TRANS_B=trans_b, ACCUMULATE=accumulate, DTYPES=dtypes)
    flags.update(DOT_PRECISION=precision, NUM_SMS=sms)
    key = ("tma", m, n, k, trans_a, trans_b, accumulate, dtypes, out.device)
    if config is None and key in _chosen:
        config, launch_kwargs = _chosen[key]
    elif config is None and not kernel_autotune_enabled():
        config = _untuned_config(_gemm_tma_persistent_kernel, a, out, accumulate, m, n)
        launch_kwargs = {**flags, **config.all_kwargs()}
        _chosen[key] = (config, launch_kwargs)
    elif config is None:
        placeholder = [1, 1]
        descs = [TensorDescriptor.from_tensor(t, placeholder) for t in (a, b, out)]

        def grid(meta: dict) -> tuple[int]:
            return (_persistent_programs(m, n, sms, meta),)

        kernel = _gemm_tma_persistent_kernel
        kernel[grid](*descs, *_stream_k_buffers(out.device, sms), m, n, k, **flags)
        _chosen[key] = (kernel.best_config, {**flags, **kernel.best_config.all_kwargs()})
        return
    else:
        launch_kwargs = {**flags, **config.all_kwargs()}
    kw = config.kwargs
    buffers = _stream_k_buffers(out.device, sms) if kw["STREAM_K"] else _unused_buffers(out.device)
    grid = (_persistent_programs(m, n, sms, kw),)
    _gemm_tma_persistent_kernel.fn[grid](
        *_tma_descriptors(a, b, out, trans_a, trans_b, config), *buffers, m, n, k, **launch_kwargs
    )


def _launch_pointer(a, b, out, m, n, k, trans_a, trans_b, accumulate, dtypes, precision, config) -> None:
    a_view = a.t() if trans_a else a
    b_view = b.t() if trans_b else b
    args = (a_view, b_view, out, m, n, k, *a_view.stride(), *b_view.stride(), *out.stride())
    flags = dict(ACCUMULATE=accumulate, DTYPES=dtypes, DOT_PRECISION=precision)
    key = ("pointer", m, n, k, accumulate, dtypes, out.device)
    if config is None and key in _chosen:
        config, launch_kwargs = _chosen[key]
    elif config is None and not kernel_autotune_enabled():
        config = _untuned_config(_gemm_pointer_kernel, a, out, accumulate, m, n)
        launch_kwargs = {**flags, **config.all_kwargs()}
        _chosen[key] = (config, launch_kwargs)
    elif config is None:

        def grid(meta: dict) -> tuple[int]:
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

        kernel = _gemm_pointer_kernel
        kernel[grid](*args, **flags)
        _chosen[key] = (kernel.best_config, {**flags, **kernel.best_config.all_kwargs()})
        return
    else:
        launch_kwargs = {**flags, **config.all_kwargs()}
    grid = (triton.cdiv(m, config.kwargs["BLOCK_M"]) * triton.cdiv(n, config.kwargs["BLOCK_N"]),)
    _gemm_pointer_kernel.fn[grid](*args, **launch_kwargs)


def clear_config_cache() -> None:
    """Forget the configs chosen per problem (after changing ``PRIMUS_TURBO_TRITON_AUTOTUNE``)."""
    _chosen.clear()


def gemm_triton(
    a: torch.Tensor,
    b: torch.Tensor,
    trans_a: bool,
    trans_b: bool,
    out: torch.Tensor,
    accumulate: bool = False,
    use_tma: bool | None = None,
    config: triton.Config | None = None,
) -> torch.Tensor:
    """Write ``op(a) @ op(b)`` into ``out`` (``out +=`` when ``accumulate``) and return ``out``.

    ``a`` is (M, K), or (K, M) when ``trans_a``; ``b`` is (K, N), or (N, K) when ``trans_b``; ``out`` is
    (M, N). ``use_tma=None`` picks the TMA kernel whenever the operands allow it. ``config`` bypasses the
    autotuner with one config of that kernel (see ``kernel_configs``), for tests and tuning sweeps.
    """
    m, n = out.shape
    k = a.shape[0] if trans_a else a.shape[1]
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out if accumulate else out.zero_()
    dtypes = f"{_TL_DTYPES[a.dtype]}->{_TL_DTYPES[out.dtype]}"
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    if use_tma is None:
        use_tma = tma_compatible(a, b, out)
    launch = _launch_tma if use_tma else _launch_pointer
    launch(a, b, out, m, n, k, trans_a, trans_b, accumulate, dtypes, precision, config)
    return out
