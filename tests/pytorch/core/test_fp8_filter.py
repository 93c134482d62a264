"""The FP8 cost model's decisions (``fp8_linear_decision``) on given shapes, and its bad input."""

from __future__ import annotations

import math

import pytest

from primus_turbo.pytorch.core.fp8_filter import Fp8CostModel, fp8_linear_decision
from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, ScalingGranularity

_TENSORWISE = Float8QuantConfig(granularity=ScalingGranularity.TENSORWISE)
_BLOCKWISE = Float8QuantConfig(granularity=ScalingGranularity.BLOCKWISE, block_size=128)


@pytest.mark.parametrize("config", [_TENSORWISE, _BLOCKWISE], ids=["tensorwise", "blockwise"])
@pytest.mark.parametrize("count_host", [True, False], ids=["eager", "graph"])
def test_large_gemms_take_fp8(config, count_host):
    """DeepSeek-V3's experts (32 x 2048 tokens) and a 4096-token Llama-size projection: FP8 wins."""
    experts = fp8_linear_decision(65536, 7168, 4096, config, groups=32, count_host=count_host)
    dense = fp8_linear_decision(4096, 4096, 12288, config, count_host=count_host)
    assert experts.use_fp8 and dense.use_fp8
    assert experts.fp8_us < experts.bf16_us and "fp8" in str(experts)


@pytest.mark.parametrize("config", [_TENSORWISE, _BLOCKWISE], ids=["tensorwise", "blockwise"])
def test_small_gemms_stay_bf16(config):
    """Fine-grained experts (128 experts of ffn 768, 256 tokens each) and a small projection: the
    quantization passes cost more than FP8 saves, on device time alone."""
    experts = fp8_linear_decision(32768, 768, 2048, config, groups=128, count_host=False)
    dense = fp8_linear_decision(1024, 1024, 1024, config, count_host=False)
    assert not experts.use_fp8 and not dense.use_fp8
    assert str(experts).startswith("bf16")


def test_eager_counts_the_host_path():
    """A GEMM that is faster in FP8 on the device stays bf16 where its FP8 host path (eager mode) takes
    longer than the bf16 layer's device time."""
    graph = fp8_linear_decision(4096, 2048, 6144, _TENSORWISE, count_host=False)
    eager = fp8_linear_decision(4096, 2048, 6144, _TENSORWISE, count_host=True)
    assert graph.use_fp8 and not eager.use_fp8
    assert eager.fp8_us == Fp8CostModel().host_fp8_us and "host" in eager.reason


def test_block_scaling_needs_block_multiples():
    decision = fp8_linear_decision(65536, 7168, 4000, _BLOCKWISE, groups=32)
    assert not decision.use_fp8 and math.isinf(decision.fp8_us) and "multiples of 128" in decision.reason
    assert fp8_linear_decision(65536, 7168, 4000, _TENSORWISE, groups=32).use_fp8


def test_grouped_layers_may_take_the_bf16_wgrad():
    """With few tokens per expert the block-scaled wgrad is the slow part: the model can keep FP8 for the
    forward and dgrad and take the wgrad in bf16, but a fixed ``fp8_wgrad`` is kept."""
    free = fp8_linear_decision(8192, 4096, 28672, _BLOCKWISE, groups=8, count_host=False)
    fixed = fp8_linear_decision(8192, 4096, 28672, _BLOCKWISE, groups=8, fp8_wgrad=True, count_host=False)
    assert free.use_fp8 and not free.fp8_wgrad and "bf16 wgrad" in str(free)
    assert fixed.fp8_wgrad and fixed.fp8_us >= free.fp8_us
    dense = fp8_linear_decision(8192, 4096, 28672, _BLOCKWISE, fp8_wgrad=False, count_host=False)
    assert dense.fp8_wgrad  # a linear's wgrad is FP8 whenever its GEMMs are


def test_fused_producer_and_micro_batches_lower_the_fp8_cost():
    base = fp8_linear_decision(4096, 4096, 4096, _BLOCKWISE, count_host=False)
    fused = fp8_linear_decision(4096, 4096, 4096, _BLOCKWISE, input_fp8=True, count_host=False)
    shared = fp8_linear_decision(4096, 4096, 4096, _BLOCKWISE, micro_batches=8, count_host=False)
    primary = fp8_linear_decision(4096, 4096, 4096, _BLOCKWISE, weight_fp8=True, count_host=False)
    assert fused.fp8_us < base.fp8_us and primary.fp8_us < shared.fp8_us < base.fp8_us
    assert fused.bf16_us == base.bf16_us == shared.bf16_us == primary.bf16_us


def test_empty_layers_and_a_custom_model():
    assert not fp8_linear_decision(0, 4096, 4096, _TENSORWISE).use_fp8
    slow_fp8 = Fp8CostModel(fp8_tflops=100.0, fp8_block_wgrad_tflops=100.0)
    assert not fp8_linear_decision(65536, 7168, 4096, _TENSORWISE, groups=32, model=slow_fp8).use_fp8


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(tokens=-1), ValueError, "tokens"),
        (dict(in_features=2.5), ValueError, "in_features"),
        (dict(groups=0), ValueError, "groups"),
        (dict(config="tensorwise"), TypeError, "Float8QuantConfig"),
    ],
)
def test_bad_input_raises(kwargs, error, match):
    args = dict(tokens=4096, in_features=4096, out_features=4096, config=_TENSORWISE) | kwargs
    with pytest.raises(error, match=match):
        fp8_linear_decision(args.pop("tokens"), args.pop("in_features"), args.pop("out_features"), **args)
