"""megatron-core GPT models through the test harness (gloo on the CPU, NCCL on GPUs): local-spec dense GPT
at TP1 and TP2 (with and without sequence parallelism) matching the TP1 loss and grads, MoE with EP=2 over
the alltoall and allgather dispatchers (equal results from equal weights), and the CPU shim's undo."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from primus_turbo.integrations.megatron import cpu as megatron_cpu
from tests.integrations.megatron.megatron_harness import (
    build_gpt,
    destroy_megatron,
    init_megatron,
    local_process_group,
    loss_and_grads,
    spawn,
    synthetic_batch,
    tiny_config,
    tiny_moe_config,
)

pytest.importorskip("megatron.core")

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402

# bf16 model, fp32 loss: bf16 tolerances
RTOL = ATOL = 1e-2


def _assert_finite(loss: torch.Tensor, grads: dict[str, torch.Tensor]) -> None:
    assert loss.ndim == 0 and math.isfinite(loss.item())
    assert grads, "no parameter received a gradient"
    for name, grad in grads.items():
        assert torch.isfinite(grad).all(), name


def _dense_step(tp: int, sequence_parallel: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    init_megatron(tp=tp)
    try:
        config = tiny_config(sequence_parallel=sequence_parallel)
        model = build_gpt(config, get_gpt_layer_local_spec(normalization="RMSNorm"))
        loss, grads = loss_and_grads(model, synthetic_batch(seed=0))
    finally:
        destroy_megatron()
    _assert_finite(loss, grads)
    return loss, grads


def _tp_rows(name: str, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """This rank's shard of a TP1 grad, for the parameters the local spec splits (row dims as Megatron)."""
    if "linear_qkv" in name or "word_embeddings" in name or "output_layer" in name:
        return full.chunk(tp, dim=0)[rank]
    if "linear_fc1" in name:  # [gate; up] stacked: each rank holds its slice of both halves
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])
    if "linear_proj" in name or "linear_fc2" in name:
        return full.chunk(tp, dim=1)[rank]
    return full


def _dense_tp_body(rank: int, world: int, sequence_parallel: bool) -> None:
    loss, grads = _dense_step(tp=world, sequence_parallel=sequence_parallel)
    # the same seed gives the same full weights at TP1 (CPU initialization splits one master weight)
    ref_loss, ref_grads = _dense_step(tp=1)
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, _tp_rows(name, ref_grads[name], rank, world), rtol=RTOL, atol=ATOL)


def _world1_body(rank: int, world: int) -> None:
    _dense_step(tp=1)


def _moe_step(dispatcher: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    init_megatron(ep=2)
    try:
        config = tiny_moe_config(moe_token_dispatcher_type=dispatcher)
        spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, normalization="RMSNorm")
        model = build_gpt(config, spec)
        loss, grads = loss_and_grads(model, synthetic_batch(seed=1 + dist.get_rank()))
    finally:
        destroy_megatron()
    _assert_finite(loss, grads)
    assert any("experts" in name for name in grads) and any("router" in name for name in grads)
    return loss, grads


def _moe_ep2_body(rank: int, world: int) -> None:
    loss, grads = _moe_step("alltoall")
    other_loss, other_grads = _moe_step("allgather")
    torch.testing.assert_close(loss, other_loss, rtol=RTOL, atol=ATOL)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, other_grads[name], rtol=RTOL, atol=ATOL)


@pytest.mark.multigpu
def test_dense_world1_spawned():
    spawn(1, _world1_body)


@pytest.mark.multigpu
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_dense_tp2_matches_tp1(sequence_parallel):
    spawn(2, _dense_tp_body, sequence_parallel)


@pytest.mark.multigpu
def test_moe_ep2_alltoall_matches_allgather():
    spawn(2, _moe_ep2_body)


def test_dense_world1_in_process():
    """One rank in the test process itself; leaves no process group, patch or RNG change behind."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    cpu_rng = torch.get_rng_state()
    with local_process_group():
        _dense_step(tp=1)
    assert not dist.is_initialized() and not megatron_cpu._active
    assert torch.equal(torch.get_rng_state(), cpu_rng)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU shim's RNG tracker (bitwise)")
def test_dropout_rng_tracker_and_recompute():
    """Dropout draws from the tracker's named states: seeded runs repeat exactly, and activation recompute
    (full and selective) replays the same masks, so grads equal the run without recompute."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    variants = [
        {},
        {},
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
        {"recompute_granularity": "selective"},
        {"attention_dropout": 0.0, "hidden_dropout": 0.0},
    ]
    results = []
    with local_process_group():
        for overrides in variants:
            init_megatron()
            try:
                config = tiny_config(**{"attention_dropout": 0.3, "hidden_dropout": 0.3, **overrides})
                model = build_gpt(config, get_gpt_layer_local_spec(normalization="RMSNorm"))
                results.append(loss_and_grads(model, synthetic_batch(seed=0)))
            finally:
                destroy_megatron()
    (loss, grads), *others, (plain_loss, _) = results
    _assert_finite(loss, grads)
    for other_loss, other_grads in others:
        assert torch.equal(other_loss, loss)
        for name, grad in grads.items():
            assert torch.equal(other_grads[name], grad), name
    assert not torch.equal(plain_loss, loss)  # dropout did draw


def _patched_attributes() -> dict[str, object]:
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mc_random
    from megatron.core.transformer import torch_norm
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    alltoall = vars(token_dispatcher.MoEAlltoAllTokenDispatcher)
    return {
        "current_device": torch.cuda.current_device,
        "tracker_class": mc_random.CudaRNGStatesTracker,
        "tracker": mc_random._CUDA_RNG_STATE_TRACKER,
        "get_rng": mc_random._get_cuda_rng_state,
        "set_rng": mc_random._set_cuda_rng_state,
        "causal_mask": fused_softmax.get_default_causal_mask,
        "norm_new": vars(torch_norm.WrappedTorchNorm)["__new__"],
        "te_general_gemm": vars(moe_utils).get("te_general_gemm", "absent"),
        "dtoh_stream": alltoall.get("cuda_dtoh_stream"),
        "dtoh_sync": alltoall["_maybe_dtoh_and_synchronize"],
    }


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is a no-op with a GPU")
def test_undo_restores_patched_attributes():
    before = _patched_attributes()
    undo = megatron_cpu.enable_megatron_on_cpu()
    try:
        during = _patched_attributes()
        changed = {"current_device", "tracker_class", "get_rng", "set_rng", "causal_mask", "norm_new"}
        changed |= {"dtoh_stream", "dtoh_sync"}
        for key in changed:
            assert during[key] is not before[key], key
        assert torch.cuda.current_device() == torch.device("cpu")
        assert megatron_cpu.enable_megatron_on_cpu() is not undo  # already on: a no-op undo
        with megatron_cpu.megatron_on_cpu():
            pass
        assert _patched_attributes()["current_device"] is during["current_device"]  # nested exit kept it
    finally:
        undo()
    after = _patched_attributes()
    for key, value in before.items():
        assert after[key] is value, key
    undo()  # a second undo does nothing
    with megatron_cpu.megatron_on_cpu():
        assert torch.cuda.current_device() == torch.device("cpu")
    assert _patched_attributes() == before


def test_noop_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = _patched_attributes()
    undo = megatron_cpu.enable_megatron_on_cpu()
    undo()
    assert _patched_attributes() == before
