"""Per-layer FP8 decisions under ``--turbo-fp8-auto-filter``: FP8 or bf16 GEMMs for one linear or grouped
linear, chosen by the FP8 cost model (``primus_turbo.pytorch.core.fp8_filter``) at the layer's shape and
logged once per layer."""

from __future__ import annotations

import logging
from typing import Any

import torch

from primus_turbo.pytorch.core.fp8_filter import Fp8Decision, fp8_linear_decision

__all__ = ["Fp8Choice"]

_log = logging.getLogger(__name__)


class Fp8Choice:
    """One layer's decisions, made on its first forward at each token count (in power-of-two buckets, so
    dropless routing that changes the count every step does not re-decide every step) and reused. Under
    torch.compile the decision runs while the graph is traced, as a constant of the graph (its log line
    included, which in the graph itself would break it)."""

    def __init__(self) -> None:
        self._made: dict[tuple[int, bool], Fp8Decision] = {}

    def decide(
        self,
        module: Any,
        mode: str,
        tokens: int,
        *,
        groups: int | None = None,
        fp8_wgrad: bool | None = None,
        input_fp8: bool = False,
    ) -> tuple[bool, bool]:
        """(FP8 or not, FP8 weight gradient or not) for ``module`` (its ``quant_config``, ``in_features``,
        ``out_features``) on ``tokens`` rows, under ``mode`` ("eager": host time counted, "graph": device
        time only)."""
        key = (max(tokens, 1).bit_length(), input_fp8)
        if torch.compiler.is_compiling():
            return _traced_decision(self, module, mode, key, groups, fp8_wgrad)
        return self._decision(module, mode, key, groups, fp8_wgrad)

    def _decision(self, module, mode, key, groups, fp8_wgrad) -> tuple[bool, bool]:
        decision = self._made.get(key)
        if decision is None:
            bucket = 1 << (key[0] - 1)  # the bucket's lower end: the cost model sees no fewer tokens
            decision = fp8_linear_decision(
                bucket,
                module.in_features,
                module.out_features,
                module.quant_config,
                groups=groups,
                fp8_wgrad=fp8_wgrad,
                input_fp8=key[1],
                count_host=mode == "eager",
                weight_fp8=bool(getattr(module.config, "fp8_param", False)),
            )
            level = logging.INFO if not self._made else logging.DEBUG
            self._made[key] = decision
            experts = f", {groups} experts" if groups else ""
            name = getattr(module, "tp_comm_buffer_name", None) or ""
            _log.log(
                level,
                "fp8 auto-filter %s%s [%d tokens x %d -> %d%s]: %s",
                type(module).__name__,
                f" ({name})" if name else "",
                bucket,
                module.in_features,
                module.out_features,
                experts,
                decision,
            )
        return decision.use_fp8, decision.fp8_wgrad


@torch.compiler.assume_constant_result
def _traced_decision(choice: Fp8Choice, module, mode, key, groups, fp8_wgrad) -> tuple[bool, bool]:
    """``Fp8Choice._decision`` run by the tracer in plain Python, its result a constant of the graph."""
    return choice._decision(module, mode, key, groups, fp8_wgrad)
