"""Test setup: markers, run modes, one GPU per xdist worker, and the Triton-interpreter CPU path.

Without a GPU, Triton kernels run under ``TRITON_INTERPRET=1``. The interpreter in triton 3.7-3.9 has two
numerics bugs that are not ours, corrected here (tests only): bf16 ``tl.dot`` operands are multiplied as
raw 16-bit patterns, and casts to fp8 (and from fp32 to bf16) drop the mantissa carry instead of rounding
to nearest even.
"""

from __future__ import annotations

import os

import pytest


def _visible_gpu_count() -> int:
    try:
        import torch

        return torch.cuda._device_count_nvml() if torch.version.cuda else torch.cuda._device_count_amdsmi()
    except Exception:
        return 0


def _pin_worker_gpu() -> None:
    """Give each xdist worker its own GPU before anything initialises CUDA."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return
    count = _visible_gpu_count()
    if count > 1:
        index = str(int(worker[2:]) % count)
        os.environ["CUDA_VISIBLE_DEVICES"] = index
        os.environ["HIP_VISIBLE_DEVICES"] = index


_pin_worker_gpu()
# One Triton config per kernel: tests check numerics, the benchmark checks every tuned config.
os.environ.setdefault("PRIMUS_TURBO_TRITON_AUTOTUNE", "0")

import torch  # noqa: E402

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_triton_interpreter() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_primus_turbo_patched", False):
        return
    original_dot = builder.create_dot
    original_fp_to_fp = builder.create_fp_to_fp
    original_cast = builder.cast_impl

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            a = self.cast_impl(a, tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = self.cast_impl(b, tl.float32)
        return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    to_torch = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16}
    fp8_targets = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        dst = dst_type.scalar
        src_dtype = to_torch.get(src.dtype.scalar)
        if dst not in fp8_targets or src_dtype is None:
            return original_fp_to_fp(self, src, dst_type, rounding_mode)
        values = torch.from_numpy(src.data.copy()).view(src_dtype)
        converted = values.to(fp8_targets[dst]).view(torch.uint8).numpy()
        return interpreter.TensorHandle(converted, dst)

    def cast_impl(self, src, dst_type):
        if not (src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16):
            return original_cast(self, src, dst_type)
        values = torch.from_numpy(src.data.copy()).to(torch.bfloat16)
        return interpreter.TensorHandle(values.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)

    builder.create_dot = create_dot
    builder.create_fp_to_fp = create_fp_to_fp
    builder.cast_impl = cast_impl
    builder._primus_turbo_patched = True


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_triton_interpreter()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--deterministic-only", action="store_true", help="run only @pytest.mark.deterministic tests"
    )
    parser.addoption("--dist-only", action="store_true", help="run only multi-process (multigpu) tests")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--deterministic-only") and config.getoption("--dist-only"):
        raise pytest.UsageError("--deterministic-only and --dist-only cannot be combined")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    deterministic_only = config.getoption("--deterministic-only")
    dist_only = config.getoption("--dist-only")
    under_xdist = os.environ.get("PYTEST_XDIST_WORKER") is not None
    for item in items:
        is_det = item.get_closest_marker("deterministic") is not None
        is_dist = item.get_closest_marker("multigpu") is not None
        if deterministic_only and not is_det:
            item.add_marker(pytest.mark.skip(reason="--deterministic-only"))
        elif dist_only and not is_dist:
            item.add_marker(pytest.mark.skip(reason="--dist-only"))
        elif is_det and not deterministic_only:
            item.add_marker(pytest.mark.skip(reason="deterministic tests run with --deterministic-only"))
        elif is_dist and under_xdist:
            item.add_marker(
                pytest.mark.skip(reason="multi-process tests do not run under xdist; use --dist-only")
            )
        if item.get_closest_marker("gpu") is not None and not HAS_GPU:
            item.add_marker(pytest.mark.skip(reason="needs a GPU"))
