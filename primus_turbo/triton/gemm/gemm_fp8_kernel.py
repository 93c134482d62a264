"""FP8 GEMM ``C (+)= (A * sa) @ (B * sb)^T`` in Triton for the NT layout, fp32 accumulation.

A (M, K) and B (N, K) are row-major FP8 read by a persistent kernel, through TMA descriptors where the
GPU has them (Hopper and newer) and with masked pointer loads elsewhere (ROCm, the interpreter). Scale
modes per operand: 0 one scale, 1 one per row, 2 one per (row, K-block), 3 one per (row-block,
K-block) (B only: 128 x 128 weight tiles). Modes 0 and 1 scale the finished tile once; modes 2 and 3
scale each K-block's partial product before it is added (the DeepSeek-V3 recipe), so BLOCK_K equals
the scale block. Where one operand's tile lies inside one 128 x 128 weight block, its scale is a scalar
per K-block and each partial product costs one multiply-add per element, not two.

The kernel waits for each K-block's wgmma before scaling it, so one program alone leaves the tensor
cores idle during that arithmetic; configs with CTAS_PER_SM = 2 keep two programs on each SM, and one
program's MMAs run while the other scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from primus_turbo.triton.gemm.gemm_kernel import _tile_coords
from primus_turbo.triton.utils.autotune import KeepAccumulatedOutput, tuning_bench
from primus_turbo.triton.utils.device_info import (
    interpreter_active,
    kernel_autotune_enabled,
    max_shared_memory,
    num_sms,
    supports_tma,
)
from primus_turbo.triton.utils.launch import cached_launch

try:  # Gluon (Triton >= 3.6 on CUDA): the Hopper kernel for 1 x 128 / 128 x 128 block scaling
    from primus_turbo.triton.gemm.gemm_fp8_block_sm90 import gemm_fp8_block_sm90, sm90_block_kernel_usable
except (ImportError, AttributeError):  # a Triton without Gluon, or with a Gluon API this file predates
    gemm_fp8_block_sm90 = sm90_block_kernel_usable = None

__all__ = [
    "SCALE_BLOCK_2D",
    "SCALE_BLOCKS",
    "SCALE_ROW",
    "SCALE_TENSOR",
    "gemm_fp8_triton",
    "kernel_configs",
    "supported_scale_blocks",
]

SCALE_TENSOR, SCALE_ROW, SCALE_BLOCKS, SCALE_BLOCK_2D = 0, 1, 2, 3


def _configs() -> list[triton.Config]:
    if interpreter_active():
        shapes = [(32, 32, 32, 4, 1, 4, 1)]
    elif torch.version.hip is not None:
        # CDNA3/4: two LDS stages, 128-wide K blocks for the FP8 matrix cores
        shapes = [
            (256, 256, 128, 8, 2, 8, 1),
            (128, 128, 128, 8, 2, 8, 1),
            (128, 128, 128, 8, 2, 4, 1),
            (64, 128, 128, 8, 2, 4, 1),
        ]
    else:
        # Hopper: 64x128 tiles, two programs per SM first (930 TFLOP/s block-scaled at 8192^3 on an
        # H200 against 833 for one 128x128 program); no register spills in any scale mode (ptxas, sm_90a)
        shapes = [
            (64, 128, 128, 8, 3, 4, 2),
            (128, 128, 128, 8, 4, 8, 1),
            (64, 128, 128, 8, 4, 4, 2),
            (128, 64, 128, 8, 4, 4, 2),
        ]
    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm, "CTAS_PER_SM": ctas},
            num_stages=stages,
            num_warps=warps,
            pre_hook=_set_block_shapes,
        )
        for bm, bn, bk, gm, stages, warps, ctas in shapes
    ]


def _set_block_shapes(nargs: dict) -> None:
    if nargs["USE_TMA"]:
        nargs["a_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
        nargs["b_desc"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]
    if nargs["TMA_STORE"]:
        nargs["c_ptr"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_N"]]


def _fp8_smem_bytes(config: triton.Config, out_bytes: int) -> int:
    """Shared memory of a config: pipelined FP8 operand tiles plus the output tile the epilogue stages."""
    kw = config.kwargs
    operands = config.num_stages * (kw["BLOCK_M"] + kw["BLOCK_N"]) * kw["BLOCK_K"]
    return operands + kw["BLOCK_M"] * kw["BLOCK_N"] * out_bytes


def _usable(configs: list[triton.Config], scale_block: int, out: torch.Tensor) -> list[triton.Config]:
    """Configs whose BLOCK_K matches the per-K-block scales and whose CTAS_PER_SM programs fit in one
    SM's shared memory (each program also reserves 1 KiB)."""
    if scale_block:
        configs = [c for c in configs if c.kwargs["BLOCK_K"] == scale_block]
        if not configs:
            raise ValueError(f"no FP8 GEMM config has BLOCK_K = {scale_block}")
    per_sm = max_shared_memory(out.device) + 1024
    fitting = [
        c
        for c in configs
        if c.kwargs.get("CTAS_PER_SM", 1) * (_fp8_smem_bytes(c, out.element_size()) + 1024) <= per_sm
    ]
    return fitting or configs[-1:]


def _prune(configs: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
    out = named_args["c_ptr"]
    return _usable(configs, int(kwargs.get("SCALE_BLOCK", 0)), out.base if kwargs.get("TMA_STORE") else out)


# The launch arguments of the config the autotuner chose, per problem; later calls with the same problem
# launch the compiled kernel directly, without the autotuner's per-call host work.
_chosen: dict[tuple, tuple[triton.Config, dict]] = {}


def kernel_configs() -> list[triton.Config]:
    """The autotune configs of the FP8 GEMM kernel, in priority order."""
    return list(_gemm_fp8_kernel.configs)


def supported_scale_blocks() -> frozenset[int]:
    """Block sizes the per-K-block scale modes can use (each needs a config with that BLOCK_K)."""
    return frozenset(c.kwargs["BLOCK_K"] for c in _gemm_fp8_kernel.configs)


_keep_output = KeepAccumulatedOutput("c_ptr")


@triton.jit
def _load_scales(ptr, rows, row_ok, kb, stride_r, stride_k, MODE: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    """Scale vector over ``rows`` for K-block ``kb`` (modes 2 and 3) or for the tile (modes 0 and 1)."""
    if MODE == 0:
        return tl.load(ptr).to(tl.float32) + tl.zeros(rows.shape, dtype=tl.float32)
    if MODE == 1:
        return tl.load(ptr + rows * stride_r, mask=row_ok, other=0.0).to(tl.float32)
    if MODE == 2:
        return tl.load(ptr + rows * stride_r + kb * stride_k, mask=row_ok, other=0.0).to(tl.float32)
    return tl.load(ptr + (rows // SCALE_BLOCK) * stride_r + kb * stride_k, mask=row_ok, other=0.0).to(
        tl.float32
    )


@triton.autotune(
    configs=_configs(),
    key=["M", "N", "K", "A_MODE", "B_MODE", "SCALE_BLOCK", "ACCUMULATE", "DTYPES", "USE_TMA", "TMA_STORE"],
    prune_configs_by={"early_config_prune": _prune},
    pre_hook=_keep_output.save,
    post_hook=_keep_output.restore,
    do_bench=tuning_bench,
)
@cached_launch
@triton.jit(do_not_specialize=["M"])
def _gemm_fp8_kernel(
    a_desc,
    b_desc,
    c_ptr,
    a_scale_ptr,
    b_scale_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    stride_cn,
    stride_as_r,
    stride_as_k,
    stride_bs_r,
    stride_bs_k,
    A_MODE: tl.constexpr,
    B_MODE: tl.constexpr,
    PER_BLOCK: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    DTYPES: tl.constexpr,
    USE_TMA: tl.constexpr,
    TMA_STORE: tl.constexpr,
    NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    CTAS_PER_SM: tl.constexpr = 1,
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    programs = NUM_SMS * CTAS_PER_SM
    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, programs, flatten=True):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        rows_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rows_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        m_ok = rows_m < M
        n_ok = rows_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            if USE_TMA:
                a = a_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
                b = b_desc.load([pid_n * BLOCK_N, ki * BLOCK_K])
            else:
                ks = ki * BLOCK_K + tl.arange(0, BLOCK_K)
                k_ok = (ks < K)[None, :]
                a = tl.load(
                    a_desc + rows_m[:, None] * stride_am + ks[None, :], mask=m_ok[:, None] & k_ok, other=0.0
                )
                b = tl.load(
                    b_desc + rows_n[:, None] * stride_bn + ks[None, :], mask=n_ok[:, None] & k_ok, other=0.0
                )
            if PER_BLOCK and B_MODE == 3 and SCALE_BLOCK % BLOCK_N == 0:
                sa = _load_scales(
                    a_scale_ptr, rows_m, m_ok, ki, stride_as_r, stride_as_k, A_MODE, SCALE_BLOCK
                )
                sb = tl.load(b_scale_ptr + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_bs_r + ki * stride_bs_k)
                acc += tl.dot(a, b.T) * (sa * sb)[:, None]
            elif PER_BLOCK and A_MODE == 3 and SCALE_BLOCK % BLOCK_M == 0:
                sa = tl.load(a_scale_ptr + (pid_m * BLOCK_M // SCALE_BLOCK) * stride_as_r + ki * stride_as_k)
                sb = _load_scales(
                    b_scale_ptr, rows_n, n_ok, ki, stride_bs_r, stride_bs_k, B_MODE, SCALE_BLOCK
                )
                acc += tl.dot(a, b.T) * (sb * sa)[None, :]
            elif PER_BLOCK:
                sa = _load_scales(
                    a_scale_ptr, rows_m, m_ok, ki, stride_as_r, stride_as_k, A_MODE, SCALE_BLOCK
                )
                sb = _load_scales(
                    b_scale_ptr, rows_n, n_ok, ki, stride_bs_r, stride_bs_k, B_MODE, SCALE_BLOCK
                )
                acc += tl.dot(a, b.T) * (sa[:, None] * sb[None, :])
            else:
                # promote to fp32 after every K-block: Hopper's FP8 MMA accumulates with fewer bits
                acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)
        if not PER_BLOCK:
            sa = _load_scales(a_scale_ptr, rows_m, m_ok, 0, stride_as_r, stride_as_k, A_MODE, SCALE_BLOCK)
            sb = _load_scales(b_scale_ptr, rows_n, n_ok, 0, stride_bs_r, stride_bs_k, B_MODE, SCALE_BLOCK)
            acc = acc * (sa[:, None] * sb[None, :])
        if TMA_STORE:
            # through shared memory: no (BLOCK_M, BLOCK_N) tensor of 64-bit addresses in registers
            c_ptr.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(c_ptr.dtype))
        else:
            c_ptrs = c_ptr + rows_m[:, None] * stride_cm + rows_n[None, :] * stride_cn
            c_mask = m_ok[:, None] & n_ok[None, :]
            if ACCUMULATE:
                acc += tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def gemm_fp8_triton(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    a_mode: int,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    b_mode: int,
    out: torch.Tensor,
    scale_block: int = 0,
    accumulate: bool = False,
    use_tma: bool | None = None,
    config: triton.Config | None = None,
) -> torch.Tensor:
    """Write ``(a * a_scale) @ (b * b_scale)^T`` into ``out`` (``+=`` when ``accumulate``).

    ``a`` (M, K) and ``b`` (N, K) are FP8 with unit stride along K. Scales are fp32 tensors: 0-d (mode
    0), (rows, 1) (mode 1), (rows, K / scale_block) (mode 2) or (rows / scale_block, K / scale_block)
    (mode 3), any strides. ``use_tma=None`` reads through TMA descriptors wherever the GPU and the
    operands' alignment allow it. ``config`` bypasses the autotuner with one config (``kernel_configs()``
    or any other with BLOCK_M/N/K and GROUP_M), for tests and tuning sweeps. Without ``config``, a
    1 x 128 / 128 x 128 block-scaled product on Hopper runs the Gluon kernel of ``gemm_fp8_block_sm90``.
    """
    m, n = out.shape
    k = a.shape[1]
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out if accumulate else out.zero_()
    if (
        config is None
        and not accumulate
        and (a_mode, b_mode, scale_block) == (SCALE_BLOCKS, SCALE_BLOCK_2D, 128)
        and sm90_block_kernel_usable is not None
        and sm90_block_kernel_usable(a, a_scale, b, b_scale, out)
        and gemm_fp8_block_sm90(a, a_scale, b, b_scale, out)
    ):
        return out
    sms = num_sms(out.device)
    if use_tma is None:
        use_tma = supports_tma(out.device) and all(
            t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (a, b)
        )
    # accumulating through TMA would stage the loaded and the stored tile in two shared buffers, which
    # leaves no room for the operand pipeline with an fp32 output
    tma_store = (
        use_tma
        and not accumulate
        and out.stride(1) == 1
        and (out.stride(0) * out.element_size()) % 16 == 0
        and out.data_ptr() % 16 == 0
    )

    def strides(scale: torch.Tensor) -> tuple[int, int]:
        return (scale.stride(0), scale.stride(1)) if scale.dim() == 2 else (0, 0)

    args = (
        m,
        n,
        k,
        a.stride(0),
        b.stride(0),
        out.stride(0),
        out.stride(1),
        *strides(a_scale),
        *strides(b_scale),
    )
    flags = dict(A_MODE=a_mode, B_MODE=b_mode, PER_BLOCK=a_mode >= SCALE_BLOCKS or b_mode >= SCALE_BLOCKS)
    flags.update(SCALE_BLOCK=scale_block, ACCUMULATE=accumulate, DTYPES=f"{a.dtype}x{b.dtype}->{out.dtype}")
    flags.update(USE_TMA=use_tma, TMA_STORE=tma_store, NUM_SMS=sms)
    key = (m, n, k, a_mode, b_mode, scale_block, accumulate, flags["DTYPES"], use_tma, tma_store, out.device)
    chosen = _chosen.get(key) if config is None else (config, {**flags, **config.all_kwargs()})
    if chosen is None and not kernel_autotune_enabled():
        config = _usable(_gemm_fp8_kernel.configs, scale_block, out)[0]
        chosen = _chosen[key] = (config, {**flags, **config.all_kwargs()})
    if chosen is None:
        placeholder = [1, 1]
        operands = (
            (TensorDescriptor.from_tensor(a, placeholder), TensorDescriptor.from_tensor(b, placeholder))
            if use_tma
            else (a, b)
        )
        c = TensorDescriptor.from_tensor(out, placeholder) if tma_store else out

        def grid(meta: dict) -> tuple[int]:
            tiles = triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"])
            return (min(sms * meta["CTAS_PER_SM"], tiles),)

        _gemm_fp8_kernel[grid](*operands, c, a_scale, b_scale, *args, **flags)
        best = _gemm_fp8_kernel.best_config
        _chosen[key] = (best, {**flags, **best.all_kwargs()})
        return out
    config, launch_kwargs = chosen
    bm, bn, bk = (config.kwargs[name] for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
    if use_tma:
        operands = (
            TensorDescriptor(a, a.shape, a.stride(), [bm, bk]),
            TensorDescriptor(b, b.shape, b.stride(), [bn, bk]),
        )
    else:
        operands = (a, b)
    c = TensorDescriptor(out, out.shape, out.stride(), [bm, bn]) if tma_store else out
    grid = (min(sms * config.kwargs.get("CTAS_PER_SM", 1), triton.cdiv(m, bm) * triton.cdiv(n, bn)),)
    _gemm_fp8_kernel.fn[grid](*operands, c, a_scale, b_scale, *args, **launch_kwargs)
    return out
