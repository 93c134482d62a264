"""``apply_primus_turbo_to_megatron``: put Turbo into Megatron-Core in place, so model-building code written
for Megatron (``get_gpt_layer_with_transformer_engine_spec``, ``get_gpt_decoder_block_spec``, the flex
token dispatcher) builds Turbo modules without edits. Idempotent and reversible."""

from __future__ import annotations

import argparse
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.extensions.transformer_engine import HAVE_TE

from primus_turbo.integrations.megatron.compat import check_supported_version
from primus_turbo.integrations.megatron.config import PrimusTurboConfig, ResolvedTurbo, resolve
from primus_turbo.integrations.megatron.experts import TurboGroupedLinear
from primus_turbo.integrations.megatron.linear import TurboLinear
from primus_turbo.integrations.megatron.router import (
    TurboAuxLossScaler,
    track_aux_loss_scale,
    turbo_topk_routing,
)
from primus_turbo.integrations.megatron.spec_provider import (
    TurboSpecProvider,
    bound_names,
    set_active_features,
    spec_bindings,
)
from primus_turbo.integrations.megatron.token_dispatcher import TurboFlexTokenDispatcher
from primus_turbo.pytorch.core.backend import GlobalBackendManager

__all__ = ["TurboPatch", "apply_primus_turbo_to_megatron", "remove_primus_turbo_from_megatron"]

_log = logging.getLogger(__name__)

_DISPATCHER_SITES = (
    ("megatron.core.transformer.moe.moe_layer", "MoEFlexTokenDispatcher"),
    ("megatron.core.transformer.moe.token_dispatcher", "MoEFlexTokenDispatcher"),
)
# megatron-core's TransformerConfig checks these Transformer-Engine versions for MoE FP8 training; when TE
# is not installed and Turbo runs every FP8 GEMM, the checks are about a library that is not in use
_FP8_MOE_TE_GATES = ("1.7.0.dev0", "1.11.0")


@dataclass
class TurboPatch:
    """What one ``apply_primus_turbo_to_megatron`` call changed; ``undo()`` puts it all back."""

    features: ResolvedTurbo
    _names: Any = None
    _config_changes: list[tuple[Any, str, Any]] = field(default_factory=list)
    _backend_ops: list[str] = field(default_factory=list)
    _auto_tune: bool = False
    _untrack_loss_scale: Callable[[], None] | None = None
    _multithreading: bool | None = None  # autograd's setting before the patch, where the patch changed it
    active: bool = True

    def undo(self) -> None:
        if not self.active:
            return
        self.active = False
        if self._names is not None:
            self._names.__exit__(None, None, None)
        if self._untrack_loss_scale is not None:
            self._untrack_loss_scale()
        for target, name, old in reversed(self._config_changes):
            setattr(target, name, old)
        for op in self._backend_ops:
            GlobalBackendManager.set_backend(op, None)
        if self._auto_tune:
            GlobalBackendManager.set_auto_tune(None)
        if self._multithreading is not None:
            torch.autograd.set_multithreading_enabled(self._multithreading)
        TurboFlexTokenDispatcher.num_worst_tokens = 0
        TurboLinear.async_tp = False
        TurboGroupedLinear.fp8_wgrad = True
        TurboLinear.fp8_auto_filter = TurboGroupedLinear.fp8_auto_filter = None
        set_active_features(None)
        if _applied and _applied[0] is self:
            _applied.clear()


_applied: list[TurboPatch] = []


def _te_gate_without_te() -> Any:
    """``is_te_min_version`` for ``transformer_config`` that passes the MoE FP8 gates and defers the rest."""
    from megatron.core.transformer import transformer_config

    original = transformer_config.is_te_min_version

    def is_te_min_version(version: str, check_equality: bool = True) -> bool:
        return True if version in _FP8_MOE_TE_GATES else original(version, check_equality)

    return is_te_min_version


def _set_backends(turbo: PrimusTurboConfig, patch: TurboPatch) -> None:
    for op, choices in turbo.backend_choices().items():
        for precision, choice in choices.items():
            GlobalBackendManager.set_backend(op, choice.backend, precision, auto_tune=choice.auto_tune)
        patch._backend_ops.append(op)
    if turbo.use_turbo_autotune:
        GlobalBackendManager.set_auto_tune(True)
        patch._auto_tune = True


def apply_primus_turbo_to_megatron(
    config: PrimusTurboConfig | argparse.Namespace, megatron_config: Any = None
) -> TurboPatch:
    """Fill Megatron's Transformer-Engine slots with Turbo modules for the features ``config`` enables.

    ``config`` is a ``PrimusTurboConfig`` or Megatron-LM's parsed arguments (with
    ``add_primus_turbo_args``); ``megatron_config`` (a ``TransformerConfig`` or the same namespace, which is
    the default) decides which features the model can use and is checked for contradictions. With the
    Turbo dispatcher on, its ``moe_token_dispatcher_type`` becomes ``"flex"``. A second call replaces the
    first; ``undo()`` (or ``remove_primus_turbo_from_megatron()``) restores everything.
    """
    check_supported_version()
    if isinstance(config, PrimusTurboConfig):
        turbo = config
    else:
        turbo = PrimusTurboConfig.from_args(config)
        megatron_config = config if megatron_config is None else megatron_config
    if megatron_config is None:
        raise ValueError("megatron_config (a TransformerConfig or Megatron-LM's args) is required")
    features = resolve(turbo, megatron_config)
    remove_primus_turbo_from_megatron()
    patch = TurboPatch(features)
    if not turbo.enable_primus_turbo:
        patch.active = False
        return patch
    bindings = spec_bindings(features)
    if features.deepep:
        bindings.update({site: TurboFlexTokenDispatcher for site in _DISPATCHER_SITES})
        if megatron_config.moe_token_dispatcher_type != "flex":
            patch._config_changes.append(
                (megatron_config, "moe_token_dispatcher_type", megatron_config.moe_token_dispatcher_type)
            )
            megatron_config.moe_token_dispatcher_type = "flex"
    if features.fused_router:
        site = ("megatron.core.transformer.moe.router", "topk_routing_with_score_function")
        bindings[site] = turbo_topk_routing(importlib.import_module(site[0]).topk_routing_with_score_function)
    bindings[("megatron.core.transformer.moe.router", "MoEAuxLossAutoScaler")] = TurboAuxLossScaler
    if features.fp8 is not None and not HAVE_TE:
        bindings[("megatron.core.transformer.transformer_config", "is_te_min_version")] = (
            _te_gate_without_te()
        )
    patch._names = bound_names(bindings)
    patch._names.__enter__()
    patch._untrack_loss_scale = track_aux_loss_scale()
    TurboFlexTokenDispatcher.num_worst_tokens = features.num_worst_tokens
    TurboLinear.async_tp = features.async_tp
    TurboGroupedLinear.fp8_wgrad = features.fp8_expert_wgrad
    TurboLinear.fp8_auto_filter = TurboGroupedLinear.fp8_auto_filter = features.fp8_auto_filter
    set_active_features(features)
    _set_backends(turbo, patch)
    if features.backward_on_caller_thread:
        patch._multithreading = torch._C._is_multithreading_enabled()
        torch.autograd.set_multithreading_enabled(False)  # takes effect on construction, process-wide
    _applied[:] = [patch]
    slots = TurboSpecProvider(features).describe()
    if features.deepep:
        slots["token_dispatcher"] = TurboFlexTokenDispatcher.__name__
    if features.fused_router:
        slots["router_topk"] = "fused_group_topk_routing_with_aux_score"
    _log.info("%s; %s", features.describe(), ", ".join(f"{k} <- {v}" for k, v in slots.items()))
    return patch


def remove_primus_turbo_from_megatron() -> None:
    """Undo the active ``apply_primus_turbo_to_megatron`` (a no-op when none is active)."""
    if _applied:
        _applied[0].undo()
