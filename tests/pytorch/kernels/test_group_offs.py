"""Grouped-GEMM offsets: C++ kernel on GPU (when built) or cumsum elsewhere, same result, compiles."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.pytorch.kernels.grouped_gemm.group_offs_impl import compute_group_offs
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
