"""Backend selection: which kernel implementation runs each call.

Priority, high to low: code setter (``GlobalBackendManager.set_*_backend``) -> environment variable
(``PRIMUS_TURBO_GEMM_BACKEND`` and friends) -> autotune (``PRIMUS_TURBO_AUTO_TUNE=1``,
``set_auto_tune(True)`` or an ``autotune`` slot in the variable) -> the op's default -> the first
registered backend whose ``can_handle`` accepts the call. A pinned backend that cannot handle a call
raises ``ValueError``; it is never swapped silently.

Eager calls resolve once per (op, precision, resolution key) and reuse the decision
(``AutoKernelDispatcher.run``) until a setter, ``reset`` or the op's environment variables change.
"""

from __future__ import annotations

import functools
import logging
import math
import statistics
import time
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

import torch

from primus_turbo.common.constants import (
    ENV_ASYNC_TP_BACKEND,
    ENV_ATTN_BACKEND,
    ENV_AUTO_TUNE,
    ENV_GEMM_BACKEND,
    ENV_GROUPED_GEMM_BACKEND,
    ENV_MOE_DISPATCH_COMBINE_BACKEND,
)
from primus_turbo.common.env import env_reader
from primus_turbo.common.logger import get_logger, log_once

__all__ = [
    "AutoKernelDispatcher",
    "BackendChoice",
    "BackendType",
    "GlobalBackendManager",
    "KernelBackend",
    "PrecisionType",
    "TuneCache",
    "parse_backend_spec",
    "precision_of",
]

_log = get_logger(__name__)


class BackendType(Enum):
    """Kernel providers. ``HIPBLASLT`` is the vendor BLASLt reached through torch (cuBLASLt on CUDA)."""

    HIPBLASLT = "HIPBLASLT"
    TRITON = "TRITON"
    CK = "CK"
    AITER = "AITER"
    TURBO = "TURBO"
    DEEP_EP = "DEEP_EP"
    FLYDSL = "FLYDSL"
    TORCH = "TORCH"
    FLASH_ATTN = "FLASH_ATTN"

    # Enum's own __hash__ stays: torch 2.11's dynamo refuses to hash enums that override it, and attention
    # resolves its backend in traced code (compile tests on the GPU).


class PrecisionType(Enum):
    """The precision slot a backend setting applies to."""

    FP4 = "FP4"
    FP8 = "FP8"
    BF16_FP16_FP32 = "BF16_FP16_FP32"


_PRECISION_NAMES: dict[str, PrecisionType | None] = {
    "fp4": PrecisionType.FP4,
    "fp8": PrecisionType.FP8,
    "bf16": PrecisionType.BF16_FP16_FP32,
    "fp16": PrecisionType.BF16_FP16_FP32,
    "fp32": PrecisionType.BF16_FP16_FP32,
    "other": None,
}
_AUTOTUNE = "autotune"


def precision_of(dtype: torch.dtype) -> PrecisionType:
    """The precision slot of an operand dtype."""
    if dtype in (torch.float16, torch.bfloat16, torch.float32):
        return PrecisionType.BF16_FP16_FP32
    if dtype.itemsize == 1 and dtype.is_floating_point:
        return PrecisionType.FP8
    if dtype == getattr(torch, "float4_e2m1fn_x2", None):
        return PrecisionType.FP4
    raise TypeError(f"no backend precision slot for dtype {dtype}")


@dataclass(frozen=True)
class BackendChoice:
    """A user's choice for one op and precision: a pinned backend, or autotune."""

    backend: BackendType | None = None
    auto_tune: bool = False

    def __post_init__(self) -> None:
        if self.backend is not None and self.auto_tune:
            raise ValueError("choose either a backend or auto_tune=True, not both")


def _backend_from_name(name: str, source: str) -> BackendType:
    try:
        return BackendType[name.strip().upper()]
    except KeyError:
        valid = ", ".join(b.name for b in BackendType)
        raise ValueError(f"{source}: unknown backend {name.strip()!r}; valid backends: {valid}") from None


def _choice_from_name(name: str, source: str, allow_autotune: bool) -> BackendChoice:
    if name.strip().lower() == _AUTOTUNE:
        if not allow_autotune:
            raise ValueError(f"{source}: 'autotune' is not supported for this op")
        return BackendChoice(auto_tune=True)
    return BackendChoice(backend=_backend_from_name(name, source))


@functools.lru_cache(maxsize=64)
def parse_backend_spec(
    spec: str, source: str = "backend spec", allow_autotune: bool = True
) -> dict[PrecisionType | None, BackendChoice]:
    """Parse ``TRITON``, ``autotune`` or ``fp8:TRITON,other:HIPBLASLT`` (case-insensitive).

    The key ``None`` holds the choice for every precision not listed (a bare name or ``other:``).
    """
    spec = spec.strip()
    if not spec:
        return {}
    if ":" not in spec:
        return {None: _choice_from_name(spec, source, allow_autotune)}
    table: dict[PrecisionType | None, BackendChoice] = {}
    for item in spec.split(","):
        if not item.strip():
            continue
        prec_name, sep, backend_name = item.partition(":")
        prec_key = prec_name.strip().lower()
        if not sep or prec_key not in _PRECISION_NAMES:
            valid = ", ".join(_PRECISION_NAMES)
            raise ValueError(
                f"{source}: bad entry {item.strip()!r}; "
                f"expected <precision>:<backend>, precision one of {valid}"
            )
        precision = _PRECISION_NAMES[prec_key]
        choice = _choice_from_name(backend_name, source, allow_autotune)
        if table.get(precision, choice) != choice:
            raise ValueError(f"{source}: precision {prec_key!r} is given two different backends")
        table[precision] = choice
    return table


class GlobalBackendManager:
    """Process-wide backend settings per op and precision; code settings win over the environment."""

    _ENV_BY_OP: ClassVar[dict[str, str]] = {
        "gemm": ENV_GEMM_BACKEND,
        "grouped_gemm": ENV_GROUPED_GEMM_BACKEND,
        "attn": ENV_ATTN_BACKEND,
        "moe_dispatch_combine": ENV_MOE_DISPATCH_COMBINE_BACKEND,
        "async_tp": ENV_ASYNC_TP_BACKEND,
    }
    # collective ops: ranks timing on their own could pick different backends and wait on each other forever
    _NO_AUTOTUNE_OPS: ClassVar[frozenset[str]] = frozenset({"moe_dispatch_combine", "async_tp"})
    _code: ClassVar[dict[str, dict[PrecisionType, BackendChoice]]] = {}
    _auto_tune: ClassVar[bool | None] = None
    # bumped by every setter and reset: cached backend decisions made under older settings are stale
    _generation: ClassVar[int] = 0
    _env_readers: ClassVar[dict[str, Callable[[], Any]]] = {}
    _auto_tune_env: ClassVar[Callable[[], Any]] = env_reader(ENV_AUTO_TUNE)

    @classmethod
    def settings_token(cls, op: str) -> tuple[int, Any, Any]:
        """What every backend decision for ``op`` depends on beyond the call itself: equal tokens mean
        a decision made earlier still holds."""
        return cls._generation, cls._reader(op)(), cls._auto_tune_env()

    @classmethod
    def _reader(cls, op: str) -> Callable[[], str | None]:
        """The reader of ``op``'s ``PRIMUS_TURBO_*_BACKEND`` variable."""
        reader = cls._env_readers.get(op)
        if reader is None:
            reader = cls._env_readers[op] = env_reader(cls._ENV_BY_OP[op])
        return reader

    @classmethod
    def set_backend(
        cls,
        op: str,
        backend: BackendType | str | None = None,
        precision: PrecisionType | None = None,
        auto_tune: bool = False,
    ) -> None:
        """Pin ``backend`` (or autotune) for ``op``; ``precision=None`` means every precision.

        ``backend=None`` with ``auto_tune=False`` clears the setting for that precision (all when None).
        """
        if op not in cls._ENV_BY_OP:
            raise ValueError(f"unknown op {op!r}; valid ops: {', '.join(cls._ENV_BY_OP)}")
        if precision is not None and not isinstance(precision, PrecisionType):
            raise TypeError(f"precision must be a PrecisionType or None, got {precision!r}")
        if isinstance(backend, str):
            backend = _backend_from_name(backend, f"set_{op}_backend")
        elif backend is not None and not isinstance(backend, BackendType):
            raise TypeError(f"backend must be a BackendType, a name or None, got {backend!r}")
        if auto_tune and op in cls._NO_AUTOTUNE_OPS:
            raise ValueError(f"autotune is not supported for {op}")
        cls._generation += 1
        table = cls._code.setdefault(op, {})
        if backend is None and not auto_tune:
            if precision is None:
                table.clear()
            else:
                table.pop(precision, None)
            return
        choice = BackendChoice(backend=backend, auto_tune=auto_tune)
        for slot in PrecisionType if precision is None else (precision,):
            table[slot] = choice

    @classmethod
    def get_backend(cls, op: str, precision: PrecisionType) -> BackendChoice | None:
        """The user's choice for ``op`` at ``precision``, or None to let the op decide."""
        code_table = cls._code.get(op)
        if code_table:
            return code_table.get(precision)
        env_name = cls._ENV_BY_OP[op]
        spec = cls._reader(op)() or ""
        if not spec.strip():
            return None
        table = parse_backend_spec(spec, env_name, op not in cls._NO_AUTOTUNE_OPS)
        choice = table.get(precision, table.get(None))
        if choice is None:
            log_once(
                _log,
                logging.WARNING,
                f"{env_name}={spec!r} names no backend for {precision.name} and has no 'other' entry; "
                "using the op default",
            )
        return choice

    @classmethod
    def set_gemm_backend(
        cls,
        backend: BackendType | str | None = None,
        precision: PrecisionType | None = None,
        auto_tune: bool = False,
    ) -> None:
        cls.set_backend("gemm", backend, precision, auto_tune)

    @classmethod
    def get_gemm_backend(cls, precision: PrecisionType) -> BackendChoice | None:
        return cls.get_backend("gemm", precision)

    @classmethod
    def set_grouped_gemm_backend(
        cls,
        backend: BackendType | str | None = None,
        precision: PrecisionType | None = None,
        auto_tune: bool = False,
    ) -> None:
        cls.set_backend("grouped_gemm", backend, precision, auto_tune)

    @classmethod
    def get_grouped_gemm_backend(cls, precision: PrecisionType) -> BackendChoice | None:
        return cls.get_backend("grouped_gemm", precision)

    @classmethod
    def set_attn_backend(
        cls,
        backend: BackendType | str | None = None,
        precision: PrecisionType | None = None,
        auto_tune: bool = False,
    ) -> None:
        cls.set_backend("attn", backend, precision, auto_tune)

    @classmethod
    def get_attn_backend(cls, precision: PrecisionType) -> BackendChoice | None:
        return cls.get_backend("attn", precision)

    @classmethod
    def set_moe_dispatch_combine_backend(
        cls, backend: BackendType | str | None = None, precision: PrecisionType | None = None
    ) -> None:
        cls.set_backend("moe_dispatch_combine", backend, precision)

    @classmethod
    def get_moe_dispatch_combine_backend(cls, precision: PrecisionType) -> BackendChoice | None:
        return cls.get_backend("moe_dispatch_combine", precision)

    @classmethod
    def set_async_tp_backend(
        cls, backend: BackendType | str | None = None, precision: PrecisionType | None = None
    ) -> None:
        cls.set_backend("async_tp", backend, precision)

    @classmethod
    def get_async_tp_backend(cls, precision: PrecisionType) -> BackendChoice | None:
        return cls.get_backend("async_tp", precision)

    @classmethod
    def set_auto_tune(cls, enabled: bool | None) -> None:
        """Turn autotune on or off for every op; ``None`` defers to ``PRIMUS_TURBO_AUTO_TUNE``."""
        if enabled is not None and not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool or None, got {enabled!r}")
        cls._generation += 1
        cls._auto_tune = enabled

    @classmethod
    def auto_tune_enabled(cls) -> bool:
        if cls._auto_tune is not None:
            return cls._auto_tune
        return (cls._auto_tune_env() or "0").strip().lower() in ("1", "true", "on", "yes")

    @classmethod
    def reset(cls) -> None:
        """Forget every code setting, the parsed environment and every autotune result."""
        cls._code.clear()
        cls._auto_tune = None
        cls._generation += 1
        parse_backend_spec.cache_clear()
        AutoKernelDispatcher.clear_all_caches()


class KernelBackend(ABC):
    """One implementation of one op. ``can_handle`` never raises; ``execute`` runs the call.

    Subclasses override ``unavailable_reason`` (platform-level: package or hardware missing) and
    ``unsupported_reason`` (call-level: dtype, layout, shape) to say why they decline.
    """

    autotune: ClassVar[bool] = True

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None

    @classmethod
    def unsupported_reason(cls, **kwargs: Any) -> str | None:
        return None

    @classmethod
    def decline_reason(cls, **kwargs: Any) -> str | None:
        """Why this backend cannot run the call, or None when it can."""
        try:
            return _cached_unavailable_reason(cls) or cls.unsupported_reason(**kwargs)
        except Exception as exc:  # can_handle must never raise
            return f"{type(exc).__name__}: {exc}"

    @classmethod
    def can_handle(cls, **kwargs: Any) -> bool:
        return cls.decline_reason(**kwargs) is None

    @staticmethod
    @abstractmethod
    def execute(**kwargs: Any) -> Any: ...


@functools.lru_cache(maxsize=None)
def _cached_unavailable_reason(backend_cls: type[KernelBackend]) -> str | None:
    return backend_cls.unavailable_reason()


class TuneCache:
    """A bounded LRU map from a call's tuning key to its fastest backend."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._data: OrderedDict[Hashable, BackendType] = OrderedDict()
        self._warned = False

    def get(self, key: Hashable) -> BackendType | None:
        value = self._data.get(key)
        if value is not None:
            self._data.move_to_end(key)
        return value

    def put(self, key: Hashable, value: BackendType) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        if len(self._data) > self.capacity:
            self._data.popitem(last=False)
            if not self._warned:
                self._warned = True
                _log.warning(
                    "autotune cache is full (%d entries): shapes change too often; evicting the oldest",
                    self.capacity,
                )

    def clear(self) -> None:
        self._data.clear()

    def __len__(self) -> int:
        return len(self._data)


def _tuning_forbidden(kwargs: dict[str, Any]) -> bool:
    """No timing while capturing a CUDA graph, tracing, or running on fake/meta tensors."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return True
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return True
    for value in kwargs.values():
        if isinstance(value, torch.Tensor) and (
            value.is_meta or isinstance(value, torch._subclasses.FakeTensor)
        ):
            return True
    return False


def _first_device(kwargs: dict[str, Any]) -> torch.device:
    for value in kwargs.values():
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def _elapsed_ms(fn: Callable[[], Any], calls: int, device: torch.device) -> float:
    """Milliseconds for ``calls`` back-to-back calls (CUDA events on a GPU, a host clock elsewhere)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) * 1e3


def _time_candidates(
    fns: dict[BackendType, Callable[[], Any]], device: torch.device, warmup: int, rounds: int, batch_ms: float
) -> dict[BackendType, float]:
    """Median per-call milliseconds of each function.

    Calls run in batches of about ``batch_ms`` so launch overhead overlaps device work as it does in
    training, and the candidates alternate round by round so clock and thermal drift hit all of them.
    A candidate that raises gets ``inf``.
    """
    timings = {backend: math.inf for backend in fns}
    calls: dict[BackendType, int] = {}
    for backend, fn in fns.items():
        try:
            for _ in range(warmup):
                fn()
            once = _elapsed_ms(fn, 1, device)
        except Exception as exc:
            _log.debug("autotune run of %s failed: %s", backend.name, exc)
            continue
        calls[backend] = max(1, min(100, int(batch_ms / max(once, 1e-3))))
    samples: dict[BackendType, list[float]] = {backend: [] for backend in calls}
    for _ in range(rounds):
        for backend, n in calls.items():
            samples[backend].append(_elapsed_ms(fns[backend], n, device) / n)
    timings.update({backend: statistics.median(values) for backend, values in samples.items()})
    return timings


class AutoKernelDispatcher:
    """Picks and runs one backend per call; each subclass serves one op.

    Subclasses set ``op_name``, ``backends`` (ordered: the fallback order), override ``make_key``
    (everything that changes the winner; never ``id(tensor)``) and optionally ``default_backend``
    and ``tuning_kwargs`` (scratch copies of buffers the op writes into).
    """

    op_name: ClassVar[str] = "op"
    # the GlobalBackendManager op whose settings this dispatcher follows ("gemm", "grouped_gemm", ...)
    settings_op: ClassVar[str] = ""
    backends: ClassVar[dict[BackendType, type[KernelBackend]]] = {}
    cache_capacity: ClassVar[int] = 1024
    warmup_iters: ClassVar[int] = 3
    tune_rounds: ClassVar[int] = 5
    tune_batch_ms: ClassVar[float] = 2.0
    # A challenger must beat the op's default by this fraction to replace it, so noise never flips it.
    tune_margin: ClassVar[float] = 0.01
    _cache: ClassVar[TuneCache]
    # resolve key -> (settings token, backend, its name, its execute)
    _resolved: ClassVar[dict[Hashable, tuple[tuple[int, Any, Any], BackendType, str, Callable[..., Any]]]]
    _last_selected: ClassVar[BackendType | None] = None
    _counts: ClassVar[Counter[str]]  # keyed by BackendType.value: a str hashes in C, an Enum in Python
    _subclasses: ClassVar[list[type[AutoKernelDispatcher]]] = []

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._cache = TuneCache(cls.cache_capacity)
        cls._resolved = {}
        cls._counts = Counter()
        AutoKernelDispatcher._subclasses.append(cls)

    @classmethod
    def clear_all_caches(cls) -> None:
        for sub in AutoKernelDispatcher._subclasses:
            sub._cache.clear()
            sub._resolved.clear()
            sub._counts.clear()
            sub._last_selected = None

    @classmethod
    def make_key(cls, **kwargs: Any) -> Hashable:
        raise NotImplementedError(f"{cls.__name__} must define make_key")

    @classmethod
    def resolve_key(cls, **kwargs: Any) -> Hashable:
        """Everything the backends' ``can_handle``, ``default_backend`` and ``make_key`` read: calls with
        equal keys (and unchanged settings) run on the same backend. Defaults to ``make_key``; override
        where a backend declines on something the tuning key leaves out (a dtype, an alignment)."""
        return cls.make_key(**kwargs)

    @classmethod
    def default_backend(cls, **kwargs: Any) -> BackendType | None:
        return None

    @classmethod
    def tuning_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Arguments for timing runs; override to swap buffers the op writes into for scratch copies."""
        return kwargs

    @classmethod
    def last_selected(cls) -> BackendType | None:
        """The backend the most recent call of this op ran on."""
        return cls._last_selected

    @classmethod
    def selection_counts(cls) -> dict[BackendType, int]:
        """How many calls of this op ran on each backend since the last reset."""
        return {BackendType(name): count for name, count in cls._counts.items()}

    @classmethod
    def _select(cls, backend: BackendType) -> BackendType:
        # ops that resolve their backend in traced code (attention) reach here while dynamo traces, which
        # records nothing: the selection is then part of the compiled graph, not a call
        if not torch.compiler.is_compiling():
            cls._last_selected = backend
            cls._counts[backend.value] += 1
        return backend

    @classmethod
    def _pinned(cls, backend: BackendType, kwargs: dict[str, Any]) -> BackendType:
        impl = cls.backends.get(backend)
        if impl is None:
            valid = ", ".join(b.name for b in cls.backends)
            raise ValueError(
                f"{cls.op_name}: backend {backend.name} is not implemented for this op; choose from {valid}"
            )
        reason = impl.decline_reason(**kwargs)
        if reason is not None:
            raise ValueError(
                f"{cls.op_name}: pinned backend {backend.name} cannot handle this call: {reason}"
            )
        return backend

    @classmethod
    def tune(cls, key: Hashable, kwargs: dict[str, Any]) -> BackendType | None:
        """Time every eligible backend on this call's shapes and cache the fastest."""
        candidates = [b for b, impl in cls.backends.items() if impl.autotune and impl.can_handle(**kwargs)]
        if not candidates:
            return None
        if len(candidates) == 1:
            timings = {candidates[0]: 0.0}
        else:
            tuning = cls.tuning_kwargs(kwargs)
            fns = {b: functools.partial(cls.backends[b].execute, **tuning) for b in candidates}
            with torch.no_grad():
                timings = _time_candidates(
                    fns, _first_device(kwargs), cls.warmup_iters, cls.tune_rounds, cls.tune_batch_ms
                )
        best = min(timings, key=timings.__getitem__)
        if math.isinf(timings[best]):
            return None
        default = cls.default_backend(**kwargs)
        if default in timings and timings[best] > timings[default] * (1 - cls.tune_margin):
            best = default
        cls._cache.put(key, best)
        _log.info(
            "%s autotune %s: %s -> %s",
            cls.op_name,
            key,
            ", ".join(f"{b.name}={t:.4f}ms" for b, t in timings.items()),
            best.name,
        )
        return best

    @classmethod
    def resolve(cls, user_choice: BackendChoice | None, **kwargs: Any) -> BackendType:
        """The backend this call runs on, following the priority order in the module docstring."""
        return cls._select(cls._decide(user_choice, kwargs)[0])

    @classmethod
    def _decide(cls, user_choice: BackendChoice | None, kwargs: dict[str, Any]) -> tuple[BackendType, bool]:
        """``(backend, final)``; not final when autotune is on but could not time this call (capture,
        tracing): a later call may tune and choose differently."""
        if user_choice is not None and user_choice.backend is not None:
            return cls._pinned(user_choice.backend, kwargs), True
        if (user_choice is not None and user_choice.auto_tune) or GlobalBackendManager.auto_tune_enabled():
            key = cls.make_key(**kwargs)
            selected = cls._cache.get(key)
            if selected is None and not _tuning_forbidden(kwargs):
                selected = cls.tune(key, kwargs)
                if selected is None:
                    return cls._fallback(kwargs), True
            if selected is not None:
                return selected, True
            return cls._fallback(kwargs), False
        return cls._fallback(kwargs), True

    @classmethod
    def _fallback(cls, kwargs: dict[str, Any]) -> BackendType:
        """The op's default where it can handle the call, else the first backend that can."""
        default = cls.default_backend(**kwargs)
        impl = cls.backends.get(default)
        if impl is not None and impl.can_handle(**kwargs):
            return default
        reasons = []
        for backend, impl in cls.backends.items():
            reason = impl.decline_reason(**kwargs)
            if reason is None:
                if default is not None:
                    log_once(
                        _log,
                        logging.WARNING,
                        f"{cls.op_name}: default backend {default.name} cannot handle a call; "
                        f"falling back to {backend.name}, which may be slower",
                    )
                return backend
            reasons.append(f"{backend.name}: {reason}")
        raise ValueError(f"{cls.op_name}: no backend can handle this call ({'; '.join(reasons)})")

    @classmethod
    def run(cls, precision: PrecisionType, **kwargs: Any) -> Any:
        """Run the call on its backend, resolved once per ``resolve_key`` and reused while the settings
        (``GlobalBackendManager.settings_token``) stay the same: the eager path's backend lookup."""
        key = cls.resolve_key(**kwargs)
        token = GlobalBackendManager.settings_token(cls.settings_op)
        hit = cls._resolved.get(key)
        if hit is not None and hit[0] == token:
            backend = hit[1]
            cls._last_selected = backend
            cls._counts[hit[2]] += 1
            return hit[3](**kwargs)
        backend, final = cls._decide(GlobalBackendManager.get_backend(cls.settings_op, precision), kwargs)
        execute = cls.backends[cls._select(backend)].execute
        if final:
            if len(cls._resolved) >= cls.cache_capacity:
                cls._resolved.clear()
            cls._resolved[key] = (token, backend, backend.value, execute)
        return execute(**kwargs)

    @classmethod
    def dispatch(cls, user_choice: BackendChoice | None, **kwargs: Any) -> Any:
        """Resolve the backend for this call and run it."""
        return cls.backends[cls.resolve(user_choice, **kwargs)].execute(**kwargs)
