"""Run megatron-core models on the CPU over gloo (CI tests and the CPU demo), megatron-core 0.16 to 0.19.

Megatron-Core assumes CUDA in a few places that a tiny ``GPTModel`` (local spec, dense or MoE with the
"alltoall" or "allgather" token dispatcher) reaches on the CPU. :func:`enable_megatron_on_cpu` patches
exactly those places and returns an undo that restores every patched attribute; it does nothing when a
GPU is visible. Not patched, the caller's job: bf16 models must be wrapped in
``megatron.core.transformer.module.Float16Module`` (the embedding emits fp32 activations otherwise).

Patches, each undone by the returned callable:

- ``torch.cuda.current_device`` returns ``torch.device("cpu")``: Megatron allocates scratch and
  communication buffers with ``device=torch.cuda.current_device()``.
- ``megatron.core.tensor_parallel.random.CudaRNGStatesTracker`` becomes a subclass that keeps CPU generator
  states under the same names (and the tracker is re-created from it): attention and expert layers fork
  ``get_cuda_rng_tracker()``, and ``model_parallel_cuda_manual_seed`` adds states with CUDA RNG calls.
- ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` in the same module read and write the CPU generator:
  activation recompute saves and restores "the CUDA RNG state" through them.
- ``megatron.core.fusions.fused_softmax.get_default_causal_mask`` builds the mask on the host: the
  unfused softmax calls it (``device="cuda"``) when a causal model gets ``attention_mask=None``.
- ``WrappedTorchNorm.__new__`` (the local spec's norm without Apex, i.e. always on the CPU) accepts
  ``sequence_parallel=True``: it builds the torch norm and tags its parameters ``sequence_parallel`` exactly
  as Megatron's Apex-based ``FusedLayerNorm`` does, instead of asserting.
- ``megatron.core.transformer.moe.moe_utils``: TE-only names missing there (0.16 binds
  ``te_general_gemm`` and the fused MoE helpers only when Transformer Engine imports) are set to ``None``,
  which is what 0.19 does without TE; the router checks them against ``None``.
- ``MoEAlltoAllTokenDispatcher.cuda_dtoh_stream`` is pre-set, so ``__init__`` creates no CUDA stream, and
  ``_maybe_dtoh_and_synchronize`` skips the side-stream device-to-host copy and its event (every tensor is
  already on the host); it only turns the split sizes into numpy arrays, as that copy does on the GPU.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["enable_megatron_on_cpu", "megatron_on_cpu"]

_MISSING = object()
_LOCK = threading.Lock()
_active = False

# names that megatron-core 0.16's moe_utils binds only when Transformer Engine imports (0.19 sets them None)
_MOE_UTILS_TE_NAMES = (
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "fused_permute",
    "fused_permute_and_pad_with_probs",
    "fused_permute_with_probs",
    "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs",
    "fused_topk_with_score_function",
    "fused_unpermute",
    "te_general_gemm",
)


class _NoCudaStream:
    """Stands in for the alltoall dispatcher's class-level D2H stream; never used as a stream."""

    def __repr__(self) -> str:
        return "<no CUDA stream: megatron_on_cpu>"


class _Patcher:
    """Sets attributes and remembers how to put each one back exactly (value or absence)."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, vars(owner).get(name, _MISSING)))
        setattr(owner, name, value)

    def undo(self) -> None:
        while self._saved:
            owner, name, old = self._saved.pop()
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)


def _cpu_current_device() -> torch.device:
    """``torch.cuda.current_device`` under the shim: the CPU, usable as ``device=`` in tensor factories."""
    return torch.device("cpu")


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """``_get_cuda_rng_state`` under the shim: the CPU default generator's state."""
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """``_set_cuda_rng_state`` under the shim: set the CPU default generator's state."""
    torch.set_rng_state(new_state)


def _make_cpu_tracker_class(base: type, default_name: str) -> type:
    """A ``CudaRNGStatesTracker`` subclass whose named states are CPU generator states."""

    class CpuRNGStatesTracker(base):  # type: ignore[valid-type, misc]
        """Megatron's RNG tracker on the CPU: ``fork(name)`` swaps the CPU default generator's state."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"cuda rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = default_name) -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"cuda rng state {name} is not added")
            outer_state = torch.get_rng_state()
            outer_name = self._current_state_name
            if outer_name != "default-rng":
                self.states_[outer_name] = outer_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if outer_name != "default-rng":
                    outer_state = self.states_[outer_name]
                torch.set_rng_state(outer_state)
                self._current_state_name = outer_name

    return CpuRNGStatesTracker


def _cpu_dtoh_and_synchronize(
    self: Any, point: str, tokens_per_expert: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``_maybe_dtoh_and_synchronize`` without streams: the split sizes become numpy as on the GPU path."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name, None)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def _make_sp_torch_norm_new(original: Callable[..., Any]) -> Callable[..., Any]:
    """``WrappedTorchNorm.__new__`` that accepts sequence parallelism the way Megatron's fused norm does."""

    def new(cls: type, config: Any, *args: Any, **kwargs: Any) -> torch.nn.Module:
        if not config.sequence_parallel:
            return original(cls, config, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original(cls, plain, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True  # finalize_model_grads all-reduces these over TP
        return norm

    return new


def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    """``get_default_causal_mask`` on the host: True above the diagonal (the positions masked out)."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _apply(patcher: _Patcher) -> None:
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mc_random
    from megatron.core.transformer import torch_norm
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    # scratch and communication buffers are made with device=torch.cuda.current_device()
    patcher.set(torch.cuda, "current_device", _cpu_current_device)

    # the tracker adds and forks named states through torch.cuda RNG calls; re-create it from the CPU class
    tracker_class = _make_cpu_tracker_class(
        mc_random.CudaRNGStatesTracker,
        getattr(mc_random, "_MODEL_PARALLEL_RNG_TRACKER_NAME", "model-parallel-rng"),
    )
    patcher.set(mc_random, "CudaRNGStatesTracker", tracker_class)
    patcher.set(mc_random, "_CUDA_RNG_STATE_TRACKER", None)
    patcher.set(mc_random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False)
    # activation recompute saves and restores the "CUDA" RNG state through these two
    patcher.set(mc_random, "_get_cuda_rng_state", _cpu_get_rng_state)
    patcher.set(mc_random, "_set_cuda_rng_state", _cpu_set_rng_state)

    # the unfused softmax makes the implied causal mask on "cuda" when attention_mask is None
    if hasattr(fused_softmax, "get_default_causal_mask"):
        patcher.set(fused_softmax, "get_default_causal_mask", _cpu_default_causal_mask)

    # the torch norm asserts on sequence parallelism (only Apex/TE norms support it, neither exists on CPU)
    wrapped_norm = torch_norm.WrappedTorchNorm
    patcher.set(wrapped_norm, "__new__", staticmethod(_make_sp_torch_norm_new(wrapped_norm.__new__)))

    # 0.16 binds these only when TE imports, the router reads te_general_gemm: NameError without TE
    for name in _MOE_UTILS_TE_NAMES:
        if not hasattr(moe_utils, name):
            patcher.set(moe_utils, name, None)

    # the alltoall dispatcher makes a class-wide torch.cuda.Stream in __init__ and syncs D2H copies on it
    alltoall = token_dispatcher.MoEAlltoAllTokenDispatcher
    if getattr(alltoall, "cuda_dtoh_stream", None) is None:
        patcher.set(alltoall, "cuda_dtoh_stream", _NoCudaStream())
    if hasattr(alltoall, "_maybe_dtoh_and_synchronize"):
        patcher.set(alltoall, "_maybe_dtoh_and_synchronize", _cpu_dtoh_and_synchronize)


def _noop() -> None:
    """The undo of a call that patched nothing."""


def enable_megatron_on_cpu() -> Callable[[], None]:
    """Patch megatron-core so GPT models run forward and backward on the CPU over gloo.

    Imports megatron-core (ImportError without it). Returns the undo, which restores every patched
    attribute exactly; calling it again does nothing. With CUDA available nothing is patched and the
    undo is a no-op. Idempotent: a call while the shim is already enabled patches nothing and returns a
    no-op undo; the undo of the call that enabled it restores everything.
    """
    global _active
    if torch.cuda.is_available():
        return _noop
    with _LOCK:
        if _active:
            return _noop
        patcher = _Patcher()
        try:
            _apply(patcher)
        except BaseException:
            patcher.undo()
            raise
        _active = True

    def undo() -> None:
        global _active
        with _LOCK:
            if patcher._saved:
                patcher.undo()
                _active = False

    return undo


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Context manager form of :func:`enable_megatron_on_cpu`: patched inside, restored on exit."""
    undo = enable_megatron_on_cpu()
    try:
        yield
    finally:
        undo()
