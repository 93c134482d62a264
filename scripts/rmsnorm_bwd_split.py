"""Where the RMSNorm backward's time goes at 4096 tokens: the whole op, its main kernel alone, the dgamma
sum alone, the sum launched with programmatic dependent launch, and a cooperative grid-barrier variant."""

import functools
import sys

import torch
import triton
import triton.language as tl

from benchmark.ops.training.bench_utils import (
    copy_ms,
    cycling,
    rotation_sets,
    time_interleaved,
    timing_stream,
)
from primus_turbo.triton.normalization.rmsnorm_kernel import (
    _dgamma_finish_kernel,
    _pipeline_stages,
    rmsnorm_bwd_triton,
)
from primus_turbo.triton.utils.device_info import num_sms


@triton.jit
def _bwd_kernel(
    dy_ptr,
    s_ptr,
    gamma_ptr,
    rstd_ptr,
    dx_ptr,
    partial_ptr,
    dgamma_ptr,
    sync_ptr,
    n_rows,
    H,
    stride_dy,
    stride_s,
    stride_dx,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    SLICE: tl.constexpr,
):
    # MODE 0: plain (partials); 1: + gdc_launch_dependents at start; 2: fused grid barrier + reduce
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    if MODE == 1:
        tl.extra.cuda.gdc_launch_dependents()
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < H
    w = tl.load(gamma_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dgamma = tl.zeros([BLOCK_H], dtype=tl.float32)
    for first in tl.range(pid * ROWS, n_rows, programs * ROWS, num_stages=NUM_STAGES):
        rows = (first + tl.arange(0, ROWS)).to(tl.int64)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + rows[:, None] * stride_s + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        s_hat = s * rstd[:, None]
        wdy = w[None, :] * dy
        mean = tl.sum(s_hat * wdy, axis=1) / H
        dx = rstd[:, None] * (wdy - s_hat * mean[:, None])
        tl.store(
            dx_ptr + rows[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask
        )
        dgamma += tl.sum(dy * s_hat, axis=0)
    tl.store(partial_ptr + pid * BLOCK_H + cols, dgamma, mask=col_ok)
    if MODE == 2:
        tl.debug_barrier()
        gen = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
        arrived = tl.atomic_add(sync_ptr, 1, sem="acq_rel")
        if arrived == programs - 1:
            tl.atomic_xchg(sync_ptr, 0, sem="relaxed")
            tl.atomic_add(sync_ptr + 1, 1, sem="release")
        else:
            while tl.atomic_add(sync_ptr + 1, 0, sem="acquire") == gen:
                pass
        tl.debug_barrier()
        c = pid * SLICE + tl.arange(0, SLICE)
        p = tl.arange(0, BLOCK_P)
        m = (p < programs)[:, None] & (c < H)[None, :]
        part = tl.load(
            partial_ptr + p[:, None] * BLOCK_H + c[None, :], mask=m, other=0.0, cache_modifier=".cg"
        )
        tl.store(dgamma_ptr + c, tl.sum(part, axis=0).to(dgamma_ptr.dtype.element_ty), mask=c < H)


@triton.jit
def _finish_pdl(partial_ptr, dgamma_ptr, programs, H, stride, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr):
    tl.extra.cuda.gdc_wait()
    cols = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    rows = tl.arange(0, BLOCK_P)
    mask = (rows < programs)[:, None] & (cols < H)[None, :]
    partial = tl.load(partial_ptr + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0)
    tl.store(dgamma_ptr + cols, tl.sum(partial, axis=0).to(dgamma_ptr.dtype.element_ty), mask=cols < H)


SYNC = {}


def variant(mode, dy, s, gamma, rstd, finish=True):
    n_rows, hidden = s.shape
    dx = torch.empty_like(s)
    block_h = triton.next_power_of_2(hidden)
    rpp = max(1, min(16, 8192 // block_h))
    warps = 8 if block_h * rpp <= 8192 else 16
    stages = _pipeline_stages(s.device, rpp * block_h * 4)
    programs = min(triton.cdiv(n_rows, rpp), num_sms(s.device))
    partial = torch.empty((programs, block_h), dtype=torch.float32, device=s.device)
    dgamma = torch.empty(hidden, dtype=gamma.dtype, device=s.device)
    sync = SYNC.setdefault(s.device, torch.zeros(2, dtype=torch.int32, device=s.device))
    block_p = triton.next_power_of_2(programs)
    slice_ = triton.next_power_of_2(triton.cdiv(hidden, programs))
    extra = {"launch_cooperative_grid": True} if mode == 2 else {}
    _bwd_kernel[(programs,)](
        dy,
        s,
        gamma,
        rstd,
        dx,
        partial,
        dgamma,
        sync,
        n_rows,
        hidden,
        dy.stride(0),
        s.stride(0),
        dx.stride(0),
        ROWS=rpp,
        BLOCK_H=block_h,
        NUM_STAGES=stages,
        MODE=mode,
        BLOCK_P=block_p,
        SLICE=slice_,
        num_warps=warps,
        **extra,
    )
    if mode == 2 or not finish:
        return dx, dgamma
    finish_h = max(16, 16384 // block_p)
    grid = (triton.cdiv(hidden, finish_h),)
    if mode == 1:
        _finish_pdl[grid](
            partial,
            dgamma,
            programs,
            hidden,
            partial.stride(0),
            BLOCK_P=block_p,
            BLOCK_H=finish_h,
            num_warps=8,
            launch_pdl=True,
        )
    else:
        _dgamma_finish_kernel[grid](
            partial,
            dgamma,
            programs,
            hidden,
            partial.stride(0),
            BLOCK_P=block_p,
            BLOCK_H=finish_h,
            num_warps=8,
        )
    return dx, dgamma


def finish_only(partial, dgamma, programs, hidden):
    block_p = triton.next_power_of_2(programs)
    finish_h = max(16, 16384 // block_p)
    _dgamma_finish_kernel[(triton.cdiv(hidden, finish_h),)](
        partial, dgamma, programs, hidden, partial.stride(0), BLOCK_P=block_p, BLOCK_H=finish_h, num_warps=8
    )


def main():
    dev = "cuda"
    print("sms", num_sms(torch.device(dev)))
    for tokens, hidden in [(4096, 4096), (4096, 7168), (4096, 8192), (16384, 4096)]:
        gamma = torch.randn(hidden, device=dev, dtype=torch.bfloat16)
        nbytes = 3 * tokens * hidden * 2
        sets = []
        for _ in range(rotation_sets(nbytes, True)):
            sets.append(
                (
                    torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16),
                    torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16),
                    torch.rand(tokens, device=dev) + 0.5,
                )
            )
        dy, s, r = sets[0]
        ref_dx, ref_dg = rmsnorm_bwd_triton(dy, s, gamma, r, False)
        ok = []
        for mode in (0, 1, 2):
            dx, dg = variant(mode, dy, s, gamma, r)
            torch.cuda.synchronize()
            ok.append((torch.equal(dx, ref_dx), (dg.float() - ref_dg.float()).abs().max().item()))
        # determinism of the fused variant
        dgs = [variant(2, dy, s, gamma, r)[1].clone() for _ in range(5)]
        det = all(torch.equal(dgs[0], d) for d in dgs)
        block_h = triton.next_power_of_2(hidden)
        programs = min(triton.cdiv(tokens, max(1, min(16, 8192 // block_h))), num_sms(torch.device(dev)))
        partial = torch.randn(programs, block_h, device=dev)
        dgbuf = torch.empty(hidden, device=dev, dtype=torch.bfloat16)
        calls = [
            cycling([functools.partial(rmsnorm_bwd_triton, dy, s, gamma, r, False) for dy, s, r in sets]),
            cycling([functools.partial(variant, 0, dy, s, gamma, r, False) for dy, s, r in sets]),
            functools.partial(finish_only, partial, dgbuf, programs, hidden),
            cycling([functools.partial(variant, 1, dy, s, gamma, r) for dy, s, r in sets]),
            cycling([functools.partial(variant, 2, dy, s, gamma, r) for dy, s, r in sets]),
        ]
        with timing_stream(True):
            times = time_interleaved(calls, None, dev, True)
        copy = copy_ms(nbytes, dev, True)
        names = ["full", "main only", "finish only", "pdl finish", "fused coop"]
        print(f"{tokens}x{hidden} copy {copy * 1e3:.1f} us  ok={ok} det={det}")
        for n, t in zip(names, times, strict=True):
            print(f"   {n:12s} {t * 1e3:7.1f} us  of copy {copy / t:.3f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
