"""Whole GPT models: the Turbo spec against Megatron's local spec from identical weights (loss and every
gradient), dense and MoE, TP 1 and 2 (with sequence parallelism), EP 2; Transformer-Engine state-dict
names; the in-place patch (what it binds, idempotence, undo) and the example run at tiny size."""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from primus_turbo.integrations.megatron import (
    PrimusTurboConfig,
    apply_primus_turbo_to_megatron,
    get_gpt_decoder_block_turbo_spec,
    remove_primus_turbo_from_megatron,
)
from primus_turbo.integrations.megatron.state_dict import local_to_te_state_dict, te_name
from tests.integrations.megatron.megatron_harness import (
    MOE_OVERRIDES,
    build_gpt,
    destroy_megatron,
    init_megatron,
    local_process_group,
    loss_and_grads,
    spawn,
    synthetic_batch,
    tiny_config,
)

ROOT = Path(__file__).resolve().parents[3]


def _pair(moe: bool, async_tp: bool = False, **overrides):
    """(local-spec model, Turbo model with the local model's weights); MoE models go through the patch,
    which also puts in the Turbo dispatcher."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    fields = {**(MOE_OVERRIDES if moe else {}), **overrides}
    config = tiny_config(**fields)
    local = build_gpt(
        config, get_gpt_layer_local_spec(num_experts=config.num_moe_experts, normalization="RMSNorm")
    )
    turbo_config = tiny_config(**fields, moe_grouped_gemm=moe)
    switch = PrimusTurboConfig(enable_primus_turbo=True, use_turbo_async_tp=async_tp or None)
    patch = apply_primus_turbo_to_megatron(switch, turbo_config)
    try:
        turbo = build_gpt(turbo_config, get_gpt_decoder_block_turbo_spec(turbo_config))
    finally:
        patch.undo()
    inner_local, inner_turbo = (
        local.module if hasattr(local, "module") else local,
        getattr(turbo, "module", turbo),
    )
    state = local_to_te_state_dict(inner_local.state_dict(), inner_turbo.state_dict().keys())
    inner_turbo.load_state_dict(state, strict=False)
    return local, turbo


def _compare(local, turbo, rtol: float) -> None:
    """Loss within ``rtol`` and each gradient within ``rtol`` in relative (Frobenius) norm."""
    batch = synthetic_batch(seed=7)
    loss_l, grads_l = loss_and_grads(local, batch)
    loss_t, grads_t = loss_and_grads(turbo, batch)
    torch.testing.assert_close(loss_t, loss_l, rtol=rtol, atol=0)
    targets = set(grads_t)
    assert {te_name(k, targets) for k in grads_l} == targets
    for name, grad in grads_l.items():
        other = grads_t[te_name(name, targets)]
        error = (other - grad).norm() / grad.norm().clamp_min(1e-12)
        assert error < rtol, f"{name}: relative gradient error {error:.2e}"


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_turbo_matches_local_fp32(moe):
    with local_process_group():
        init_megatron()
        try:
            _compare(*_pair(moe, bf16=False, params_dtype=torch.float32), rtol=1e-4)
        finally:
            destroy_megatron()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_turbo_bf16_is_as_close_to_fp32_as_local_bf16(moe):
    """bf16 rounds differently along each path; Turbo's gradients must be no further from the fp32 model's
    than the local spec's own bf16 gradients are (within 2x, or 1e-2)."""
    with local_process_group():
        init_megatron()
        try:
            local, turbo = _pair(moe)
            reference, _ = _pair(moe, bf16=False, params_dtype=torch.float32)
            state = local.module.state_dict()
            reference.load_state_dict(
                {k: v.float() for k, v in state.items() if torch.is_tensor(v)}, strict=False
            )
            batch = synthetic_batch(seed=7)
            results = {
                name: loss_and_grads(m, batch)
                for name, m in (("ref", reference), ("local", local), ("turbo", turbo))
            }
        finally:
            destroy_megatron()
    loss_ref, grads_ref = results["ref"]
    targets = set(results["turbo"][1])
    assert abs(results["turbo"][0] - loss_ref) <= max(
        2 * abs(results["local"][0] - loss_ref), 1e-2 * loss_ref
    )
    for name, ref in grads_ref.items():
        local_error = _relative(results["local"][1][name], ref)
        turbo_error = _relative(results["turbo"][1][te_name(name, targets)], ref)
        assert turbo_error <= max(2 * local_error, 1e-2), (
            f"{name}: {turbo_error:.2e} vs local {local_error:.2e}"
        )


def _parallel_body(rank: int, world: int, tp: int, ep: int, sequence_parallel: bool, async_tp: bool) -> None:
    init_megatron(tp=tp, ep=ep, etp=1 if ep > 1 else None)
    try:
        fields = dict(bf16=False, params_dtype=torch.float32, sequence_parallel=sequence_parallel)
        local, turbo = _pair(ep > 1, async_tp, **fields)
        layers = [m for m in turbo.modules() if hasattr(m, "fused_tp")]
        assert layers and all(m.fused_tp == async_tp for m in layers)
        _compare(local, turbo, rtol=1e-4)
        if ep > 1:  # each rank's experts land at their global index in a distributed checkpoint
            assert _expert_shards(turbo) == _expert_shards(local)
    finally:
        destroy_megatron()


@pytest.mark.multigpu
@pytest.mark.parametrize(
    ("tp", "ep", "sequence_parallel", "async_tp"),
    [(2, 1, False, False), (2, 1, True, False), (2, 1, True, True), (1, 2, False, False)],
    ids=["tp2", "tp2-sp", "tp2-sp-async-tp", "ep2"],
)
def test_turbo_matches_local_parallel(tp, ep, sequence_parallel, async_tp):
    spawn(2, _parallel_body, tp, ep, sequence_parallel, async_tp)


@pytest.mark.parametrize(
    ("impl", "modules", "captured"),
    [
        ("none", [], False),
        ("full_iteration", [], True),
        ("local", [], True),
        ("local", ["moe"], True),
        ("local", ["attn", "moe_router", "moe_preprocess"], False),
        ("transformer_engine", ["attn"], False),
    ],
)
def test_graph_scope_that_captures_the_dispatch(impl, modules, captured):
    from types import SimpleNamespace

    from primus_turbo.integrations.megatron.token_dispatcher import _graph_captures_dispatch

    config = SimpleNamespace(cuda_graph_impl=impl, cuda_graph_modules=modules)
    assert _graph_captures_dispatch(config) is captured


def _graph_dispatch_body(rank: int, world: int) -> None:
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from primus_turbo.integrations.megatron.token_dispatcher import TurboFlexTokenDispatcher

    init_megatron(ep=world, etp=1)
    try:
        config = tiny_config(**MOE_OVERRIDES, moe_grouped_gemm=True)
        args = (2, [2 * rank, 2 * rank + 1], config, get_default_pg_collection())
        config.cuda_graph_impl, config.cuda_graph_modules = "local", []
        with pytest.raises(ValueError, match="turbo-num-worst-tokens"):
            TurboFlexTokenDispatcher(*args)
        config.cuda_graph_modules = ["attn", "moe_router", "moe_preprocess"]  # the dispatch stays eager
        assert TurboFlexTokenDispatcher(*args).cudagraph_attrs == ["_routing_map"]
    finally:
        destroy_megatron()


@pytest.mark.multigpu
def test_graph_of_a_host_sized_dispatch_fails_on_every_rank():
    """A CUDA-graph scope that takes in a dispatch whose buffers are sized on the host raises, naming the
    setting that makes it sync-free, on each rank (no hang); scopes that leave the dispatch out build."""
    spawn(2, _graph_dispatch_body)


TE_LAYER_KEYS = {
    "self_attention.linear_qkv.layer_norm_weight",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv._extra_state",
    "self_attention.core_attention._extra_state",
    "self_attention.linear_proj.weight",
    "self_attention.linear_proj._extra_state",
}
TE_DENSE_MLP = {
    "mlp.linear_fc1.layer_norm_weight",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc1._extra_state",
} | {
    "mlp.linear_fc2.weight",
    "mlp.linear_fc2._extra_state",
}
TE_MOE_MLP = (
    {"pre_mlp_layernorm.weight", "mlp.router.weight"}
    | {f"mlp.experts.linear_fc{i}.weight{e}" for i in (1, 2) for e in range(4)}
    | {"mlp.experts.linear_fc1._extra_state", "mlp.experts.linear_fc2._extra_state"}
)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_state_dict_uses_transformer_engine_names(moe):
    with local_process_group():
        init_megatron()
        try:
            _, turbo = _pair(moe)
            keys = set(turbo.module.state_dict())
        finally:
            destroy_megatron()
    layer = {k.split("decoder.layers.0.", 1)[1] for k in keys if k.startswith("decoder.layers.0.")}
    assert layer == TE_LAYER_KEYS | (TE_MOE_MLP if moe else TE_DENSE_MLP)
    assert {
        "decoder.final_layernorm.weight",
        "embedding.word_embeddings.weight",
        "output_layer.weight",
    } <= keys


_SITES = (
    ("megatron.core.models.gpt.gpt_layer_specs", "TESpecProvider"),
    ("megatron.core.models.gpt.gpt_layer_specs", "TENorm"),
    ("megatron.core.models.gpt.moe_module_specs", "TESpecProvider"),
    ("megatron.core.transformer.transformer_block", "LayerNormImpl"),
    ("megatron.core.transformer.moe.moe_layer", "MoEFlexTokenDispatcher"),
    ("megatron.core.transformer.moe.token_dispatcher", "MoEFlexTokenDispatcher"),
    ("megatron.core.transformer.moe.router", "topk_routing_with_score_function"),
)
_MISSING = object()


def _bound() -> dict:
    return {site: getattr(importlib.import_module(site[0]), site[1], _MISSING) for site in _SITES}


def test_patch_binds_turbo_and_undo_restores():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    from primus_turbo.integrations.megatron.linear import TurboLayerNormColumnParallelLinear
    from primus_turbo.integrations.megatron.token_dispatcher import TurboFlexTokenDispatcher

    before = _bound()
    config = tiny_config(**MOE_OVERRIDES, moe_grouped_gemm=True)
    first = apply_primus_turbo_to_megatron(PrimusTurboConfig(enable_primus_turbo=True), config)
    patch = apply_primus_turbo_to_megatron(PrimusTurboConfig(enable_primus_turbo=True), config)  # replaces
    assert not first.active and patch.active
    try:
        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=4, moe_grouped_gemm=True)
        assert spec.submodules.self_attention.submodules.linear_qkv is TurboLayerNormColumnParallelLinear
        moe_layer = importlib.import_module("megatron.core.transformer.moe.moe_layer")
        assert moe_layer.MoEFlexTokenDispatcher is TurboFlexTokenDispatcher
        assert config.moe_token_dispatcher_type == "flex"
    finally:
        remove_primus_turbo_from_megatron()
    assert _bound() == before
    assert config.moe_token_dispatcher_type == "alltoall"
    remove_primus_turbo_from_megatron()  # nothing active: a no-op
    off = apply_primus_turbo_to_megatron(PrimusTurboConfig(), config)
    assert not off.active and _bound() == before


def test_patch_takes_megatron_lm_args():
    import argparse

    from primus_turbo.integrations.megatron import add_primus_turbo_args

    parser = add_primus_turbo_args(argparse.ArgumentParser())
    args = parser.parse_args(["--enable-primus-turbo", "--no-use-turbo-attention"])
    for name, value in vars(tiny_config(**MOE_OVERRIDES, moe_grouped_gemm=True)).items():
        setattr(args, name, value)
    patch = apply_primus_turbo_to_megatron(args)
    try:
        assert (
            patch.features.gemm and not patch.features.attention and args.moe_token_dispatcher_type == "flex"
        )
    finally:
        patch.undo()
    assert args.moe_token_dispatcher_type == "alltoall"


@pytest.mark.multigpu
def test_example_runs_at_tiny_size():
    command = [sys.executable, str(ROOT / "examples/megatron/train_moe.py"), "--size", "tiny", "--steps", "3"]
    if torch.cuda.is_available():
        command += ["--nproc", str(min(2, torch.cuda.device_count()))]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "TurboGroupedMLPWithFusedAct" in result.stdout and "median tokens/s" in result.stdout


def _train_moe_module():
    spec = importlib.util.spec_from_file_location("train_moe", ROOT / "examples/megatron/train_moe.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_moe"] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--cuda-graph", "--nproc", "2"], "--cuda-graph-impl step needs one GPU"),
        (["--compile", "--compile-mode", "reduce-overhead"], "use --compile --cuda-graph"),
        (["--micro-batches", "0"], "at least 1"),
        (["--cuda-graph", "--micro-batches", "2"], "one micro-batch a step"),
        (["--cuda-graph", "--cuda-graph-impl", "local"], "--cuda-graph is --cuda-graph-impl step"),
        (["--cuda-graph-modules", "attn"], "--cuda-graph-impl local"),
        (["--cuda-graph-impl", "local", "--nproc", "2"], "--cuda-graph-impl local needs one GPU"),
    ],
)
def test_example_rejects_unsupported_graph_options(argv, message, capsys):
    with pytest.raises(SystemExit):
        _train_moe_module().parse_args(argv)
    assert message in capsys.readouterr().err


def _example_losses(*extra: str, steps: int = 6, env: dict[str, str] | None = None) -> list[float]:
    common = ["--size", "tiny", "--nproc", "1", "--steps", str(steps), "--warmup", "1"]
    command = [sys.executable, str(ROOT / "examples/megatron/train_moe.py"), *common, *extra]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines() if line[:4].strip().isdigit()]
    assert len(rows) == steps
    return [float(row[1]) for row in rows]


def test_example_accumulates_micro_batches():
    """``--micro-batches 2``: two forward+backward passes per optimizer step (the loss is their mean);
    training still brings the loss down."""
    losses = _example_losses("--micro-batches", "2", "--lr", "3e-3", steps=4)
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]


@pytest.mark.gpu
def test_example_cuda_graph_matches_eager():
    """The replayed CUDA graph of the step trains exactly like the eager step (same kernels, same data)."""
    assert _example_losses("--cuda-graph") == pytest.approx(_example_losses(), rel=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "graph",
    [
        ["--cuda-graph-impl", "local"],
        ["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn", "moe_router", "moe_preprocess"],
        ["--cuda-graph-impl", "full_iteration"],
    ],
    ids=["local-layer", "local-attn-router-preprocess", "full-iteration"],
)
def test_example_megatron_cuda_graphs_match_eager(graph):
    """megatron-core's own CUDA graphs of the Turbo model (per layer, partial layers, the whole
    forward_backward_func) train like the eager step."""
    assert _example_losses(*graph) == pytest.approx(_example_losses(), rel=1e-3)


def test_example_fp8_primary_weights_train_like_quantizing_each_step():
    """``--fp8-param-gather``: FusedAdamW writes the FP8 weights and the forward reads them; the losses
    follow the run that quantizes the weights in every forward (the moments are fp32 there, so FP8
    tolerance, not bit equality). Portable backends on the CPU, as below."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    fp8 = ["--fp8", "e4m3", "--fp8-recipe", "tensorwise", "--lr", "3e-3"]
    primary = _example_losses(*fp8, "--fp8-param-gather", steps=4, env=env)
    assert primary == pytest.approx(_example_losses(*fp8, steps=4, env=env), rel=2e-2)


def test_example_compiled_model_trains_like_eager():
    """``--compile`` (the whole GPT model, its loss included, in one torch.compile graph) follows the
    eager run's losses: the compiled kernels round differently, so bf16 tolerance. On the CPU it runs the
    portable backends, not the Triton interpreter (this test is about the compiled graph, and fast)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    compiled = _example_losses("--compile", steps=3, env=env)
    assert compiled == pytest.approx(_example_losses(steps=3, env=env), rel=1e-2)


def _expert_shards(model) -> dict[str, tuple]:
    """{key: (global shape, global offset)} of the expert weights' distributed-checkpoint shards."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors

    state = getattr(model, "module", model).sharded_state_dict()
    apply_factories(state)  # the gated fc1 is saved as its two halves
    tensors, _ = extract_sharded_tensors(state)
    out: dict[str, set] = {}
    for value in _leaves(tensors):
        if isinstance(value, ShardedTensor) and ".experts." in value.key:
            out.setdefault(value.key, set()).add((tuple(value.global_shape), tuple(value.global_offset)))
    return out


def _leaves(tree):
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _leaves(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from _leaves(value)
    else:
        yield tree


def test_expert_checkpoint_shards_match_sequential_mlp():
    """Turbo's grouped experts save under the keys, global shapes and offsets of Megatron's SequentialMLP
    (which TE's grouped experts share), so distributed checkpoints interchange."""
    with local_process_group():
        init_megatron()
        try:
            local, turbo = _pair(True)
            shards = _expert_shards(turbo)
            assert any("linear_fc1" in key for key in shards) and any("linear_fc2" in key for key in shards)
            assert shards == _expert_shards(local)
        finally:
            destroy_megatron()
