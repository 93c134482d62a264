"""Whether a linear layer's GEMMs are faster in FP8 than in bf16 at its shape: a cost model of one
forward + backward (forward, input-gradient and weight-gradient GEMMs, and every quantization pass the
FP8 path runs), used to keep layers in bf16 where FP8 would lose (small K or N, few tokens per expert,
host-bound eager steps).

The model, per GEMM: tiles of 128 x 128 output run in waves over the GPU's SMs (a wave costs one tile's
FLOPs at the per-SM rate), never faster than moving the operands once, plus a fixed cost per kernel. A
quantization pass costs its bytes at the quantizers' bandwidth plus the fixed cost. In eager mode a layer
also cannot finish before its host path has issued it (``count_host``): the layer's time is the larger of
its device time and its measured host time. The constants are one H200's, measured by this library's
benchmarks (docs/performance.md, "FP8 choice"); ``Fp8CostModel`` takes others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, ScalingGranularity

__all__ = ["Fp8CostModel", "Fp8Decision", "fp8_linear_decision"]

_G = ScalingGranularity
_TILE = 128

# (bytes moved per element of the operand: read bf16 = 2, write FP8 = 1; kernels) of the quantization
# passes the FP8 path runs on an operand for the forward/dgrad copy and the wgrad's token-major copy.
# Tensorwise: an amax pass before the cast. A linear's row-wise / 1 x 128 copies come from one read of
# its tiles (``quantize_fp8_with_trans``); a grouped layer quantizes along the tokens of each group in a
# pass of its own that runs at under half the bandwidth of a row pass (1.25 against 2.8 TB/s measured on
# an H100), counted as 7 bytes instead of 3.
_DENSE = {_G.TENSORWISE: (6, 2), _G.ROWWISE: (6, 2), _G.BLOCKWISE: (4, 1)}
_GROUPED_ACTIVATION = {_G.TENSORWISE: (7, 3), _G.ROWWISE: (10, 2), _G.BLOCKWISE: (10, 2)}
_GROUPED_GRADIENT = {_G.TENSORWISE: (6, 2), _G.ROWWISE: (10, 2), _G.BLOCKWISE: (10, 2)}
# a grouped layer whose wgrad stays bf16 quantizes each operand once, along its rows
_NO_WGRAD = {_G.TENSORWISE: (5, 2), _G.ROWWISE: (3, 1), _G.BLOCKWISE: (3, 1)}
# the weight in both layouts: tiles read once and written twice (after an amax pass for tensorwise)
_WEIGHT = {_G.TENSORWISE: (6, 2), _G.ROWWISE: (6, 2), _G.BLOCKWISE: (4, 1)}


@dataclass(frozen=True)
class Fp8CostModel:
    """The constants of the model (defaults: one H200, torch 2.11, triton 3.6; see the module docstring).

    Rates are sustained TFLOP/s of large GEMMs; ``fp8_block_wgrad_tflops`` is the block-scaled
    weight-gradient kernel's (its per-block rescaling halves it). ``quant_tbps`` is the quantization
    passes' bandwidth in TB/s, ``kernel_us`` the fixed cost of any kernel (launch gap and tail). Host
    times are one forward + backward of a layer on the calling thread, bf16 and FP8."""

    bf16_tflops: float = 690.0
    fp8_tflops: float = 1120.0
    fp8_block_wgrad_tflops: float = 560.0
    copy_tbps: float = 4.0
    quant_tbps: float = 3.0
    kernel_us: float = 4.0
    sms: int = 132
    host_bf16_us: float = 290.0
    host_fp8_us: float = 1400.0
    host_grouped_bf16_us: float = 360.0
    host_grouped_fp8_us: float = 1900.0

    def gemm_us(self, m: int, n: int, k: int, groups: int, tflops: float, elem_bytes: int) -> float:
        """One GEMM of ``groups`` [m, k] x [k, n] products (each group m rows): waves of output tiles."""
        if m <= 0 or n <= 0 or k <= 0:
            return self.kernel_us
        tiles = groups * math.ceil(m / _TILE) * math.ceil(n / _TILE)
        waves = math.ceil(tiles / self.sms)
        compute = waves * 2 * _TILE * _TILE * k * self.sms / (tflops * 1e6)
        moved = groups * (m * k + k * n) * elem_bytes + groups * m * n * 2
        return max(compute, moved / (self.copy_tbps * 1e6)) + self.kernel_us

    def pass_us(self, elements: int, bytes_per_element: int, kernels: int) -> float:
        return elements * bytes_per_element / (self.quant_tbps * 1e6) + kernels * self.kernel_us


@dataclass(frozen=True)
class Fp8Decision:
    """What the model chose for one layer: FP8 or not, the FP8 weight gradient or not, and the modelled
    forward + backward microseconds of each choice."""

    use_fp8: bool
    fp8_wgrad: bool
    bf16_us: float
    fp8_us: float
    reason: str

    def __str__(self) -> str:
        choice = "fp8" if self.use_fp8 else "bf16"
        if self.use_fp8 and not self.fp8_wgrad:
            choice += " (bf16 wgrad)"
        return f"{choice}: modelled bf16 {self.bf16_us:.0f} us, fp8 {self.fp8_us:.0f} us; {self.reason}"


def _fp8_us(
    model, m, n, k, groups, grouped, config, fp8_wgrad, input_fp8, micro_batches, weight_fp8
) -> float:
    gran, tokens = config.granularity, m * groups
    block_wgrad = gran is _G.BLOCKWISE
    gemms = model.gemm_us(m, n, k, groups, model.fp8_tflops, 1)  # forward
    gemms += model.gemm_us(m, k, n, groups, model.fp8_tflops, 1)  # input gradient
    if fp8_wgrad:  # reduces over each group's tokens
        rate = model.fp8_block_wgrad_tflops if block_wgrad else model.fp8_tflops
        gemms += model.gemm_us(n, k, m, groups, rate, 1)
        act, grad = (_GROUPED_ACTIVATION[gran], _GROUPED_GRADIENT[gran]) if grouped else (_DENSE[gran],) * 2
    else:
        gemms += model.gemm_us(n, k, m, groups, model.bf16_tflops, 2)
        act, grad = _NO_WGRAD[gran], _NO_WGRAD[gran]
    passes = model.pass_us(tokens * n, *grad)
    if not input_fp8:  # a fused producer (rmsnorm_fp8, swiglu_fp8) writes the activation's copies itself
        passes += model.pass_us(tokens * k, *act)
    if not weight_fp8:  # FP8 primary weights: the optimizer step writes the weight's copies
        bytes_w, kernels_w = _WEIGHT[gran]
        passes += model.pass_us(groups * n * k, bytes_w, kernels_w) / max(micro_batches, 1)
    return gemms + passes


def fp8_linear_decision(
    tokens: int,
    in_features: int,
    out_features: int,
    config: Float8QuantConfig,
    *,
    groups: int | None = None,
    fp8_wgrad: bool | None = None,
    input_fp8: bool = False,
    count_host: bool = True,
    micro_batches: int = 1,
    weight_fp8: bool = False,
    model: Fp8CostModel | None = None,
) -> Fp8Decision:
    """FP8 or bf16 for a linear (``groups`` None) or a grouped linear of ``groups`` experts that sees
    ``tokens`` rows per step ([tokens, in_features] -> [tokens, out_features], spread evenly over the
    groups), under ``config``.

    ``fp8_wgrad`` None lets the model also choose a grouped layer's weight-gradient precision
    (``grouped_gemm_fp8`` can run it in bf16); True or False fixes it (a linear's is FP8).
    ``input_fp8``: the input arrives quantized from a fused producer. ``count_host``: eager mode, where
    the layer takes at least its host path's time (False under CUDA graphs). ``micro_batches``: forwards
    that share one weight quantization. ``weight_fp8``: FP8 primary weights, whose copies the optimizer
    step writes (no weight quantization in the layer). Block scaling needs both feature counts to be
    multiples of the block size: otherwise the layer stays bf16."""
    if not isinstance(config, Float8QuantConfig):
        raise TypeError(f"config must be a Float8QuantConfig, got {config!r}")
    for name, value in (("tokens", tokens), ("in_features", in_features), ("out_features", out_features)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    grouped = groups is not None
    if grouped and (not isinstance(groups, int) or groups < 1):
        raise ValueError(f"groups must be None or an int >= 1, got {groups!r}")
    groups = groups or 1
    fp8_wgrad = fp8_wgrad if grouped else True
    model = model or Fp8CostModel()
    m = math.ceil(tokens / groups)
    k, n = in_features, out_features
    rate = model.bf16_tflops
    bf16 = sum(model.gemm_us(*dims, groups, rate, 2) for dims in ((m, n, k), (m, k, n), (n, k, m)))
    block = config.block_size if config.granularity is _G.BLOCKWISE else None
    if block and (k % block or n % block):
        reason = f"block scaling needs in ({k}) and out ({n}) features in multiples of {block}"
        return Fp8Decision(False, False, bf16, math.inf, reason)
    choices = (True, False) if fp8_wgrad is None else (fp8_wgrad,)
    costs = {
        w: _fp8_us(model, m, n, k, groups, grouped, config, w, input_fp8, micro_batches, weight_fp8)
        for w in choices
    }
    wgrad = min(costs, key=costs.get)
    fp8 = costs[wgrad]
    reason = "device time"
    if count_host:
        host_bf16 = model.host_grouped_bf16_us if grouped else model.host_bf16_us
        host_fp8 = model.host_grouped_fp8_us if grouped else model.host_fp8_us
        if host_bf16 > bf16 or host_fp8 > fp8:
            reason = "eager: host time counted"
        bf16, fp8 = max(bf16, host_bf16), max(fp8, host_fp8)
    return Fp8Decision(fp8 < bf16, wgrad, bf16, fp8, reason)
