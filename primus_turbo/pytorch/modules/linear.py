"""``Linear`` and ``Float8Linear``: drop-in ``nn.Linear`` layers whose matmuls (forward, dgrad, wgrad)
run on Turbo GEMM, in the input precision or in FP8."""

from __future__ import annotations

import math

import torch
from torch import nn

from primus_turbo.pytorch.core.low_precision import Float8QuantConfig
from primus_turbo.pytorch.ops.fp8_primary import Fp8PrimaryWeight, fp8_primary_view
from primus_turbo.pytorch.ops.gemm import gemm
from primus_turbo.pytorch.ops.gemm_fp8 import gemm_fp8

__all__ = ["Float8Linear", "Linear"]


class Linear(nn.Module):
    """``y = x @ weight.T + bias`` with ``weight`` of shape (out_features, in_features).

    Inputs of any leading shape are flattened to 2-D for the GEMM and reshaped back. With a
    ``quant_config`` the three GEMMs run in FP8 (``ops.gemm_fp8``); parameters stay high precision.
    ``fp8_primary`` (tensorwise or 128 x 128 block scaling) keeps the weight's FP8 copies with it
    (``ops.Fp8PrimaryWeight``), written by ``optim.FusedAdamW``'s step, so the forward does not quantize
    the weight; a weight changed otherwise is quantized again on the next forward.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        quant_config: Float8QuantConfig | None = None,
        fp8_primary: bool = False,
    ) -> None:
        super().__init__()
        if quant_config is not None and not isinstance(quant_config, Float8QuantConfig):
            raise TypeError(f"quant_config must be a Float8QuantConfig or None, got {quant_config!r}")
        self.quant_config = quant_config
        self.fp8_primary = _check_primary(fp8_primary, quant_config, (out_features, in_features))
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
        x2d = x.reshape(-1, self.in_features)
        if self.quant_config is None:
            out = gemm(x2d, self.weight, trans_b=True)
        else:
            copies = fp8_primary_view([self.weight], self.quant_config, False) if self.fp8_primary else None
            weight = self.weight if copies is None else copies
            out = gemm_fp8(x2d, weight, trans_b=True, config=self.quant_config)
        out = out.view(*x.shape[:-1], self.out_features)
        return out + self.bias if self.bias is not None else out

    def extra_repr(self) -> str:
        text = (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )
        if self.quant_config is not None:
            text += f", fp8={self.quant_config.granularity.name}/{self.quant_config.format.name}"
        return text


def _check_primary(fp8_primary: bool, config: Float8QuantConfig | None, shape: tuple[int, int]) -> bool:
    if not isinstance(fp8_primary, bool):
        raise TypeError(f"fp8_primary must be a bool, got {fp8_primary!r}")
    if fp8_primary and (config is None or not Fp8PrimaryWeight.supports(shape, config)):
        raise ValueError(
            "fp8_primary needs an FP8 quant_config, TENSORWISE or BLOCKWISE with in_features and "
            f"out_features multiples of the block size (got {config}, weight {shape})"
        )
    return fp8_primary


class Float8Linear(Linear):
    """A ``Linear`` whose GEMMs run in FP8 with ``config`` (default: tensorwise E4M3)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        config: Float8QuantConfig | None = None,
        fp8_primary: bool = False,
    ) -> None:
        config = config or Float8QuantConfig()
        super().__init__(in_features, out_features, bias, device, dtype, config, fp8_primary)

    @classmethod
    def from_float(
        cls, linear: nn.Linear, config: Float8QuantConfig | None = None, fp8_primary: bool = False
    ) -> Float8Linear:
        """An FP8 layer that shares ``linear``'s weight and bias parameters (no copy)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_float takes an nn.Linear, got {type(linear).__name__}")
        if config is not None and not isinstance(config, Float8QuantConfig):
            raise TypeError(f"config must be a Float8QuantConfig or None, got {config!r}")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.quant_config = config or Float8QuantConfig()
        layer.fp8_primary = _check_primary(fp8_primary, layer.quant_config, tuple(linear.weight.shape))
        layer.weight = linear.weight
        layer.bias = linear.bias
        return layer
