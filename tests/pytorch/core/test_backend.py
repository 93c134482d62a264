"""Backend manager and dispatcher: env formats, priority order, pinned-raises, fallback, tune cache."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.pytorch.core import backend as backend_mod
from primus_turbo.pytorch.core.backend import (
    AutoKernelDispatcher,
    BackendChoice,
    BackendType,
    GlobalBackendManager,
    KernelBackend,
    PrecisionType,
    TuneCache,
    parse_backend_spec,
    precision_of,
)

BF16 = PrecisionType.BF16_FP16_FP32
FP8 = PrecisionType.FP8


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for name in GlobalBackendManager._ENV_BY_OP.values():
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("PRIMUS_TURBO_AUTO_TUNE", raising=False)
    GlobalBackendManager.reset()
    yield
    GlobalBackendManager.reset()


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("TRITON", {None: BackendChoice(BackendType.TRITON)}),
        ("  triton ", {None: BackendChoice(BackendType.TRITON)}),
        ("autotune", {None: BackendChoice(auto_tune=True)}),
        ("AutoTune", {None: BackendChoice(auto_tune=True)}),
        (
            "fp8:TRITON,other:HIPBLASLT",
            {FP8: BackendChoice(BackendType.TRITON), None: BackendChoice(BackendType.HIPBLASLT)},
        ),
        (
            "FP8:ck, BF16:triton",
            {FP8: BackendChoice(BackendType.CK), BF16: BackendChoice(BackendType.TRITON)},
        ),
        ("fp8:autotune,other:ck", {FP8: BackendChoice(auto_tune=True), None: BackendChoice(BackendType.CK)}),
        ("bf16:torch,fp16:torch", {BF16: BackendChoice(BackendType.TORCH)}),
        ("fp4:turbo", {PrecisionType.FP4: BackendChoice(BackendType.TURBO)}),
        ("", {}),
    ],
)
def test_parse_backend_spec_formats(spec, expected):
    assert parse_backend_spec(spec) == expected


@pytest.mark.parametrize(
    "spec,match",
    [
        ("CUBLAS", r"unknown backend 'CUBLAS'; valid backends: HIPBLASLT, TRITON"),
        ("fp8:NOPE", "unknown backend 'NOPE'"),
        ("int8:TRITON", r"precision one of fp4, fp8, bf16, fp16, fp32, other"),
        ("fp8:TRITON,HIPBLASLT", "expected <precision>:<backend>"),
        ("bf16:TRITON,fp16:CK", "two different backends"),
    ],
)
def test_parse_backend_spec_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_backend_spec(spec, "PRIMUS_TURBO_GEMM_BACKEND")


def test_env_is_read_per_precision(monkeypatch):
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "fp8:triton,other:hipblaslt")
    assert GlobalBackendManager.get_gemm_backend(FP8) == BackendChoice(BackendType.TRITON)
    assert GlobalBackendManager.get_gemm_backend(BF16) == BackendChoice(BackendType.HIPBLASLT)
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "fp8:triton")
    assert GlobalBackendManager.get_gemm_backend(BF16) is None
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "   ")
    assert GlobalBackendManager.get_gemm_backend(FP8) is None


def test_env_error_names_the_variable(monkeypatch):
    monkeypatch.setenv("PRIMUS_TURBO_GROUPED_GEMM_BACKEND", "fp9:TRITON")
    with pytest.raises(ValueError, match="PRIMUS_TURBO_GROUPED_GEMM_BACKEND"):
        GlobalBackendManager.get_grouped_gemm_backend(BF16)


def test_code_setting_beats_environment(monkeypatch):
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "TRITON")
    GlobalBackendManager.set_gemm_backend(BackendType.TORCH, precision=FP8)
    assert GlobalBackendManager.get_gemm_backend(FP8) == BackendChoice(BackendType.TORCH)
    # a code table for the op hides the environment entirely
    assert GlobalBackendManager.get_gemm_backend(BF16) is None
    GlobalBackendManager.set_gemm_backend(None)
    assert GlobalBackendManager.get_gemm_backend(BF16) == BackendChoice(BackendType.TRITON)


def test_setters_and_reset():
    GlobalBackendManager.set_gemm_backend("triton")
    GlobalBackendManager.set_grouped_gemm_backend(auto_tune=True, precision=FP8)
    GlobalBackendManager.set_attn_backend(BackendType.AITER)
    GlobalBackendManager.set_moe_dispatch_combine_backend(BackendType.DEEP_EP)
    GlobalBackendManager.set_async_tp_backend("turbo")
    GlobalBackendManager.set_auto_tune(True)
    assert GlobalBackendManager.get_gemm_backend(FP8) == BackendChoice(BackendType.TRITON)
    assert GlobalBackendManager.get_grouped_gemm_backend(FP8) == BackendChoice(auto_tune=True)
    assert GlobalBackendManager.get_grouped_gemm_backend(BF16) is None
    assert GlobalBackendManager.get_attn_backend(BF16) == BackendChoice(BackendType.AITER)
    assert GlobalBackendManager.get_moe_dispatch_combine_backend(BF16) == BackendChoice(BackendType.DEEP_EP)
    assert GlobalBackendManager.get_async_tp_backend(FP8) == BackendChoice(BackendType.TURBO)
    assert GlobalBackendManager.auto_tune_enabled()
    GlobalBackendManager.set_gemm_backend(None, precision=FP8)
    assert GlobalBackendManager.get_gemm_backend(FP8) is None
    GlobalBackendManager.reset()
    assert GlobalBackendManager.get_gemm_backend(FP8) is None
    assert GlobalBackendManager.get_attn_backend(BF16) is None
    assert not GlobalBackendManager.auto_tune_enabled()


def test_setter_errors(monkeypatch):
    with pytest.raises(ValueError, match="either a backend or auto_tune"):
        GlobalBackendManager.set_gemm_backend(BackendType.TRITON, auto_tune=True)
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        GlobalBackendManager.set_gemm_backend("fast")
    with pytest.raises(TypeError, match="precision must be a PrecisionType"):
        GlobalBackendManager.set_gemm_backend(BackendType.TRITON, precision="fp8")
    for collective in ("moe_dispatch_combine", "async_tp"):  # ranks timing alone could disagree
        with pytest.raises(ValueError, match=f"autotune is not supported for {collective}"):
            GlobalBackendManager.set_backend(collective, auto_tune=True)
    monkeypatch.setenv("PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND", "autotune")
    with pytest.raises(ValueError, match="'autotune' is not supported"):
        GlobalBackendManager.get_moe_dispatch_combine_backend(BF16)
    with pytest.raises(TypeError, match="enabled must be a bool"):
        GlobalBackendManager.set_auto_tune("yes")


@pytest.mark.parametrize("value,enabled", [("1", True), ("true", True), ("0", False), ("", False)])
def test_auto_tune_env(monkeypatch, value, enabled):
    monkeypatch.setenv("PRIMUS_TURBO_AUTO_TUNE", value)
    assert GlobalBackendManager.auto_tune_enabled() is enabled
    GlobalBackendManager.set_auto_tune(not enabled)
    assert GlobalBackendManager.auto_tune_enabled() is (not enabled)


def test_precision_of():
    assert precision_of(torch.bfloat16) is BF16
    assert precision_of(torch.float8_e4m3fn) is FP8
    with pytest.raises(TypeError):
        precision_of(torch.int32)


# A toy op with three backends to test the dispatcher's priority rules in isolation.
class _Fast(KernelBackend):
    runs = 0

    @classmethod
    def unsupported_reason(cls, x, **_):
        return "only even sizes" if x.numel() % 2 else None

    @staticmethod
    def execute(x, **_):
        _Fast.runs += 1
        return "fast"


class _Slow(KernelBackend):
    @staticmethod
    def execute(x, **_):
        torch.ones(200, 200) @ torch.ones(200, 200)
        return "slow"


class _Missing(KernelBackend):
    @classmethod
    def unavailable_reason(cls):
        return "vendor library not installed"

    @staticmethod
    def execute(x, **_):
        raise AssertionError("never runs")


class _Raises(KernelBackend):
    def unsupported_reason(*args, **kwargs):  # a buggy check must not escape can_handle
        raise RuntimeError("boom")

    @staticmethod
    def execute(x, **_):
        raise AssertionError("never runs")


class _ToyDispatcher(AutoKernelDispatcher):
    op_name = "toy"
    backends = {
        BackendType.CK: _Missing,
        BackendType.TORCH: _Slow,
        BackendType.TRITON: _Fast,
        BackendType.AITER: _Raises,
    }

    @classmethod
    def make_key(cls, x, **_):
        return (x.numel(),)

    @classmethod
    def default_backend(cls, **_):
        return BackendType.TRITON


def test_dispatch_priority_default_then_fallback():
    assert _ToyDispatcher.dispatch(None, x=torch.ones(4)) == "fast"
    assert _ToyDispatcher.last_selected() is BackendType.TRITON
    # the default declines odd sizes: the first registered backend that accepts runs instead
    assert _ToyDispatcher.dispatch(None, x=torch.ones(3)) == "slow"
    assert _ToyDispatcher.last_selected() is BackendType.TORCH


def test_pinned_backend_runs_or_raises_never_swaps():
    assert _ToyDispatcher.dispatch(BackendChoice(BackendType.TORCH), x=torch.ones(4)) == "slow"
    with pytest.raises(ValueError, match="pinned backend TRITON cannot handle this call: only even sizes"):
        _ToyDispatcher.dispatch(BackendChoice(BackendType.TRITON), x=torch.ones(3))
    with pytest.raises(ValueError, match="CK cannot handle this call: vendor library not installed"):
        _ToyDispatcher.dispatch(BackendChoice(BackendType.CK), x=torch.ones(4))
    with pytest.raises(ValueError, match="FLYDSL is not implemented for this op; choose from CK, TORCH"):
        _ToyDispatcher.dispatch(BackendChoice(BackendType.FLYDSL), x=torch.ones(4))
    assert not _Raises.can_handle(x=torch.ones(4))
    assert "boom" in _Raises.decline_reason(x=torch.ones(4))


def test_autotune_picks_fastest_and_caches():
    _Fast.runs = 0
    choice = BackendChoice(auto_tune=True)
    assert _ToyDispatcher.dispatch(choice, x=torch.ones(4)) == "fast"
    timed_runs = _Fast.runs
    assert timed_runs > 1
    assert _ToyDispatcher._cache.get((4,)) is BackendType.TRITON
    _ToyDispatcher.dispatch(choice, x=torch.ones(4))
    assert _Fast.runs == timed_runs + 1  # cache hit: no more timing
    GlobalBackendManager.reset()
    assert len(_ToyDispatcher._cache) == 0


def test_global_autotune_switch_and_pinned_wins():
    GlobalBackendManager.set_auto_tune(True)
    _ToyDispatcher.dispatch(None, x=torch.ones(6))
    assert _ToyDispatcher._cache.get((6,)) is BackendType.TRITON
    assert _ToyDispatcher.dispatch(BackendChoice(BackendType.TORCH), x=torch.ones(6)) == "slow"


def test_autotune_skipped_while_tracing_or_capturing(monkeypatch):
    monkeypatch.setattr(backend_mod, "_tuning_forbidden", lambda kwargs: True)
    assert _ToyDispatcher.dispatch(BackendChoice(auto_tune=True), x=torch.ones(8)) == "fast"
    assert len(_ToyDispatcher._cache) == 0
    assert backend_mod._tuning_forbidden.__name__ == "<lambda>"


def test_tuning_forbidden_on_meta_tensors():
    assert backend_mod._tuning_forbidden({"x": torch.empty(2, device="meta")})
    assert not backend_mod._tuning_forbidden({"x": torch.empty(2)})


def test_tune_cache_is_a_bounded_lru(caplog):
    cache = TuneCache(capacity=2)
    cache.put("a", BackendType.TRITON)
    cache.put("b", BackendType.TORCH)
    assert cache.get("a") is BackendType.TRITON  # refresh "a"; "b" is now the oldest
    cache.put("c", BackendType.CK)
    assert len(cache) == 2
    assert cache.get("b") is None
    assert cache.get("a") is BackendType.TRITON and cache.get("c") is BackendType.CK


@pytest.mark.parametrize(
    "timings,winner",
    [
        ({BackendType.TORCH: 0.995, BackendType.TRITON: 1.0}, BackendType.TRITON),  # within margin: default
        ({BackendType.TORCH: 0.90, BackendType.TRITON: 1.0}, BackendType.TORCH),  # clearly faster: challenger
        ({BackendType.TORCH: 1.0, BackendType.TRITON: float("inf")}, BackendType.TORCH),  # default failed
    ],
)
def test_autotune_keeps_default_unless_clearly_beaten(monkeypatch, timings, winner):
    monkeypatch.setattr(backend_mod, "_time_candidates", lambda fns, *args: dict(timings))
    assert _ToyDispatcher.resolve(BackendChoice(auto_tune=True), x=torch.ones(10)) is winner


def test_time_candidates_marks_failures_inf():
    def boom():
        raise RuntimeError("kernel failed")

    timings = backend_mod._time_candidates(
        {BackendType.TORCH: lambda: None, BackendType.CK: boom}, torch.device("cpu"), 1, 3, 0.1
    )
    assert timings[BackendType.CK] == float("inf") and timings[BackendType.TORCH] < 1.0


class _ToyGemmDispatcher(_ToyDispatcher):
    """The toy op, following the GEMM settings (setter and ``PRIMUS_TURBO_GEMM_BACKEND``)."""

    op_name = "toy_gemm"
    settings_op = "gemm"


def test_run_resolves_once_and_reuses_the_decision(monkeypatch):
    calls = []
    real = _ToyGemmDispatcher._decide.__func__
    monkeypatch.setattr(
        _ToyGemmDispatcher, "_decide", classmethod(lambda cls, *a: calls.append(1) or real(cls, *a))
    )
    for _ in range(3):
        assert _ToyGemmDispatcher.run(BF16, x=torch.ones(4)) == "fast"
    assert len(calls) == 1 and _ToyGemmDispatcher.selection_counts() == {BackendType.TRITON: 3}
    # a new resolution key (an odd size the default declines) resolves on its own
    assert _ToyGemmDispatcher.run(BF16, x=torch.ones(3)) == "slow"
    assert len(calls) == 2 and _ToyGemmDispatcher.last_selected() is BackendType.TORCH


def test_run_follows_setter_env_and_reset(monkeypatch):
    assert _ToyGemmDispatcher.run(BF16, x=torch.ones(4)) == "fast"
    GlobalBackendManager.set_gemm_backend(BackendType.TORCH)
    assert _ToyGemmDispatcher.run(BF16, x=torch.ones(4)) == "slow"
    GlobalBackendManager.set_gemm_backend(None)
    assert _ToyGemmDispatcher.run(BF16, x=torch.ones(4)) == "fast"
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "torch")
    assert _ToyGemmDispatcher.run(BF16, x=torch.ones(4)) == "slow"
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "fp8:torch")  # no entry for bf16: the default again
    assert _ToyGemmDispatcher.run(BF16, x=torch.ones(4)) == "fast"
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "triton")
    with pytest.raises(ValueError, match="pinned backend TRITON cannot handle this call"):
        _ToyGemmDispatcher.run(BF16, x=torch.ones(5))  # a pinned backend that declines raises every time
    with pytest.raises(ValueError, match="pinned backend TRITON"):
        _ToyGemmDispatcher.run(BF16, x=torch.ones(5))
    monkeypatch.delenv("PRIMUS_TURBO_GEMM_BACKEND")
    assert _ToyGemmDispatcher.run(BF16, x=torch.ones(5)) == "slow"


def test_run_under_autotune_caches_only_a_tuned_decision(monkeypatch):
    monkeypatch.setenv("PRIMUS_TURBO_AUTO_TUNE", "1")
    monkeypatch.setattr(backend_mod, "_tuning_forbidden", lambda kwargs: True)
    assert _ToyGemmDispatcher.run(BF16, x=torch.ones(12)) == "fast"  # the default while tuning is forbidden
    assert len(_ToyGemmDispatcher._resolved) == 0
    monkeypatch.setattr(backend_mod, "_tuning_forbidden", lambda kwargs: False)
    monkeypatch.setattr(backend_mod, "_time_candidates", lambda fns, *args: {b: 1.0 for b in fns})
    assert _ToyGemmDispatcher.run(BF16, x=torch.ones(12)) == "fast"
    assert (
        _ToyGemmDispatcher._cache.get((12,)) is BackendType.TRITON and len(_ToyGemmDispatcher._resolved) == 1
    )
    monkeypatch.setenv("PRIMUS_TURBO_AUTO_TUNE", "0")  # the switch is part of the settings token
    assert GlobalBackendManager.settings_token("gemm")[2] in ("0", b"0")


def test_settings_token_sees_environment_changes(monkeypatch):
    before = GlobalBackendManager.settings_token("grouped_gemm")
    monkeypatch.setenv("PRIMUS_TURBO_GROUPED_GEMM_BACKEND", "TRITON")
    after = GlobalBackendManager.settings_token("grouped_gemm")
    assert before != after and after[1] in ("TRITON", b"TRITON")
    GlobalBackendManager.set_auto_tune(None)
    assert GlobalBackendManager.settings_token("grouped_gemm")[0] == after[0] + 1
