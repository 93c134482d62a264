"""Time tile choices of the Triton flash-attention kernels against SDPA with the cuDNN backend.

A tuning aid like ``bench_norm_act_configs``: for causal bf16 attention at the config models' head shapes,
every forward ``Launch`` candidate (bf16, and FP8 on inputs quantized once, ``fwd_fp8``) runs next to
SDPA-cuDNN's bf16 forward, and every dK/dV and dQ candidate (the other kernel at its default) next to
SDPA-cuDNN's backward (its forward + backward less its forward), interleaved call by call with CUDA events
(L2 flushed). Each candidate's outputs are checked against the default launch's.

Example::

    python -m benchmark.ops.training.bench_attention_configs --seqs 4096,8192 -o attention_configs.csv
"""

from __future__ import annotations

import argparse
import functools
import logging

import torch
from tabulate import tabulate
from triton.runtime.errors import OutOfResources

from benchmark.ops.training.bench_attention_turbo import causal_flops, sdpa_call
from benchmark.ops.training.bench_utils import platform_name, time_interleaved, write_csv

LOG = logging.getLogger("bench_attention_configs")

# (Hq, Hkv, Dqk, Dv): Llama-3-8B / Mixtral-8x7B and DeepSeek-V3's MLA
SHAPES = [(32, 8, 128, 128), (128, 128, 192, 128)]
# Launch(block, step, warps, stages) candidates per kernel; None is the launcher's default
FWD = {
    128: [None, (64, 64, 4, 3), (128, 64, 8, 2), (128, 128, 8, 3), (128, 64, 4, 2)],
    192: [None, (128, 32, 8, 4), (64, 64, 4, 3), (128, 128, 8, 2), (128, 64, 8, 2)],
}
FWD_FP8 = {
    128: [None, (64, 128, 4, 3), (64, 64, 4, 4), (64, 64, 4, 2), (64, 128, 4, 2), (128, 128, 8, 3)],
    192: [None, (64, 32, 4, 3), (64, 64, 4, 4), (64, 128, 4, 2), (128, 64, 8, 3)],
}
DKDV = {
    128: [None, (64, 32, 4, 2), (64, 32, 4, 4), (64, 64, 4, 3), (64, 16, 4, 3), (128, 32, 8, 2)],
    192: [None, (64, 32, 4, 3), (64, 64, 4, 2), (64, 32, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3)],
}
DQ = {
    128: [None, (128, 128, 8, 2), (128, 64, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3)],
    192: [None, (128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3), (128, 32, 4, 2)],
}


def _rows(seq: int, h_q: int, h_kv: int, d_qk: int, d_v: int, only: set[str]) -> list[dict]:
    from primus_turbo.triton.attention import quantize_attention_blocks_triton
    from primus_turbo.triton.attention.flash_attn_kernel import (
        Launch,
        default_fp8_launch,
        default_launches,
        flash_attn_bwd_triton,
        flash_attn_fwd_triton,
    )

    gen = torch.Generator().manual_seed(0)

    def make(h, d):
        return torch.randn(1, seq, h, d, generator=gen, dtype=torch.bfloat16).cuda()

    q, k, v, do = make(h_q, d_qk), make(h_kv, d_qk), make(h_kv, d_v), make(h_q, d_v)
    scale = d_qk**-0.5
    out = torch.empty_like(do)
    lse = flash_attn_fwd_triton(q, k, v, None, scale, -1, 0, out)
    flops = causal_flops(seq, h_q, d_qk, d_v, 1)
    default_fwd, default_dkdv, default_dq = default_launches(d_qk, d_v)
    wide = 192 if max(d_qk, d_v) > 128 else 128

    def forward(launch):
        o = torch.empty_like(out)
        flash_attn_fwd_triton(q, k, v, None, scale, -1, 0, o, launch=launch)
        return o

    fp8 = [quantize_attention_blocks_triton(t, torch.float8_e4m3fn, i == 2) for i, t in enumerate((q, k, v))]

    def forward_fp8(launch):
        o = torch.empty_like(out)
        flash_attn_fwd_triton(
            *(t for t, _ in fp8), None, scale, -1, 0, o, None, tuple(s for _, s in fp8), launch
        )
        return o

    def backward(launches):
        grads = [torch.empty_like(t) for t in (q, k, v)]
        flash_attn_bwd_triton(do, q, k, v, out, lse, scale, -1, 0, *grads, launch=launches)
        return grads

    cudnn = sdpa_call("CUDNN_ATTENTION", *(t.detach().requires_grad_() for t in (q, k, v)))
    grad = do

    def cudnn_step():
        cudnn().backward(grad)

    rows = []
    kernels = [
        ("fwd", FWD[wide], default_fwd, lambda c: Launch(*c), forward, 2.0),
        ("fwd_fp8", FWD_FP8[wide], default_fp8_launch(), lambda c: Launch(*c), forward_fp8, 2.0),
        ("dkdv", DKDV[wide], default_dkdv, lambda c: (Launch(*c), default_dq), backward, 5.0),
        ("dq", DQ[wide], default_dq, lambda c: (default_dkdv, Launch(*c)), backward, 5.0),
    ]
    with torch.no_grad():
        (cudnn_fwd,) = time_interleaved([cudnn], None, "cuda")
    (cudnn_step_ms,) = time_interleaved([cudnn_step], None, "cuda")
    for kernel, candidates, default, launch_of, run, matmuls in (k for k in kernels if k[0] in only):
        reference = run(None)
        runnable, launches, same = [], [], []
        for candidate in candidates:
            launch = launch_of(candidate) if candidate else None
            try:
                result = run(launch)
            except OutOfResources as exc:  # e.g. a tile whose stages do not fit in shared memory
                LOG.info("%s %s: %s", kernel, candidate, exc)
                continue
            pairs = zip(result, reference, strict=True) if kernel.startswith("d") else [(result, reference)]
            same.append(all(torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2) for a, b in pairs))
            runnable.append(candidate)
            launches.append(launch)
        times = time_interleaved([functools.partial(run, launch) for launch in launches], None, "cuda")
        peer = cudnn_step_ms - cudnn_fwd if kernel.startswith("d") else cudnn_fwd
        for candidate, ms, ok in zip(runnable, times, same, strict=True):
            label = str(tuple(candidate or default)) + ("" if candidate else " default")
            row = {"Kernel": kernel, "Hq": h_q, "Hkv": h_kv, "Dqk": d_qk, "Dv": d_v, "Seq": seq}
            row.update({"Launch (block, step, warps, stages)": label, "ms": ms})
            # forward: QK^T and PV; backward: QK^T, dP, dV, dK, dQ (either kernel's time is the whole pass)
            row.update({"TFLOPS": matmuls / 2 * flops / ms / 1e9, "cuDNN ms": peer, "vs cuDNN": peer / ms})
            row.update({"Same as default": ok, "Platform": platform_name("cuda")})
            rows.append(row)
            LOG.info("%s", row)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="4096,8192", help="comma-separated sequence lengths")
    p.add_argument("--kernels", default="fwd,fwd_fp8,dkdv,dq", help="comma-separated kernels to sweep")
    p.add_argument("--dqk", default="128,192", help="comma-separated q/k head dims of SHAPES to sweep")
    p.add_argument("-o", "--output", default="attention_configs.csv")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    rows = []
    dims = {int(d) for d in args.dqk.split(",")}
    for shape in (s for s in SHAPES if s[2] in dims):
        for seq in (int(s) for s in args.seqs.split(",")):
            rows += _rows(seq, *shape, set(args.kernels.split(",")))
    columns = ["Kernel", "Hq", "Dqk", "Seq", "Launch (block, step, warps, stages)", "ms", "TFLOPS"]
    columns += ["vs cuDNN", "Same as default"]
    print(tabulate([[r[c] for c in columns] for r in rows], headers=columns, floatfmt=".3f"))
    write_csv(args.output, rows)


if __name__ == "__main__":
    main()
