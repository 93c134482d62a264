"""The Hopper Gluon grouped FP8 kernel against the per-group dequantized product: skewed and empty
groups, groups ending inside a row tile (masked stores) and inside a column tile, block scaling, per-expert
and per-column weight scales, E5M2 activations (the HYBRID dgrad), both weight layouts through the launcher.
Runs on sm_90 only."""

from __future__ import annotations

import pytest
import torch

from tests.pytorch.test_utils import compute_snr

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available()
    or torch.version.hip is not None
    or torch.cuda.get_device_capability() != (9, 0),
    reason="the Gluon kernel targets Hopper (sm_90)",
)


def _offsets(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lens], device="cuda").cumsum(0)


def _reference(a, sa_full, w, sb_full, offs):
    """fp32 per-group (a * sa) @ (w[g] * sb[g])^T."""
    a_full = a.float() * sa_full
    out = torch.zeros(a.shape[0], w.shape[1], device="cuda")
    bounds = offs.tolist()
    for g in range(w.shape[0]):
        rows = slice(bounds[g], bounds[g + 1])
        out[rows] = a_full[rows] @ (w[g].float() * sb_full[g]).t()
    return out


@pytest.mark.parametrize(
    "lens,n,k",
    [
        ([128, 128], 128, 128),
        ([0, 300, 1, 0, 77, 512], 256, 384),
        ([1000, 24, 0], 7168 // 4, 1152),
        ([5, 0, 0, 250], 328, 640),
    ],
    ids=str,
)
@pytest.mark.parametrize("a_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scaling", ["blocks", "tensorwise", "rowwise-a", "rowwise"])
def test_matches_dequantized_product(lens, n, k, a_dtype, scaling):
    from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_sm90 import (
        grouped_gemm_fp8_sm90,
        grouped_sm90_usable,
    )

    if scaling == "blocks" and n % 128:
        pytest.skip("128 x 128 weight blocks need N to be a multiple of 128")
    gen = torch.Generator(device="cuda").manual_seed(sum(lens) + n + k)
    tokens, groups = sum(lens), len(lens)
    offs = _offsets(lens)
    a = torch.randn(tokens, k, device="cuda", generator=gen).to(a_dtype)
    w = torch.randn(groups, n, k, device="cuda", generator=gen).to(torch.float8_e4m3fn)
    if scaling == "blocks":
        sa = torch.rand(k // 128, tokens, device="cuda", generator=gen).t() + 0.5
        sb = torch.rand(groups, n // 128, k // 128, device="cuda", generator=gen) + 0.5
        sa_full = sa.repeat_interleave(128, dim=1)
        sb_full = sb.repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)
        a_scale, b_scale = (sa, *sa.stride()), (sb, *sb.stride())
    else:
        sa = torch.rand(tokens, 1, device="cuda", generator=gen) + 0.5
        sa = sa[:1, 0].reshape(()) if scaling == "tensorwise" else sa
        sb = torch.rand(groups, n if scaling == "rowwise" else 1, 1, device="cuda", generator=gen) + 0.5
        sa_full, sb_full = sa, sb
        a_scale = (sa, sa.stride(0) if sa.dim() else 0, 0)
        b_scale = (sb, sb.stride(0), 0, 0)
    columns = None
    if scaling == "rowwise":
        columns, b_scale = (sb, sb.stride(0), sb.stride(1)), (torch.ones((), device="cuda"), 0, 0, 0)
    out = torch.full((tokens, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    assert grouped_sm90_usable(a, w, out.dtype)
    assert grouped_gemm_fp8_sm90(a, a_scale, w, b_scale, offs, out, columns)
    reference = _reference(a, sa_full, w, sb_full, offs)
    assert not out.isnan().any(), "rows left unwritten"
    assert compute_snr(reference, out) >= 40


@pytest.mark.parametrize("trans_b", [True, False])
@pytest.mark.parametrize("scaling", ["blocks", "tensorwise", "rowwise"])
def test_launcher_takes_both_weight_layouts(trans_b, scaling):
    """``grouped_gemm_fp8_triton`` routes to the Gluon kernel for [G, N, K] and N-major [G, K, N]
    weights alike and matches the plain-Triton kernel it replaces."""
    from primus_turbo.triton.grouped_gemm import grouped_gemm_kernel as kernel

    lens = [0, 130, 700, 3]
    groups, n, k = len(lens), 256, 512
    offs = _offsets(lens)
    a = torch.randn(sum(lens), k, device="cuda").to(torch.float8_e5m2)
    w = torch.randn(groups, n, k, device="cuda").to(torch.float8_e4m3fn)
    b = w if trans_b else w.transpose(1, 2)
    block = 128 if scaling == "blocks" else 0
    if block:
        sa = torch.rand(sum(lens), k // block, device="cuda") + 0.5
        sb = torch.rand(groups, n // block, k // block, device="cuda") + 0.5
    elif scaling == "rowwise":
        sa, sb = torch.rand(sum(lens), 1, device="cuda") + 0.5, torch.rand(groups, n, 1, device="cuda") + 0.5
    else:
        sa, sb = torch.tensor(0.7, device="cuda"), torch.rand(groups, 1, 1, device="cuda") + 0.5
    sb = sb if trans_b else sb.transpose(1, 2)
    out = kernel.grouped_gemm_fp8_triton(a, sa, b, sb, offs, trans_b, torch.bfloat16, block)
    gluon, kernel.grouped_gemm_fp8_sm90 = kernel.grouped_gemm_fp8_sm90, None
    try:
        plain = kernel.grouped_gemm_fp8_triton(a, sa, b, sb, offs, trans_b, torch.bfloat16, block)
    finally:
        kernel.grouped_gemm_fp8_sm90 = gluon
    assert compute_snr(plain.float(), out) >= 40


@pytest.mark.parametrize(
    "lens,p,q",
    [
        ([128, 256], 128, 128),
        ([0, 300, 1, 0, 77, 530], 256, 384),
        ([1000, 24, 0, 8], 200, 328),
    ],
    ids=str,
)
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "blocks"])
@pytest.mark.parametrize("accumulate", [False, True], ids=["fresh", "accumulate"])
def test_variable_k_matches_dequantized_product(lens, p, q, scaling, accumulate):
    """Groups that start and end inside a token block (the masked partial blocks), empty groups and
    tiles past P and Q; token-major operands as the group quantizers store them; scales constant along
    the tokens or one row per aligned 128-token block of a group."""
    from primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_fp8_impl import (
        group_block_count,
        group_block_rows,
    )
    from primus_turbo.triton.grouped_gemm.group_quant_kernel import token_major_empty
    from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_sm90 import (
        grouped_gemm_fp8_variable_k_sm90,
        grouped_variable_k_sm90_usable,
    )

    gen = torch.Generator(device="cuda").manual_seed(sum(lens) + p + q)
    tokens, groups = sum(lens), len(lens)
    offs = _offsets(lens)
    lhs_full = torch.randn(tokens, p, device="cuda", generator=gen)
    rhs_full = torch.randn(tokens, q, device="cuda", generator=gen)
    lhs = token_major_empty(lhs_full, torch.float8_e4m3fn).copy_(lhs_full)
    rhs = token_major_empty(rhs_full, torch.float8_e5m2).copy_(rhs_full)
    base, rows_of = None, None
    if scaling == "blocks":
        scale_rows = group_block_count(tokens, groups, 128)
        sl = torch.rand(scale_rows, p, device="cuda", generator=gen) + 0.5
        sr = torch.rand(scale_rows, q, device="cuda", generator=gen) + 0.5
        rows_of, base = group_block_rows(offs, tokens, 128)
    elif scaling == "rowwise":
        sl = torch.rand(groups, p, device="cuda", generator=gen) + 0.5
        sr = torch.rand(groups, q, device="cuda", generator=gen) + 0.5
    else:
        sl, sr = torch.tensor(0.75, device="cuda"), torch.tensor(1.5, device="cuda")
    start = torch.randn(groups, p, q, device="cuda", generator=gen)
    out = start.clone() if accumulate else torch.full_like(start, float("nan")).bfloat16()
    assert grouped_variable_k_sm90_usable(lhs, rhs, out)
    assert grouped_gemm_fp8_variable_k_sm90(lhs, sl, rhs, sr, offs, out, accumulate, base)
    bounds = offs.tolist()
    for g in range(groups):
        rows = slice(bounds[g], bounds[g + 1])
        if scaling == "blocks":
            left = lhs[rows].float() * sl[rows_of[rows]]
            expected = left.t() @ (rhs[rows].float() * sr[rows_of[rows]])
        else:
            scale_l = sl[g][:, None] if sl.dim() else sl
            scale_r = sr[g][None, :] if sr.dim() else sr
            expected = lhs[rows].float().t() @ rhs[rows].float() * scale_l * scale_r
        expected = expected + start[g] if accumulate else expected
        if lens[g] == 0:
            assert torch.equal(out[g].float(), expected), "an empty group gives zeros (or leaves out)"
        else:
            assert compute_snr(expected, out[g]) >= 40, g


def test_variable_k_declines_unaligned_token_rows():
    """Token-major operands whose rows are not 16-byte aligned go to the plain-Triton kernel."""
    from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_sm90 import grouped_variable_k_sm90_usable

    lhs = torch.empty(64, 100, device="cuda", dtype=torch.float8_e4m3fn).t()
    rhs = torch.empty(64, 100, device="cuda", dtype=torch.float8_e4m3fn).t()
    assert not grouped_variable_k_sm90_usable(lhs, rhs, torch.empty(2, 64, 64, device="cuda"))
