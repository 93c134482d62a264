"""``GroupedLinear``: one linear layer per group (MoE experts) over tokens sorted by group."""

from __future__ import annotations

import math

import torch
from torch import nn

from primus_turbo.pytorch.core.low_precision import Float8QuantConfig
from primus_turbo.pytorch.ops.grouped_gemm import grouped_gemm
from primus_turbo.pytorch.ops.grouped_gemm_fp8 import QuantizedExperts, grouped_gemm_fp8

__all__ = ["GroupedLinear", "grouped_linear"]


def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group_lens: torch.Tensor,
    config: Float8QuantConfig | None = None,
    weight_fp8: QuantizedExperts | None = None,
    fp8_wgrad: bool = True,
) -> torch.Tensor:
    """``x[rows of g] @ weight[g].T + bias[g]`` for ``weight`` [G, out, in] and ``bias`` [G, out] or None,
    over tokens sorted by group (int64 ``group_lens`` on x's device); FP8 GEMMs with ``config``, reading
    ``weight_fp8`` (``quantize_fp8_experts(weight, config, trans_b=True)``, made beforehand) when given,
    the weight gradient in FP8 too unless ``fp8_wgrad=False`` (see ``grouped_gemm_fp8``). Under tensorwise
    FP8 ``x`` may arrive quantized (a ``QuantizedTensor`` from ``swiglu_fp8``)."""
    if config is None:
        out = grouped_gemm(x, weight, group_lens, trans_b=True)
    else:
        out = grouped_gemm_fp8(
            x, weight, group_lens, trans_b=True, config=config, b_quantized=weight_fp8, fp8_wgrad=fp8_wgrad
        )
    if bias is None:
        return out
    group_of_row = torch.repeat_interleave(
        torch.arange(weight.shape[0], device=weight.device), group_lens, output_size=x.shape[0]
    )
    return out + bias[group_of_row]


class GroupedLinear(nn.Module):
    """``y[rows of g] = x[rows of g] @ weight[g].T (+ bias[g])`` with ``weight`` [G, out, in].

    ``forward(x, group_lens)`` takes ``x`` [T, in] with the tokens of group ``g`` contiguous and in
    group order, and ``group_lens`` an int64 [G] tensor on the same device (no host sync). With a
    ``config`` the GEMMs run in FP8 (``grouped_gemm_fp8``; the weight gradient in the parameters' dtype
    with ``fp8_wgrad=False``); parameters stay high precision.
    """

    def __init__(
        self,
        num_groups: int,
        in_features: int,
        out_features: int,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        config: Float8QuantConfig | None = None,
        fp8_wgrad: bool = True,
    ) -> None:
        super().__init__()
        if config is not None and not isinstance(config, Float8QuantConfig):
            raise TypeError(f"config must be a Float8QuantConfig or None, got {config!r}")
        self.config, self.fp8_wgrad = config, fp8_wgrad
        if min(num_groups, in_features, out_features) <= 0:
            raise ValueError(
                f"num_groups, in_features and out_features must be positive, got "
                f"{num_groups}, {in_features}, {out_features}"
            )
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(num_groups, out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(num_groups, out_features, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each group initialised like ``torch.nn.Linear``."""
        for w in self.weight:
            nn.init.kaiming_uniform_(w, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor, group_lens: torch.Tensor) -> torch.Tensor:
        return grouped_linear(x, self.weight, self.bias, group_lens, self.config, fp8_wgrad=self.fp8_wgrad)

    def extra_repr(self) -> str:
        return (
            f"num_groups={self.num_groups}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.bias is not None}"
            + (f", fp8={self.config.granularity.name}/{self.config.format.name}" if self.config else "")
            + (", fp8_wgrad=False" if self.config and not self.fp8_wgrad else "")
        )
