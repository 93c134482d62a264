"""Optimizers that write FP8 primary weights in their step."""

from primus_turbo.pytorch.optim.fused_adamw import FusedAdamW

__all__ = ["FusedAdamW"]
