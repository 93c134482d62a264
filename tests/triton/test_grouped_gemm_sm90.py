"""The Hopper Gluon bf16/fp16 grouped kernels against the per-group fp32 product: skewed and empty
groups, groups ending inside a row tile or a token block, tiles past N / P / Q, both weight layouts, fresh
and accumulating wgrad. Runs on sm_90 only."""

from __future__ import annotations

import pytest
import torch

from tests.pytorch.test_utils import compute_snr

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available()
    or torch.version.hip is not None
    or torch.cuda.get_device_capability() != (9, 0),
    reason="the Gluon kernels target Hopper (sm_90)",
)

CASES = [([128, 128], 128, 128), ([0, 300, 1, 0, 77, 530], 256, 384), ([1000, 24, 0, 8], 200, 328)]


def _offsets(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lens], device="cuda").cumsum(0)


@pytest.mark.parametrize("lens,n,k", CASES, ids=str)
@pytest.mark.parametrize("trans_b", [True, False], ids=["NK", "KN"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gemm_matches_fp32_product(lens, n, k, trans_b, dtype):
    from primus_turbo.triton.grouped_gemm.grouped_gemm_sm90 import (
        Sm90Tiles,
        grouped_gemm_sm90,
        grouped_sm90_16bit_usable,
    )

    k = k if trans_b else -(-k // 64) * 64  # N-major weights take whole K-blocks
    gen = torch.Generator(device="cuda").manual_seed(sum(lens) + n + k)
    offs = _offsets(lens)
    a = torch.randn(sum(lens), k, device="cuda", generator=gen).to(dtype)
    w = torch.randn(len(lens), n, k, device="cuda", generator=gen).to(dtype)
    b = w if trans_b else w.transpose(1, 2).contiguous()
    out = torch.full((sum(lens), n), float("nan"), device="cuda", dtype=dtype)
    assert grouped_sm90_16bit_usable(a, b, trans_b, Sm90Tiles())
    assert grouped_gemm_sm90(a, b, offs, trans_b, out)
    bounds = offs.tolist()
    for g in range(len(lens)):
        rows = slice(bounds[g], bounds[g + 1])
        if lens[g]:
            assert compute_snr(a[rows].float() @ w[g].float().t(), out[rows]) >= 45, g


@pytest.mark.parametrize("lens,p,q", CASES, ids=str)
@pytest.mark.parametrize("accumulate", [False, True], ids=["fresh", "accumulate"])
def test_variable_k_matches_fp32_product(lens, p, q, accumulate):
    from primus_turbo.triton.grouped_gemm.grouped_gemm_sm90 import (
        grouped_gemm_variable_k_sm90,
        grouped_variable_k_sm90_16bit_usable,
    )

    gen = torch.Generator(device="cuda").manual_seed(sum(lens) + p + q)
    offs = _offsets(lens)
    lhs = torch.randn(sum(lens), p, device="cuda", generator=gen).bfloat16()
    rhs = torch.randn(sum(lens), q, device="cuda", generator=gen).bfloat16()
    start = torch.randn(len(lens), p, q, device="cuda", generator=gen)
    out = start.clone() if accumulate else torch.full_like(start, float("nan")).bfloat16()
    assert grouped_variable_k_sm90_16bit_usable(lhs, rhs, out)
    assert grouped_gemm_variable_k_sm90(lhs, rhs, offs, out, accumulate)
    bounds = offs.tolist()
    for g in range(len(lens)):
        rows = slice(bounds[g], bounds[g + 1])
        expected = lhs[rows].float().t() @ rhs[rows].float() + (start[g] if accumulate else 0)
        if lens[g] == 0:
            assert torch.equal(out[g].float(), expected.to(out.dtype).float()), g
        else:
            assert compute_snr(expected, out[g]) >= 45, g


def test_launchers_route_to_gluon_and_match_the_plain_kernels():
    """``grouped_gemm_triton`` and ``grouped_gemm_variable_k_triton`` take the Gluon kernels on Hopper and
    agree with the plain-Triton kernels they replace."""
    from primus_turbo.triton.grouped_gemm import grouped_gemm_kernel as kernel

    lens = [0, 130, 700, 3]
    offs = _offsets(lens)
    a = torch.randn(sum(lens), 512, device="cuda").bfloat16()
    w = torch.randn(len(lens), 256, 512, device="cuda").bfloat16()
    dy = torch.randn(sum(lens), 256, device="cuda").bfloat16()

    def run():
        wgrad = torch.zeros(len(lens), 256, 512, device="cuda")
        return kernel.grouped_gemm_triton(a, w, offs, True), kernel.grouped_gemm_variable_k_triton(
            dy, a, offs, wgrad, accumulate=True
        )

    gluon = run()
    saved = kernel.grouped_gemm_sm90, kernel.grouped_gemm_variable_k_sm90
    kernel.grouped_gemm_sm90 = kernel.grouped_gemm_variable_k_sm90 = None
    try:
        plain = run()
    finally:
        kernel.grouped_gemm_sm90, kernel.grouped_gemm_variable_k_sm90 = saved
    for x, y in zip(gluon, plain, strict=True):
        assert compute_snr(y.float(), x) >= 45
