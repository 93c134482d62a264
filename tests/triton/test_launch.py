"""``cached_launch``: its key is never coarser than Triton's own specialization, its binding matches
Triton's, and its launch path (cache hit, miss, fallbacks, check mode) calls the compiled kernel the way
Triton does. The CPU tests build a real ``JITFunction`` and stand a recording fake in for the compiled
kernel; the GPU test launches real kernels both ways and compares the results."""

from __future__ import annotations

import itertools
import types

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction, create_function_from_signature

from primus_turbo.common.constants import ENV_TRITON_LAUNCH_CHECK, ENV_TRITON_LAUNCHER
from primus_turbo.triton.utils import launch


def _copy(x_ptr, y_ptr, n, scale, flag, BLOCK: tl.constexpr, OPT: tl.constexpr = 3, extra=None):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * scale, mask=mask)


def _one(x):
    pass


def _triton_spec(fn: JITFunction, *args, **kwargs):
    """Triton's own (bound values, specialization, options) of a call, with the backend-neutral rules."""
    binder = create_function_from_signature(fn.signature, fn.params, BaseBackend)
    params, spec, options = binder(*args, **kwargs)
    return list(params.values()), spec, options


def _samples() -> list[object]:
    base = torch.zeros(64)
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**32, 2**63 - 1]
    ints += [2**63, 2**64 - 1]
    tensors = [base, base[1:], base[4:], base.to(torch.bfloat16), base.to(torch.bfloat16)[8:]]
    tensors += [base.to(torch.int64), torch.nn.Parameter(base.clone())]
    return [*ints, 0.0, 1.5, -2.0, True, False, None, *tensors]


def test_key_is_never_coarser_than_triton_specialization():
    """Any two arguments that share a cached_launch key share Triton's specialization."""
    fn = JITFunction(_one)
    binder = launch._make_binder(fn)
    samples = _samples()
    keys = [binder(v)[1] for v in samples]
    specs = [_triton_spec(fn, v)[1] for v in samples]
    for (ka, sa), (kb, sb) in itertools.combinations(zip(keys, specs, strict=True), 2):
        if ka == kb:
            assert sa == sb


@pytest.mark.parametrize(
    "args,kwargs",
    [
        ((torch.zeros(8), torch.zeros(8), 8, 1.0, True, 64), {}),
        ((torch.zeros(8), torch.zeros(8), 8, 1.0, True), {"BLOCK": 64, "num_warps": 4}),
        ((torch.zeros(8),), {"y_ptr": torch.zeros(8), "n": 8, "scale": 2.0, "flag": False, "BLOCK": 32}),
        ((torch.zeros(8), torch.zeros(8), 8, 1.0, True, 64, 5, torch.zeros(2)), {"num_stages": 2}),
    ],
)
def test_binder_matches_triton(args, kwargs):
    """Values in signature order with defaults filled and the options are Triton's."""
    fn = JITFunction(_copy)
    values, _, options = launch._make_binder(fn)(*args, **kwargs)
    expected_values, _, expected_options = _triton_spec(fn, *args, **kwargs)
    assert len(values) == len(expected_values)
    assert all(a is b for a, b in zip(values, expected_values, strict=True))
    assert options == expected_options


class _FakeCompiled:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.function = object()
        self.packed_metadata = object()

    def run(self, *args) -> None:
        self.calls.append(args)


@pytest.fixture
def fake_kernel(monkeypatch):
    """A cached_launch wrapper around a real JITFunction whose ``run`` records instead of compiling."""
    monkeypatch.setenv(ENV_TRITON_LAUNCHER, "cached")
    monkeypatch.delenv(ENV_TRITON_LAUNCH_CHECK, raising=False)
    monkeypatch.setattr(launch, "_current_device", lambda: 0)
    monkeypatch.setattr(launch, "_raw_stream", lambda device: 1234)
    fn = JITFunction(_copy)
    runs: list[dict] = []
    compiled: list[_FakeCompiled] = []

    def run(*args, grid, warmup, **kwargs):
        runs.append({"args": args, "grid": grid, "warmup": warmup, "kwargs": kwargs})
        if warmup:
            return compiled[-1] if compiled else None
        compiled.append(_FakeCompiled())
        return compiled[-1]

    fn.run = run
    return launch.cached_launch(fn), runs, compiled


def test_cached_launch_reuses_the_compiled_kernel(fake_kernel):
    kernel, runs, compiled = fake_kernel
    x, y = torch.zeros(64), torch.zeros(64)
    kernel[(4,)](x, y, 64, 2.0, True, BLOCK=16, num_warps=4)
    assert len(runs) == 1 and not runs[0]["warmup"]
    kernel[(4, 2)](x, y, 64, 2.0, True, BLOCK=16, num_warps=4)
    assert len(runs) == 1
    (call,) = compiled[0].calls
    assert call[:9] == (4, 2, 1, 1234, compiled[0].function, compiled[0].packed_metadata, None, None, None)
    assert call[9:] == (x, y, 64, 2.0, True, 16, 3, None)


@pytest.mark.parametrize(
    "change",
    [
        lambda x, y: ((x[1:], y, 64, 2.0, True), {"BLOCK": 16, "num_warps": 4}),  # misaligned pointer
        lambda x, y: ((x.double(), y, 64, 2.0, True), {"BLOCK": 16, "num_warps": 4}),  # dtype
        lambda x, y: ((x, y, 1, 2.0, True), {"BLOCK": 16, "num_warps": 4}),  # n == 1 is a constant
        lambda x, y: ((x, y, 63, 2.0, True), {"BLOCK": 16, "num_warps": 4}),  # not divisible by 16
        lambda x, y: ((x, y, 2**40, 2.0, True), {"BLOCK": 16, "num_warps": 4}),  # i64
        lambda x, y: ((x, y, 64, 2.0, True), {"BLOCK": 32, "num_warps": 4}),  # constexpr
        lambda x, y: ((x, y, 64, 2.0, True), {"BLOCK": 16, "num_warps": 8}),  # option
        lambda x, y: ((x, y, 64, 2.0, True), {"BLOCK": 16, "num_warps": 4, "extra": x}),  # None -> tensor
    ],
)
def test_a_new_specialization_goes_through_triton(fake_kernel, change):
    kernel, runs, _ = fake_kernel
    x, y = torch.zeros(64), torch.zeros(64)
    kernel[(4,)](x, y, 64, 2.0, True, BLOCK=16, num_warps=4)
    args, kwargs = change(x, y)
    kernel[(4,)](*args, **kwargs)
    assert len(runs) == 2


@pytest.mark.parametrize(
    "case",
    ["callable grid", "unkeyed argument", "unhashable option", "triton mode", "launch hook"],
)
def test_fallbacks_go_through_triton(fake_kernel, monkeypatch, case):
    kernel, runs, _ = fake_kernel
    x, y = torch.zeros(64), torch.zeros(64)
    grid, args, kwargs = (4,), (x, y, 64, 2.0, True), {"BLOCK": 16}
    if case == "callable grid":
        grid = lambda meta: (4,)  # noqa: E731
    elif case == "unkeyed argument":
        args = (x, y, (64, 64), 2.0, True)
    elif case == "unhashable option":
        kwargs["maxnreg"] = [1]
    elif case == "triton mode":
        monkeypatch.setenv(ENV_TRITON_LAUNCHER, "triton")
    else:
        hook = launch._knobs.runtime.launch_enter_hook
        if hook is None or not hasattr(hook, "add"):
            pytest.skip("this Triton's launch hook is not a HookChain")
        monkeypatch.setattr(hook, "calls", [lambda metadata: None])
    for _ in range(3):
        kernel[grid](*args, **kwargs)
    assert len(runs) == 3


def test_check_mode_catches_a_stale_kernel(fake_kernel, monkeypatch):
    kernel, runs, compiled = fake_kernel
    x, y = torch.zeros(64), torch.zeros(64)
    kernel[(4,)](x, y, 64, 2.0, True, BLOCK=16)
    monkeypatch.setenv(ENV_TRITON_LAUNCH_CHECK, "1")
    kernel[(4,)](x, y, 64, 2.0, True, BLOCK=16)  # Triton agrees: the cached kernel
    assert runs[-1]["warmup"] and len(compiled[0].calls) == 1
    compiled.append(_FakeCompiled())  # Triton would now pick another kernel
    with pytest.raises(RuntimeError, match="would not run"):
        kernel[(4,)](x, y, 64, 2.0, True, BLOCK=16)


def test_bad_launcher_mode(monkeypatch):
    monkeypatch.setenv(ENV_TRITON_LAUNCHER, "aot")
    with pytest.raises(ValueError, match="PRIMUS_TURBO_TRITON_LAUNCHER must be one of"):
        launch.launcher_mode()
    monkeypatch.setenv(ENV_TRITON_LAUNCHER, " Cached ")
    assert launch.launcher_mode() == "cached"


def test_knob_state_follows_code_and_environment(monkeypatch):
    """The launch key's knob part changes with a Triton knob set in code or through its variable, whether
    the knob is one of Triton's environment descriptors or a plain attribute."""
    knobs = pytest.importorskip("triton.knobs")
    if not hasattr(knobs, "env_bool"):
        pytest.skip("this Triton has no environment knobs")

    class Owner:
        flag = knobs.env_bool("PRIMUS_TURBO_TEST_KNOB")

    owner = Owner()
    monkeypatch.delenv("PRIMUS_TURBO_TEST_KNOB", raising=False)
    read = launch._knob_reader(owner, "flag")
    unset = read()
    monkeypatch.setenv("PRIMUS_TURBO_TEST_KNOB", "1")
    from_env = read()
    assert from_env != unset and owner.flag
    owner.flag = False  # Triton also writes the variable
    assert read() not in (unset, from_env) and not owner.flag
    plain = types.SimpleNamespace(mode="a")
    read_plain = launch._knob_reader(plain, "mode")
    assert read_plain() == "a"
    plain.mode = "b"
    assert read_plain() == "b"
    assert launch._knob_reader(plain, "missing")() is None


def test_non_jit_functions_pass_through():
    assert launch.cached_launch(_one) is _one


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * scale, mask=mask)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 100, 4096])
def test_cached_launch_on_the_gpu(monkeypatch, n):
    """Both launchers write the same result; the check mode agrees with Triton on every cached launch."""
    kernel = launch.cached_launch(_scale_kernel)
    x = torch.randn(n + 1, device="cuda")
    for mode in ("triton", "cached"):
        monkeypatch.setenv(ENV_TRITON_LAUNCHER, mode)
        monkeypatch.setenv(ENV_TRITON_LAUNCH_CHECK, "1")
        for src in (x[:n], x[1:]):  # aligned, then misaligned
            for _ in range(3):
                y = torch.empty(n, device="cuda")
                kernel[(triton.cdiv(n, 256),)](src, y, n, 3.0, BLOCK=256)
                torch.testing.assert_close(y, src * 3.0, rtol=0, atol=0)
