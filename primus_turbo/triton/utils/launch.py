"""A lower-overhead launch path for ``@triton.jit`` kernels: ``@cached_launch``.

``kernel[grid](*args, **kwargs)`` through Triton's ``JITFunction.run`` binds the arguments, asks Triton's
specializer about every one of them, builds a string key from the specialization and the options, looks
the compiled kernel up, builds launch metadata and then launches. ``cached_launch`` keeps the call site
unchanged and does less per call: it computes its own key in one pass over the arguments and, once a key
has been seen, launches the cached ``CompiledKernel`` through the same entry Triton uses
(``compiled.run(grid..., stream, function, packed_metadata, None, None, None, *args)``).

The key is finer than Triton's specialization, never coarser: a tensor by (dtype, 16-byte alignment[, on
ROCm whether its storage is under 2 GiB]), an int by (== 1, divisible by 16, the i32 / i64 / u64 range), a
float or bool by type, a constexpr parameter and every launch option by value, plus the device and Triton's
debug / instrumentation knobs. Two calls with the same key therefore compile to the same kernel; a new key
launches through Triton once and caches what Triton returned. Host TMA descriptors are keyed by dtype,
block shape, layout, padding and base alignment. Calls the key does not cover (tuples, other objects,
callable grids), launch hooks (profilers), ``pre_run_hooks`` and the interpreter go through Triton
unchanged.

``PRIMUS_TURBO_TRITON_LAUNCHER`` picks the path: ``triton`` (the default) or ``cached``. With
``PRIMUS_TURBO_TRITON_LAUNCH_CHECK=1`` every cached launch first asks Triton (``warmup=True``) which kernel
it would have run and raises if that differs from the cached one; the GPU suite runs with it.
Unlike Triton's launcher, the cached path does not re-check that the kernel's global constants kept
their values (they are module constants here).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from primus_turbo.common.constants import ENV_TRITON_LAUNCH_CHECK, ENV_TRITON_LAUNCHER
from primus_turbo.common.env import env_reader

__all__ = ["CachedLaunchKernel", "cached_launch", "launcher_mode"]

try:
    from triton import knobs as _knobs
    from triton.runtime.jit import JITFunction as _JITFunction
except ImportError:  # Triton without knobs (< 3.4): every launch goes through Triton
    _knobs = None
    _JITFunction = None

_Tensor = torch.Tensor
_EMPTY = inspect.Parameter.empty
_I32_MIN, _I32_MAX, _U64_MIN = -(2**31), 2**31 - 1, 2**63
_HIP = torch.version.hip is not None
_HIP_BUFFER_LIMIT = 2**31 - 1
_OPTION_KNOBS = ("instrumentation_mode", "fpsan_homomorphic_casts")
_MODES = ("triton", "cached")
# CUDA's current device and raw stream without torch.cuda's Python wrappers (a launch has initialised CUDA)
_current_device = getattr(torch._C, "_cuda_getDevice", None)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


_launcher_env = env_reader(ENV_TRITON_LAUNCHER)
_launch_check_env = env_reader(ENV_TRITON_LAUNCH_CHECK)


def launcher_mode() -> str:
    """``triton`` or ``cached``, from ``PRIMUS_TURBO_TRITON_LAUNCHER`` (read every call)."""
    mode = _launcher_env()
    if mode is None:
        return "triton"
    if mode in _MODES:
        return mode
    mode = mode.strip().lower() or "triton"
    if mode not in _MODES:
        raise ValueError(f"{ENV_TRITON_LAUNCHER} must be one of {_MODES}, got {mode!r}")
    return mode


def _hooks_idle() -> bool:
    """No launch hook is installed (a hook is None, or an empty ``HookChain`` in Triton >= 3.5)."""
    runtime = _knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


_UNSET = object()


def _knob_reader(owner: Any, name: str) -> Callable[[], Any]:
    """A reader of what Triton knob ``owner.name`` depends on: the value set in code (or none) and its
    environment variable, read raw; equal results mean an equal knob value. A knob that is not one of
    Triton's environment descriptors is read through its attribute."""
    descriptor = next((k.__dict__[name] for k in type(owner).__mro__ if name in k.__dict__), None)
    variable = getattr(descriptor, "key", None)
    if not isinstance(variable, str):
        return functools.partial(getattr, owner, name, None)
    state, env = owner.__dict__, env_reader(variable)
    return lambda: (state.get(name, _UNSET), env())


@functools.cache
def _knob_readers() -> tuple[Callable[[], Any], ...]:
    return (
        _knob_reader(_knobs.runtime, "debug"),
        *(_knob_reader(_knobs.compilation, name) for name in _OPTION_KNOBS),
    )


def _knob_state() -> tuple:
    """The knobs Triton folds into a kernel's options on every launch (what their values depend on)."""
    return tuple(read() for read in _knob_readers())


def _tensor_key(t: torch.Tensor) -> tuple:
    aligned = not t.data_ptr() & 15
    if _HIP:
        return t.dtype, aligned, t.untyped_storage().nbytes() <= _HIP_BUFFER_LIMIT
    return t.dtype, aligned


def _arg_key(value: Any) -> Any:
    """A hashable key at least as fine as Triton's specialization of a non-constexpr argument."""
    cls = type(value)
    if cls is _Tensor or cls is torch.nn.Parameter:
        return _tensor_key(value)
    if cls is int:
        return (value == 1, not value % 16, _I32_MIN <= value <= _I32_MAX, value < _U64_MIN)
    if cls is float or cls is bool:
        return cls
    if value is None:
        return None
    if hasattr(value, "block_shape") and hasattr(value, "base"):  # a host TMA descriptor (Triton or Gluon)
        base = value.base
        layout, padding = getattr(value, "layout", None), getattr(value, "padding", None)
        return cls, base.dtype, tuple(value.block_shape), layout, padding, not base.data_ptr() & 15
    raise TypeError(f"cached_launch does not key {cls.__name__} arguments")


def _make_binder(fn: Any) -> Callable[..., tuple]:
    """A function of the kernel's own signature returning (every parameter's value in order, the key of
    the values, the launch options): one generated expression per parameter, no per-call loop."""
    namespace: dict[str, Any] = {"_pt_key": _arg_key, "_pt_tensor": _Tensor, "_pt_int": int}
    params, values, keys = [], [], []
    for i, (param, kp) in enumerate(zip(fn.signature.parameters.values(), fn.params, strict=True)):
        name = param.name
        if param.default is _EMPTY:
            params.append(name)
        else:
            namespace[f"_pt_default{i}"] = param.default
            params.append(f"{name}=_pt_default{i}")
        values.append(name)
        if kp.is_constexpr:
            keys.append(name)
        elif _HIP:
            keys.append(f"_pt_key({name})")
        else:
            tensor_key = f"({name}.dtype, not {name}.data_ptr() & 15)"
            int_key = (
                f"({name} == 1, not {name} % 16, {_I32_MIN} <= {name} <= {_I32_MAX}, {name} < {_U64_MIN})"
            )
            keys.append(
                f"({tensor_key} if type({name}) is _pt_tensor else "
                f"{int_key} if type({name}) is _pt_int else _pt_key({name}))"
            )
    source = (
        f"def bind({', '.join([*params, '**_pt_options'])}):\n"
        f"    return ({', '.join(values)},), ({', '.join(keys)},), _pt_options\n"
    )
    exec(source, namespace)  # noqa: S102 - the source is built from the kernel's parameter names only
    return namespace["bind"]


class CachedLaunchKernel:
    """A ``JITFunction`` whose ``kernel[grid](...)`` launches through a per-key cache of compiled kernels.

    Every other attribute (``fn``, ``run``, ``warmup``, ``cache``...) is the wrapped ``JITFunction``'s, so
    ``triton.autotune`` and ``triton.heuristics`` may wrap it too."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self._bind = _make_binder(fn)
        self._cache: dict[tuple, tuple[Callable[..., Any], Any, Any, Any]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fn, name)

    def __repr__(self) -> str:
        return f"cached_launch({self.fn!r})"

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        if launcher_mode() != "cached":
            return self.fn[grid]
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch_key(self, args: tuple, kwargs: dict) -> tuple[tuple, tuple]:
        """(every parameter's value in signature order, the cache key of this call); raises TypeError
        for a call the cached path does not key."""
        values, spec, options = self._bind(*args, **kwargs)
        return values, (_current_device(), _knob_state(), tuple(sorted(options.items())), spec)

    def launch(self, grid: Any, args: tuple, kwargs: dict) -> Any:
        """Launch on ``grid`` in the cached mode (``__getitem__`` checked it): from the cache where the key
        is known, else through Triton."""
        fn = self.fn
        if callable(grid) or getattr(fn, "pre_run_hooks", None) or not _hooks_idle():
            return fn.run(*args, grid=grid, warmup=False, **kwargs)
        try:
            values, key = self.launch_key(args, kwargs)
            entry = self._cache.get(key)
        except TypeError:  # an unkeyed argument type, an unhashable constexpr or option, a missing argument
            return fn.run(*args, grid=grid, warmup=False, **kwargs)
        if entry is None:
            compiled = fn.run(*args, grid=grid, warmup=False, **kwargs)
            if compiled is not None and not hasattr(compiled, "result"):  # not an async-compile future
                self._cache[key] = (compiled.run, compiled.function, compiled.packed_metadata, compiled)
            return compiled
        if _launch_check_env() == "1":
            self._check(entry, key, args, kwargs)
        run, function, metadata, compiled = entry
        size = len(grid)
        run(
            grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1,
            _raw_stream(key[0]), function, metadata, None, None, None, *values,
        )  # fmt: skip
        return compiled

    def _check(self, entry: tuple, key: tuple, args: tuple, kwargs: dict) -> None:
        expected = self.fn.run(*args, grid=None, warmup=True, **kwargs)
        if expected is not entry[3]:
            raise RuntimeError(
                f"cached_launch of {self.fn!r}: key {key} names a kernel that Triton would not run for "
                f"these arguments (unset {ENV_TRITON_LAUNCHER} to launch through Triton)"
            )


def cached_launch(fn: Any) -> Any:
    """Decorate a launched ``@triton.jit`` kernel (above ``@triton.jit``, below any autotuner) so
    ``kernel[grid](...)`` may skip Triton's per-call binding; the interpreter's kernels pass through."""
    if _JITFunction is None or not isinstance(fn, _JITFunction):
        return fn
    return CachedLaunchKernel(fn)
