"""Grouped-GEMM offsets: C++ kernel on GPU (when built) or cumsum elsewhere, same result, compiles; the FP8
scale-block layout derived from them (one Triton program, made once per offsets tensor)."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.pytorch.kernels.grouped_gemm.group_offs_impl import compute_group_offs, derived_from
from primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_fp8_impl import group_block_layout, group_blocks
from primus_turbo.triton.grouped_gemm import group_block_layout_triton
from tests.pytorch.test_utils import DEVICES

DEVICE = DEVICES[0]


@pytest.mark.parametrize("num_groups", [0, 1, 9, 300])
def test_compute_group_offs_matches_reference(num_groups):
    lens = torch.randint(0, 1000, (num_groups,), dtype=torch.int64, device=DEVICE)
    offs = compute_group_offs(lens)
    expected = [0]
    for value in lens.tolist():
        expected.append(expected[-1] + value)
    assert offs.dtype == torch.int64 and offs.tolist() == expected


def test_compute_group_offs_compiles_fullgraph():
    torch._dynamo.reset()
    lens = torch.tensor([3, 0, 5, 2], device=DEVICE)
    compiled = torch.compile(compute_group_offs, fullgraph=True, backend="aot_eager")
    assert compiled(lens).tolist() == [0, 3, 3, 8, 10]


@pytest.mark.parametrize("bad", [torch.ones(3, dtype=torch.int32), torch.ones(2, 2, dtype=torch.int64)])
def test_compute_group_offs_rejects_bad_input(bad):
    with pytest.raises(ValueError, match="group_lens must be a 1-D int64 tensor"):
        compute_group_offs(bad)


@pytest.mark.parametrize("num_groups", [1, 7, 40, 300])
@pytest.mark.parametrize("block", [1, 128])
def test_group_block_layout_kernel_matches_torch(num_groups, block):
    """One Triton program gives the scale-block layout the PyTorch expression gives (empty groups, groups
    inside one block, groups across block boundaries)."""
    lens = torch.randint(0, 400, (num_groups,), generator=torch.Generator().manual_seed(num_groups))
    lens[:: max(num_groups // 3, 2)] = 0
    offs = compute_group_offs(lens.to(DEVICE))
    blocks = group_blocks(offs, block)
    expected_ends = torch.cumsum(blocks, 0)
    ends, base = group_block_layout_triton(offs, block)
    assert torch.equal(ends, expected_ends) and torch.equal(base, expected_ends - blocks)


def test_derived_values_are_made_once_per_offsets_version():
    offs = compute_group_offs(torch.tensor([3, 0, 5, 2], device=DEVICE))
    calls = []

    def compute(t):
        calls.append(1)
        return t[1:].clone()

    first = derived_from(offs, "key", compute)
    assert derived_from(offs, "key", compute) is first and len(calls) == 1
    derived_from(offs, "other", compute)
    assert len(calls) == 2
    offs.add_(0)  # a new version: the offsets may have changed
    assert derived_from(offs, "key", compute) is not first and len(calls) == 3
    with torch.inference_mode():
        frozen = compute_group_offs(torch.tensor([1, 2], device=DEVICE))
    derived_from(frozen, "key", compute)
    derived_from(frozen, "key", compute)
    assert len(calls) == 5


def test_group_block_layout_compiles_fullgraph():
    """Traced, the layout is the PyTorch expression (no Triton launch, no cache)."""
    torch._dynamo.reset()
    offs = compute_group_offs(torch.tensor([130, 0, 5, 300], device=DEVICE))
    compiled = torch.compile(lambda o: group_block_layout(o, 128), fullgraph=True, backend="aot_eager")
    ends, base = compiled(offs)
    assert ends.tolist() == [2, 2, 3, 6] and base.tolist() == [0, 2, 2, 3]
