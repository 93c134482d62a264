"""Launch the Hopper Gluon grouped forward kernel (bf16 or tensorwise FP8) and its vendor peer once per
routing, between ``cudaProfilerStart`` / ``cudaProfilerStop``, for Nsight Compute to compare what the
hardware does under balanced and skewed group sizes::

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats \\
        python scripts/profile_grouped_kernel.py --kernel fp8 --shape 32x2048x4096x7168 --lens 1024,3072

Every kernel runs once beforehand (compilation, autotuning) outside the profiled range.
"""

from __future__ import annotations

import argparse

import torch

from benchmark.ops.training.bench_grouped_gemm_turbo import Case, group_lens
from benchmark.ops.training.bench_grouped_sm90_configs import fp8_problem, offsets


def launches(kind: str, case: Case, lens: torch.Tensor | None = None) -> list:
    """(ours, peer) callables of one case's forward, with the case's routing or the group sizes ``lens``."""
    lens = group_lens(case, "cuda") if lens is None else lens
    tokens = int(lens.sum())
    out = torch.empty(tokens, case.n, device="cuda", dtype=torch.bfloat16)
    if kind == "bf16":
        from primus_turbo.triton.grouped_gemm.grouped_gemm_sm90 import grouped_gemm_sm90

        offs, ends = offsets(lens)
        a = torch.randn(tokens, case.k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(case.groups, case.n, case.k, device="cuda", dtype=torch.bfloat16)
        return [
            lambda: grouped_gemm_sm90(a, b, offs, True, out),
            lambda: torch._grouped_mm(a, b.transpose(1, 2), offs=ends),
        ]
    from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_sm90 import grouped_gemm_fp8_sm90

    p = fp8_problem(case, lens)
    a_scale, b_scale = (p["sa"], 0, 0), (p["sb"], 1, 0, 0)
    ours = [lambda: grouped_gemm_fp8_sm90(p["a"], a_scale, p["b"], b_scale, p["offs"], out)]
    return ours + ([p["peer"]] if p["peer"] is not None else [])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", choices=("bf16", "fp8"), default="fp8")
    p.add_argument("--shape", default="32x2048x4096x7168", help="G x T x N x K (T tokens per expert)")
    p.add_argument("--routings", default="balanced,skewed")
    p.add_argument(
        "--lens",
        default="",
        help="also launch with these group sizes, cycled over the experts (e.g. 1024,3072: two sizes "
        "alternating, to tell uneven sizes from the skewed routing's particular ones)",
    )
    args = p.parse_args()
    g, t, n, k = (int(v) for v in args.shape.split("x"))
    calls = []
    for routing in args.routings.split(","):
        calls += launches(args.kernel, Case("profile", "fc", 0, g, t, n, k, routing))
    if args.lens:
        pattern = [int(v) for v in args.lens.split(",")]
        lens = torch.tensor([pattern[i % len(pattern)] for i in range(g)], device="cuda")
        calls += launches(args.kernel, Case("profile", "fc", 0, g, t, n, k, "given"), lens)
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
