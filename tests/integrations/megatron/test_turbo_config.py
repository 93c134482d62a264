"""The Primus-Turbo switch and feature flags: argparse provider, config object, feature resolution against a
Megatron config, FP8 recipes, and every contradiction raising a clear error."""

from __future__ import annotations

import argparse
import types

import pytest
import torch.nn.functional as F

from primus_turbo.integrations.megatron import (
    PrimusTurboConfig,
    add_primus_turbo_args,
    fp8_quant_config,
    resolve,
)
from primus_turbo.pytorch.core.low_precision import Format, ScalingGranularity


def _megatron(**overrides) -> types.SimpleNamespace:
    """The fields of a Megatron config that feature resolution reads: a MoE SwiGLU RMSNorm model."""
    fields = dict(
        num_moe_experts=8,
        moe_grouped_gemm=True,
        context_parallel_size=1,
        multi_latent_attention=False,
        attention_dropout=0.0,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        tp_comm_overlap=False,
        fp8=None,
        fp8_recipe="delayed",
        fp4=None,
        fp8_param=False,
        moe_shared_expert_overlap=False,
        moe_pad_expert_input_to_capacity=False,
        first_last_layers_bf16=False,
        moe_token_dispatcher_type="alltoall",
    )
    fields.update(overrides)
    return types.SimpleNamespace(**fields)


def _parse(*argv: str) -> argparse.Namespace:
    return add_primus_turbo_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_switch_turns_on_every_usable_feature():
    features = resolve(PrimusTurboConfig(enable_primus_turbo=True), _megatron())
    assert features.attention and features.gemm and features.grouped_gemm and features.deepep
    assert features.rms_norm and features.fused_act_with_probs and features.fp8 is None


def test_switch_off_fills_nothing():
    assert resolve(PrimusTurboConfig(), _megatron()).describe() == "Primus-Turbo fills: nothing"


def test_features_follow_the_model():
    dense = resolve(PrimusTurboConfig(enable_primus_turbo=True), _megatron(num_moe_experts=None))
    assert dense.gemm and not dense.grouped_gemm and not dense.deepep and not dense.fused_act_with_probs
    layernorm = resolve(PrimusTurboConfig(enable_primus_turbo=True), _megatron(normalization="LayerNorm"))
    assert not layernorm.rms_norm
    cp = resolve(PrimusTurboConfig(enable_primus_turbo=True), _megatron(context_parallel_size=2))
    assert not cp.attention
    gelu = resolve(PrimusTurboConfig(enable_primus_turbo=True), _megatron(activation_func=F.gelu))
    assert gelu.grouped_gemm and not gelu.fused_act_with_probs


def test_async_tp_is_opt_in():
    model = _megatron(tensor_model_parallel_size=2, sequence_parallel=True)
    assert not resolve(PrimusTurboConfig(enable_primus_turbo=True), model).async_tp
    assert resolve(PrimusTurboConfig(enable_primus_turbo=True, use_turbo_async_tp=True), model).async_tp
    assert _parse("--enable-primus-turbo", "--use-turbo-async-tp").use_turbo_async_tp


def test_a_feature_can_be_turned_off():
    features = resolve(PrimusTurboConfig(enable_primus_turbo=True, use_turbo_attention=False), _megatron())
    assert not features.attention and features.gemm


@pytest.mark.parametrize(
    ("flag", "overrides", "message"),
    [
        ("use_turbo_deepep", {"num_moe_experts": None}, "no experts"),
        ("use_turbo_grouped_gemm", {"moe_grouped_gemm": False}, "--moe-grouped-gemm"),
        ("use_turbo_attention", {"context_parallel_size": 2}, "context parallelism"),
        ("use_turbo_attention", {"attention_dropout": 0.1}, "attention dropout"),
        ("use_turbo_rms_norm", {"normalization": "LayerNorm"}, "not RMSNorm"),
        ("use_turbo_fused_act_with_probs", {"gated_linear_unit": False}, "SwiGLU"),
        ("use_turbo_async_tp", {"tensor_model_parallel_size": 2}, "--sequence-parallel"),
        ("use_turbo_async_tp", {"sequence_parallel": True}, "tensor parallelism > 1"),
    ],
)
def test_insisting_on_an_unusable_feature_raises(flag, overrides, message):
    with pytest.raises(ValueError, match=message):
        resolve(PrimusTurboConfig(enable_primus_turbo=True, **{flag: True}), _megatron(**overrides))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tp_comm_overlap": True}, "tp_comm_overlap"),
        ({"fp4": "nvfp4"}, "--fp4"),
        ({"fp8": "e4m3", "fp8_recipe": "mxfp8", "fp8_param": True}, "fp8_param"),
        ({"fp8": "e4m3", "fp8_recipe": "mxfp8", "fp8_param_gather": True}, "fp8_param"),
        ({"moe_shared_expert_overlap": True}, "shared-expert-overlap"),
        ({"moe_pad_expert_input_to_capacity": True}, "capacity"),
        ({"fp8": "e4m3", "fp8_recipe": "delayed"}, "tensorwise | blockwise | mxfp8"),
        ({"fp8": "e4m3", "fp8_recipe": "mxfp8"}, "no mxfp8 path"),
        (
            {"fp8": "e4m3", "fp8_recipe": "tensorwise", "first_last_layers_bf16": True},
            "first_last_layers_bf16",
        ),
    ],
)
def test_contradictions_raise(overrides, message):
    with pytest.raises(ValueError, match=message):
        resolve(PrimusTurboConfig(enable_primus_turbo=True), _megatron(**overrides))


def test_high_precision_expert_wgrad_needs_fp8_experts():
    """``--no-turbo-fp8-expert-wgrad`` reaches the resolved features; without FP8 or Turbo experts it
    would change nothing, so it raises."""
    args = _parse("--enable-primus-turbo", "--no-turbo-fp8-expert-wgrad")
    turbo = PrimusTurboConfig.from_args(args)
    assert PrimusTurboConfig.from_args(_parse("--enable-primus-turbo")).turbo_fp8_expert_wgrad
    resolved = resolve(turbo, _megatron(fp8="e4m3", fp8_recipe="blockwise"))
    assert not resolved.fp8_expert_wgrad and "wgrad in high precision" in resolved.describe()
    with pytest.raises(ValueError, match="turbo_fp8_expert_wgrad=False"):
        resolve(turbo, _megatron())
    with pytest.raises(ValueError, match="turbo_fp8_expert_wgrad=False"):
        resolve(turbo, _megatron(fp8="e4m3", fp8_recipe="blockwise", moe_grouped_gemm=False))


def test_fp8_auto_filter_flag():
    """``--turbo-fp8-auto-filter`` alone is "auto": eager unless the model config captures CUDA graphs;
    an explicit mode is kept; without FP8 layers it would change nothing, so it raises."""
    auto = PrimusTurboConfig.from_args(_parse("--enable-primus-turbo", "--turbo-fp8-auto-filter"))
    assert auto.turbo_fp8_auto_filter == "auto"
    fp8 = dict(fp8="e4m3", fp8_recipe="blockwise")
    eager = resolve(auto, _megatron(**fp8))
    assert eager.fp8_auto_filter == "eager" and "auto-filter (eager)" in eager.describe()
    assert resolve(auto, _megatron(**fp8, cuda_graph_impl="full_iteration")).fp8_auto_filter == "graph"
    assert resolve(auto, _megatron(**fp8, enable_cuda_graph=True)).fp8_auto_filter == "graph"
    graph = PrimusTurboConfig.from_args(_parse("--enable-primus-turbo", "--turbo-fp8-auto-filter", "graph"))
    assert resolve(graph, _megatron(**fp8)).fp8_auto_filter == "graph"
    assert resolve(PrimusTurboConfig(enable_primus_turbo=True), _megatron(**fp8)).fp8_auto_filter is None
    with pytest.raises(ValueError, match="turbo_fp8_auto_filter"):
        resolve(auto, _megatron())
    with pytest.raises(ValueError, match="turbo_fp8_auto_filter must be one of"):
        PrimusTurboConfig(enable_primus_turbo=True, turbo_fp8_auto_filter="always")


def test_backward_on_caller_thread_flag():
    """On by default with the switch, off with ``--no-turbo-backward-on-caller-thread``; nothing without the
    switch."""
    on = resolve(PrimusTurboConfig.from_args(_parse("--enable-primus-turbo")), _megatron())
    assert on.backward_on_caller_thread and "calling thread" in on.describe()
    off = PrimusTurboConfig.from_args(_parse("--enable-primus-turbo", "--no-turbo-backward-on-caller-thread"))
    assert not resolve(off, _megatron()).backward_on_caller_thread
    assert not resolve(PrimusTurboConfig(), _megatron()).backward_on_caller_thread


def test_a_feature_without_the_switch_raises():
    with pytest.raises(ValueError, match="needs enable_primus_turbo"):
        PrimusTurboConfig(use_turbo_gemm=True)


def test_bad_values_raise():
    with pytest.raises(TypeError, match="use_turbo_gemm"):
        PrimusTurboConfig(enable_primus_turbo=True, use_turbo_gemm="yes")
    with pytest.raises(ValueError, match="turbo_gemm_backend"):
        PrimusTurboConfig(enable_primus_turbo=True, turbo_gemm_backend="NOT_A_BACKEND")
    with pytest.raises(ValueError, match="autotune"):
        PrimusTurboConfig(enable_primus_turbo=True, turbo_dispatch_backend="autotune")
    with pytest.raises(ValueError, match="turbo_num_worst_tokens"):
        PrimusTurboConfig(enable_primus_turbo=True, turbo_num_worst_tokens=-1)
    with pytest.raises(TypeError, match="turbo_fp8_expert_wgrad"):
        PrimusTurboConfig(enable_primus_turbo=True, turbo_fp8_expert_wgrad="no")
    with pytest.raises(TypeError, match="turbo_backward_on_caller_thread"):
        PrimusTurboConfig(enable_primus_turbo=True, turbo_backward_on_caller_thread=1)


def test_from_dict_rejects_unknown_keys():
    assert PrimusTurboConfig.from_dict({"enable_primus_turbo": True}).enable_primus_turbo
    with pytest.raises(ValueError, match="unknown Primus-Turbo option"):
        PrimusTurboConfig.from_dict({"enable_primus_turbo": True, "use_turbo_parallel_linear": True})


@pytest.mark.parametrize(
    ("fp8", "recipe", "granularity", "block", "fmt"),
    [
        ("e4m3", "tensorwise", ScalingGranularity.TENSORWISE, None, Format.E4M3),
        ("hybrid", "blockwise", ScalingGranularity.BLOCKWISE, 128, Format.HYBRID),
        ("e4m3", "mxfp8", ScalingGranularity.MX_BLOCKWISE, 32, Format.E4M3),
    ],
)
def test_fp8_recipes_map_to_turbo_configs(fp8, recipe, granularity, block, fmt):
    config = fp8_quant_config(_megatron(fp8=fp8, fp8_recipe=recipe))
    assert (config.granularity, config.block_size, config.format) == (granularity, block, fmt)
    assert fp8_quant_config(_megatron()) is None


def test_argparse_provider():
    args = _parse(
        "--enable-primus-turbo", "--no-use-turbo-attention", "--turbo-gemm-backend", "fp8:TRITON,other:TORCH"
    )
    config = PrimusTurboConfig.from_args(args)
    assert (
        config.enable_primus_turbo and config.use_turbo_attention is False and config.use_turbo_gemm is None
    )
    assert config.backend_env() == {"PRIMUS_TURBO_GEMM_BACKEND": "fp8:TRITON,other:TORCH"}
    assert not PrimusTurboConfig.from_args(_parse()).enable_primus_turbo


def test_argparse_rejects_unknown_and_contradictory_flags(capsys):
    with pytest.raises(SystemExit):
        _parse("--enable-primus-turbo", "--use-turbo-parallel-linear")
    assert "unrecognized arguments" in capsys.readouterr().err
    with pytest.raises(ValueError, match="needs enable_primus_turbo"):
        PrimusTurboConfig.from_args(_parse("--use-turbo-gemm"))
