"""``RMSNorm``: a drop-in ``torch.nn.RMSNorm`` (last dimension) on the Turbo kernel."""

from __future__ import annotations

import torch
from torch import nn

from primus_turbo.pytorch.ops.normalization import rmsnorm

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """RMSNorm over the last ``hidden_size`` features with a learned weight.

    ``zero_centered=True`` keeps the weight as an offset from one (initialised to zeros), as Megatron's
    ``apply_layernorm_1p``; otherwise it is initialised to ones.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        zero_centered: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if hidden_size <= 0:
            raise ValueError(f"hidden_size must be positive, got {hidden_size}")
        self.hidden_size, self.eps, self.zero_centered = hidden_size, float(eps), zero_centered
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Ones, or zeros when zero-centred (both give the identity scale)."""
        nn.init.zeros_(self.weight) if self.zero_centered else nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm(x, self.weight, self.eps, self.zero_centered)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, zero_centered={self.zero_centered}"
