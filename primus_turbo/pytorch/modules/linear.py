"""``Linear``: a drop-in ``nn.Linear`` whose matmul (forward, dgrad, wgrad) runs on Turbo GEMM."""

from __future__ import annotations

import math

import torch
from torch import nn

from primus_turbo.pytorch.ops.gemm import gemm

__all__ = ["Linear"]


class Linear(nn.Module):
    """``y = x @ weight.T + bias`` with ``weight`` of shape (out_features, in_features).

    Inputs of any leading shape are flattened to 2-D for the GEMM and reshaped back.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if in_features <= 0 or out_features <= 0:
            raise ValueError(
                f"in_features and out_features must be positive, got {in_features}, {out_features}"
            )
        self.in_features = in_features
        self.out_features = out_features
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The same initialisation as ``torch.nn.Linear``."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"Linear expects the last dim of x to be {self.in_features}, got {tuple(x.shape)}"
            )
        out = gemm(x.reshape(-1, self.in_features), self.weight, trans_b=True)
        out = out.view(*x.shape[:-1], self.out_features)
        return out + self.bias if self.bias is not None else out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )
