"""Dense GEMM ``C (+)= op(A) @ op(B)`` in Triton, fp32 accumulation.

Two kernels share one tile order (grouped along M for L2 reuse):
- a persistent kernel that streams tiles through TMA descriptors (Hopper and newer; the interpreter
  emulates TMA). Out-of-bounds TMA loads read zeros and stores are clipped, so any M, N, K works as
  long as every row stride is 16-byte aligned.
- a pointer kernel with masked loads for any strides and alignment (odd K, sliced inputs, ROCm).
Transposed operands are read through descriptors or strides, never copied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from primus_turbo.triton.utils.device_info import (
    interpreter_active,
    kernel_autotune_enabled,
    max_shared_memory,
    num_sms,
    supports_tma,
)

__all__ = ["gemm_triton", "tma_compatible"]

_TL_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _tma_configs() -> list[triton.Config]:
    if interpreter_active():
        shapes = [(32, 32, 32, 4, 1, 4, False)]
    else:
        shapes = [
            # BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, stages, warps, split epilogue
            (128, 256, 64, 8, 3, 8, True),
            (256, 128, 64, 8, 3, 8, True),
            (128, 256, 64, 8, 4, 8, True),
            (128, 128, 64, 8, 4, 8, True),
            (128, 128, 64, 8, 5, 4, False),
            (128, 128, 128, 8, 3, 8, True),
            (64, 256, 64, 8, 4, 4, True),
            # narrow N or M (MLA down-projections, small micro-batches): more tiles to fill the SMs
            (128, 64, 64, 8, 5, 4, False),
            (64, 128, 64, 8, 5, 4, False),
            (64, 64, 64, 8, 6, 4, False),
            # fp32 operands, and fp32 accumulation into an existing output
            (128, 128, 32, 8, 3, 8, True),
        ]
    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm, "EPILOGUE_SPLIT": split},
            num_stages=stages,
            num_warps=warps,
            pre_hook=_set_tma_block_shapes,
        )
        for bm, bn, bk, gm, stages, warps, split in shapes
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


def _prune_configs(configs: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
    """Drop configs that cannot fit the operand dtypes in shared memory (fp32 and accumulation need
    smaller tiles); keep only the first fitting one when kernel autotuning is off."""
    a, out = (
        named_args[name] for name in (("a_desc", "c_desc") if "a_desc" in named_args else ("a_ptr", "c_ptr"))
    )
    a, out = (t.base if isinstance(t, TensorDescriptor) else t for t in (a, out))
    accumulate = bool(kwargs.get("ACCUMULATE"))
    budget = max_shared_memory(out.device) - _SMEM_SLACK
    fitting = [
        c for c in configs if _smem_bytes(c, a.element_size(), out.element_size(), accumulate) <= budget
    ]
    fitting = fitting or configs[-1:]
    return fitting if kernel_autotune_enabled() else fitting[:1]


def _set_tma_block_shapes(nargs: dict) -> None:
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bk, bm] if nargs["TRANS_A"] else [bm, bk]
    nargs["b_desc"].block_shape = [bn, bk] if nargs["TRANS_B"] else [bk, bn]
    nargs["c_desc"].block_shape = [bm, bn // 2] if nargs["EPILOGUE_SPLIT"] else [bm, bn]


class _KeepAccumulatedOutput:
    """Autotune hooks: timing runs of an accumulating launch must leave the caller's output unchanged."""

    def __init__(self, out_arg: str) -> None:
        self.out_arg = out_arg
        self.saved: torch.Tensor | None = None

    def _out(self, nargs: dict) -> torch.Tensor:
        out = nargs[self.out_arg]
        return out.base if isinstance(out, TensorDescriptor) else out

    def save(self, nargs: dict, reset_only: bool = False) -> None:
        if nargs["ACCUMULATE"] and not reset_only:
            self.saved = self._out(nargs).clone()

    def restore(self, nargs: dict, exception: BaseException | None) -> None:
        if self.saved is not None:
            self._out(nargs).copy_(self.saved)
            self.saved = None


_keep_tma_out = _KeepAccumulatedOutput("c_desc")
_keep_pointer_out = _KeepAccumulatedOutput("c_ptr")


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


@triton.autotune(
    configs=_tma_configs(),
    key=["M", "N", "K", "TRANS_A", "TRANS_B", "ACCUMULATE", "DTYPES"],
    prune_configs_by={"early_config_prune": _prune_configs},
    pre_hook=_keep_tma_out.save,
    post_hook=_keep_tma_out.restore,
)
@triton.jit(do_not_specialize=["M", "N", "K"])
def _gemm_tma_persistent_kernel(
    a_desc,
    b_desc,
    c_desc,
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
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
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
        if EPILOGUE_SPLIT:
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            acc_lo, acc_hi = tl.split(halves)
            _store_tile(c_desc, acc_lo, off_m, off_n, ACCUMULATE)
            _store_tile(c_desc, acc_hi, off_m, off_n + BLOCK_N // 2, ACCUMULATE)
        else:
            _store_tile(c_desc, acc, off_m, off_n, ACCUMULATE)


@triton.autotune(
    configs=_pointer_configs(),
    key=["M", "N", "K", "ACCUMULATE", "DTYPES"],
    prune_configs_by={"early_config_prune": _prune_configs},
    pre_hook=_keep_pointer_out.save,
    post_hook=_keep_pointer_out.restore,
)
@triton.jit(do_not_specialize=["M", "N", "K"])
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
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(tl.cdiv(K, BLOCK_K)):
        k_left = K - ki * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


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


def gemm_triton(
    a: torch.Tensor,
    b: torch.Tensor,
    trans_a: bool,
    trans_b: bool,
    out: torch.Tensor,
    accumulate: bool = False,
    use_tma: bool | None = None,
) -> torch.Tensor:
    """Write ``op(a) @ op(b)`` into ``out`` (``out +=`` when ``accumulate``) and return ``out``.

    ``a`` is (M, K), or (K, M) when ``trans_a``; ``b`` is (K, N), or (N, K) when ``trans_b``; ``out`` is
    (M, N). ``use_tma=None`` picks the TMA kernel whenever the operands allow it.
    """
    M, N = out.shape
    K = a.shape[0] if trans_a else a.shape[1]
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out if accumulate else out.zero_()
    dtypes = f"{_TL_DTYPES[a.dtype]}->{_TL_DTYPES[out.dtype]}"
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    if use_tma is None:
        use_tma = tma_compatible(a, b, out)
    if use_tma:
        sms = num_sms(out.device)
        placeholder = [1, 1]
        a_desc = TensorDescriptor.from_tensor(a, placeholder)
        b_desc = TensorDescriptor.from_tensor(b, placeholder)
        c_desc = TensorDescriptor.from_tensor(out, placeholder)

        def grid(meta: dict) -> tuple[int]:
            return (min(sms, triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])),)

        _gemm_tma_persistent_kernel[grid](
            a_desc,
            b_desc,
            c_desc,
            M,
            N,
            K,
            TRANS_A=trans_a,
            TRANS_B=trans_b,
            ACCUMULATE=accumulate,
            DTYPES=dtypes,
            DOT_PRECISION=precision,
            NUM_SMS=sms,
        )
        return out
    a_view = a.t() if trans_a else a
    b_view = b.t() if trans_b else b

    def grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _gemm_pointer_kernel[grid](
        a_view,
        b_view,
        out,
        M,
        N,
        K,
        a_view.stride(0),
        a_view.stride(1),
        b_view.stride(0),
        b_view.stride(1),
        out.stride(0),
        out.stride(1),
        ACCUMULATE=accumulate,
        DTYPES=dtypes,
        DOT_PRECISION=precision,
    )
    return out
