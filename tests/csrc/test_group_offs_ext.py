"""Tests of the C++/CUDA op primus_turbo_cpp_extension::grouped_gemm_compute_offs (needs a GPU and _C)."""

import pytest
import torch

from tests.csrc import extension_marks

pytestmark = extension_marks(cuda_only=False)


def _op():
    return torch.ops.primus_turbo_cpp_extension.grouped_gemm_compute_offs


def _reference(group_lens):
    zero = torch.zeros(1, dtype=torch.int64, device=group_lens.device)
    return torch.cat([zero, torch.cumsum(group_lens, 0)])


def _random_lens(num_groups, device="cuda", seed=0):
    gen = torch.Generator().manual_seed(seed + num_groups)
    lens = torch.randint(0, 4097, (num_groups,), generator=gen, dtype=torch.int64)
    lens[::5] = 0  # empty groups must be handled too
    return lens.to(device)


@pytest.mark.parametrize("num_groups", [0, 1, 7, 128, 1000, 4097])
def test_matches_cumsum(num_groups):
    lens = _random_lens(num_groups)
    offs = _op()(lens)
    assert offs.dtype == torch.int64 and offs.device == lens.device and offs.shape == (num_groups + 1,)
    torch.testing.assert_close(offs, _reference(lens), rtol=0, atol=0)


def test_cpu_impl_matches_cuda():
    lens = _random_lens(1000)
    torch.testing.assert_close(_op()(lens.cpu()), _op()(lens).cpu(), rtol=0, atol=0)


@pytest.mark.parametrize("num_groups", [0, 5, 300])
def test_opcheck(num_groups):
    torch.library.opcheck(_op(), (_random_lens(num_groups),))


@pytest.mark.parametrize("num_groups", [0, 3, 4097])
def test_meta_shape(num_groups):
    offs = _op()(torch.empty(num_groups, dtype=torch.int64, device="meta"))
    assert offs.device.type == "meta" and offs.dtype == torch.int64 and offs.shape == (num_groups + 1,)


@pytest.mark.parametrize(
    "make_lens, message",
    [
        (lambda: torch.ones(4, dtype=torch.int32, device="cuda"), "int64"),
        (lambda: torch.ones(2, 3, dtype=torch.int64, device="cuda"), "1-D"),
        (lambda: torch.ones(8, dtype=torch.int64, device="cuda")[::2], "contiguous"),
    ],
    ids=["int32", "2d", "strided"],
)
def test_bad_input_raises(make_lens, message):
    with pytest.raises(RuntimeError, match=message):
        _op()(make_lens())
