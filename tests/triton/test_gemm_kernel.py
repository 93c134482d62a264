"""The Triton GEMM kernels config by config: data-parallel and stream-K tiles, every layout, accumulation.

The dispatcher tests reach only the config the autotuner (or the untuned heuristic) picks; these run
each config of ``kernel_configs`` directly, so a config that only wins on some GPU shapes is still
checked everywhere.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import triton

from primus_turbo.triton.gemm import gemm_kernel
from primus_turbo.triton.gemm.gemm_kernel import gemm_triton, kernel_configs, tma_compatible
from tests.pytorch.test_utils import DEVICES, get_tolerances

ON_GPU = torch.cuda.is_available()
DEVICE = DEVICES[0]
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
# Small enough for the interpreter; on the GPU, few tiles so that stream-K splits every tile over many
# programs, plus ragged edges on M, N and K.
SHAPES = [(256, 384, 1024), (1000, 584, 520)] if ON_GPU else [(72, 40, 48), (32, 32, 320)]
LAYOUTS = list(itertools.product([False, True], repeat=2))


def _label(config: triton.Config) -> str:
    kw = config.kwargs
    sk = "-sk" if kw.get("STREAM_K") else ""
    return f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']}-s{config.num_stages}-w{config.num_warps}{sk}"


def _operands(m, n, k, trans_a, trans_b):
    a = torch.randn((k, m) if trans_a else (m, k), device=DEVICE, dtype=DTYPE)
    b = torch.randn((n, k) if trans_b else (k, n), device=DEVICE, dtype=DTYPE) * k**-0.5
    reference = (a.t() if trans_a else a).double() @ (b.t() if trans_b else b).double()
    return a, b, reference


def _launchable(config: triton.Config, out_dtype: torch.dtype, accumulate: bool) -> bool:
    if not ON_GPU:
        return True
    budget = gemm_kernel.max_shared_memory(torch.device(DEVICE)) - gemm_kernel._SMEM_SLACK
    return gemm_kernel._smem_bytes(config, DTYPE.itemsize, out_dtype.itemsize, accumulate) <= budget


@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "pointer"])
@pytest.mark.parametrize("trans_a,trans_b", LAYOUTS, ids=["NN", "NT", "TN", "TT"])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_every_config_matches_reference(use_tma, trans_a, trans_b, m, n, k):
    a, b, reference = _operands(m, n, k, trans_a, trans_b)
    if use_tma and not tma_compatible(a, b, torch.empty(m, n, device=DEVICE, dtype=DTYPE)):
        pytest.skip("this device has no TMA")
    tol = get_tolerances(DTYPE)
    for config in kernel_configs(use_tma):
        if not _launchable(config, DTYPE, accumulate=False):
            continue
        out = torch.full((m, n), float("nan"), device=DEVICE, dtype=DTYPE)
        gemm_triton(a, b, trans_a, trans_b, out, use_tma=use_tma, config=config)
        torch.testing.assert_close(
            out.double(), reference, **tol, msg=lambda msg, c=config: f"{_label(c)}: {msg}"
        )


@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "pointer"])
@pytest.mark.parametrize("m,n,k", SHAPES[:1])
def test_every_config_accumulates(use_tma, m, n, k):
    a, b, reference = _operands(m, n, k, False, True)
    if use_tma and not tma_compatible(a, b, torch.empty(m, n, device=DEVICE, dtype=torch.float32)):
        pytest.skip("this device has no TMA")
    start = torch.randn(m, n, device=DEVICE, dtype=torch.float32)
    for config in kernel_configs(use_tma):
        if not _launchable(config, torch.float32, accumulate=True):
            continue
        out = start.clone()
        gemm_triton(a, b, False, True, out, accumulate=True, use_tma=use_tma, config=config)
        torch.testing.assert_close(
            out.double(),
            reference + start.double(),
            **get_tolerances(DTYPE),
            msg=lambda msg, c=config: f"{_label(c)}: {msg}",
        )


def _stream_k_configs() -> list[triton.Config]:
    return [c for c in kernel_configs(True) if c.kwargs["STREAM_K"]]


@pytest.mark.deterministic
@pytest.mark.parametrize("config", _stream_k_configs(), ids=_label)
def test_stream_k_is_bitwise_deterministic(config):
    m, n, k = SHAPES[-1]
    a, b, _ = _operands(m, n, k, False, True)
    if not tma_compatible(a, b, torch.empty(m, n, device=DEVICE, dtype=DTYPE)):
        pytest.skip("this device has no TMA")
    first = gemm_triton(a, b, False, True, torch.empty(m, n, device=DEVICE, dtype=DTYPE), config=config)
    for _ in range(3):
        again = gemm_triton(a, b, False, True, torch.empty(m, n, device=DEVICE, dtype=DTYPE), config=config)
        assert torch.equal(first, again)


def test_untuned_heuristic_switches_to_stream_k_on_a_poor_last_wave():
    configs = kernel_configs(True)
    first = configs[0]
    bm, bn = first.kwargs["BLOCK_M"], first.kwargs["BLOCK_N"]
    sms = 132
    # 132 tiles fill every SM once; 96 leave 36 idle
    assert gemm_kernel._untuned_choice(configs, 12 * bm, 11 * bn, sms) is first
    chosen = gemm_kernel._untuned_choice(configs, 32 * bm, 3 * bn, sms)
    assert chosen.kwargs["STREAM_K"]


def test_chosen_config_is_reused_and_cleared():
    a, b, reference = _operands(64, 48, 32, False, True)
    gemm_kernel.clear_config_cache()
    out = gemm_triton(a, b, False, True, torch.empty(64, 48, device=DEVICE, dtype=DTYPE))
    assert len(gemm_kernel._chosen) == 1
    again = gemm_triton(a, b, False, True, torch.empty(64, 48, device=DEVICE, dtype=DTYPE))
    assert torch.equal(out, again)
    torch.testing.assert_close(out.double(), reference, **get_tolerances(DTYPE))
    gemm_kernel.clear_config_cache()
    assert not gemm_kernel._chosen
