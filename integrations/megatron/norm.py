"""``TurboNorm``: the ``TENorm`` slot (a factory on ``config.normalization``), RMSNorm on the Turbo kernel."""

from __future__ import annotations

from typing import Any

from torch import nn

from primus_turbo.integrations.megatron.linear import param_device
from primus_turbo.pytorch.modules import RMSNorm

__all__ = ["TurboNorm", "TurboRMSNorm"]


class TurboRMSNorm(RMSNorm):
    """Turbo's ``RMSNorm`` built from a Megatron config; the weight is named ``weight`` as in TE."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> None:
        super().__init__(
            hidden_size,
            eps=eps,
            zero_centered=bool(config.layernorm_zero_centered_gamma),
            device=param_device(config),
            dtype=config.params_dtype,
        )
        self.config = config
        # with sequence parallelism each TP rank sees part of the sequence: Megatron sums these grads
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def _layer_norm(config: Any, hidden_size: int, eps: float) -> nn.LayerNorm:
    if config.layernorm_zero_centered_gamma:
        raise ValueError("zero-centred LayerNorm is not supported with Turbo norms")
    norm = nn.LayerNorm(hidden_size, eps=eps, device=param_device(config), dtype=config.params_dtype)
    for param in norm.parameters():
        param.sequence_parallel = bool(config.sequence_parallel)
    return norm


class TurboNorm:
    """``TENorm(config, hidden_size, eps)``: ``TurboRMSNorm`` for RMSNorm, torch LayerNorm otherwise.

    Megatron's fused residual norm (``fused_residual_rmsnorm`` with ``has_residual``) is not provided.
    """

    def __new__(
        cls, config: Any, hidden_size: int, eps: float = 1e-5, has_residual: bool = False, **kwargs: Any
    ) -> nn.Module:
        if has_residual and getattr(config, "fused_residual_rmsnorm", False):
            raise ValueError("fused_residual_rmsnorm is not supported with Turbo norms")
        if config.normalization == "RMSNorm":
            return TurboRMSNorm(config, hidden_size, eps)
        if config.normalization == "LayerNorm":
            return _layer_norm(config, hidden_size, eps)
        raise ValueError(f"normalization must be RMSNorm or LayerNorm, got {config.normalization!r}")
