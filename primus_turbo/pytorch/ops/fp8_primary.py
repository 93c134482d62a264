"""FP8 primary weights: a weight's FP8 copies kept next to it and written by the optimizer step.

``Fp8PrimaryWeight`` holds the copies of one weight [N, K] (a linear's) or of a layer's expert weights
(G of them, [N, K] each): the forward's ``q`` [G, N, K], the input gradient's ``q_t`` [G, K, N] and their
scales, laid out as ``quantize_fp8_weight`` / ``quantize_fp8_experts(..., trans_b=True)`` return them, so
a forward reads them as its ``QuantizedTensor`` / ``QuantizedExperts`` without quantizing. ``adamw_fp8_step_``
updates weights and writes their slots of the copies in the same kernel (a layer's experts in one). Each
slot remembers the weight's version counter and storage at its last write: an in-place change by anything
else (a checkpoint load, another optimizer) makes it stale, and ``view`` quantizes stale slots again first.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from primus_turbo.pytorch.core.custom_op import call_op
from primus_turbo.pytorch.core.low_precision import (
    Float8QuantConfig,
    ScalingGranularity,
    ScalingRecipe,
    fp8_dtype_for,
)
from primus_turbo.pytorch.core.validation import check_dtype, check_tensor
from primus_turbo.pytorch.kernels.optim.adamw_fp8_impl import adamw_fp8_step_impl
from primus_turbo.pytorch.ops.gemm_fp8 import quantize_fp8_weight
from primus_turbo.pytorch.ops.grouped_gemm_fp8 import QuantizedExperts, quantize_fp8_experts
from primus_turbo.pytorch.ops.quantization import QuantizedTensor

__all__ = ["Fp8PrimaryWeight", "adamw_fp8_step_", "back_to_back", "fp8_primary_of", "fp8_primary_view"]

_G = ScalingGranularity
_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ATTR = "turbo_fp8_primary"


class Fp8PrimaryWeight:
    """The FP8 copies of ``weights`` (one [N, K] weight, or with ``experts`` a layer's G expert weights)
    under ``config`` (TENSORWISE, or BLOCKWISE with B x B blocks). Each weight gets attribute
    ``turbo_fp8_primary = (this, slot)``. ``owner`` is set by an optimizer that writes the copies in its
    step (``FusedAdamW``): a CUDA graph may then read them, since every step rewrites them in place."""

    GRANULARITIES = (_G.TENSORWISE, _G.BLOCKWISE)  # the scalings whose copies serve both layouts

    def __init__(self, weights: Sequence[torch.Tensor], config: Float8QuantConfig, experts: bool) -> None:
        weights = list(weights)
        if not weights or (not experts and len(weights) != 1):
            raise ValueError(f"FP8 primary weights: one weight, or a list of experts' (got {len(weights)})")
        for i, w in enumerate(weights):
            check_tensor(f"weights[{i}]", w, dim=2)
            check_dtype(f"weights[{i}].dtype", w.dtype, _WEIGHT_DTYPES)
            if w.shape != weights[0].shape or w.device != weights[0].device:
                raise ValueError("FP8 primary weights: the experts' weights must share one shape and device")
        if config.granularity not in self.GRANULARITIES:
            raise ValueError(
                f"FP8 primary weights are TENSORWISE or BLOCKWISE (2-D blocks), got {config.granularity.name}"
            )
        n, k = weights[0].shape
        if not self.supports((n, k), config):
            raise ValueError(
                f"BLOCKWISE FP8 primary weights need N and K multiples of {config.block_size}, got {n}, {k}"
            )
        self.block = config.block_size if config.granularity is _G.BLOCKWISE else 0
        self.config, self.experts, self._owner = config, experts, None
        self._allocate(len(weights), n, k, weights[0].device)
        for slot, w in enumerate(weights):
            setattr(w, ATTR, (self, slot))

    def __getstate__(self) -> dict:
        """Pickled (a saved parameter carries its copies) or deep-copied without the owning optimizer: a
        copy is not rewritten by it."""
        return {**self.__dict__, "_owner": None}

    @property
    def owner(self) -> object | None:
        """The optimizer that writes these copies in its step, if any (held weakly)."""
        return None if self._owner is None else self._owner()

    @owner.setter
    def owner(self, optimizer: object) -> None:
        self._owner = weakref.ref(optimizer)

    @staticmethod
    def supports(shape: Sequence[int], config: Float8QuantConfig) -> bool:
        """Whether [N, K] weights can have FP8 primary copies under ``config``."""
        if config.granularity not in Fp8PrimaryWeight.GRANULARITIES:
            return False
        block = config.block_size or 1
        return shape[-1] % block == 0 and shape[-2] % block == 0

    def _allocate(self, groups: int, n: int, k: int, device: torch.device) -> None:
        dtype = fp8_dtype_for(self.config.format, is_forward=True)
        self.q = torch.empty((groups, n, k), dtype=dtype, device=device)
        self.q_t = torch.empty((groups, k, n), dtype=dtype, device=device)
        if self.block:
            blocks = (n // self.block, k // self.block)
            self.scale = torch.empty((groups, *blocks), dtype=torch.float32, device=device)
            self.scale_t = torch.empty((groups, blocks[1], blocks[0]), dtype=torch.float32, device=device)
        else:
            self.scale, self.scale_t = torch.empty(groups, dtype=torch.float32, device=device), None
        self._stamps: list[tuple[int, int] | None] = [None] * groups

    def fresh(self, weights: Sequence[torch.Tensor]) -> bool:
        """Whether every slot was written from its weight as it is now (same version, same storage)."""
        stamps = self._stamps
        return all(stamps[i] == (w._version, w.data_ptr()) for i, w in enumerate(weights))

    def stamp(self, slot: int, weight: torch.Tensor) -> None:
        """Record that ``slot`` now holds the quantization of ``weight``."""
        self._stamps[slot] = (weight._version, weight.data_ptr())

    @torch.no_grad()
    def refresh(self, weights: Sequence[torch.Tensor]) -> None:
        """Quantize ``weights`` into the copies again (as the forward would quantize them)."""
        if self.experts:
            made = quantize_fp8_experts(_joined(list(weights)), self.config, trans_b=True)
            self.q.copy_(made.forward[0])
            self.q_t.copy_(made.dgrad[0].transpose(1, 2))
            self.scale.copy_(made.forward[1].view(self.scale.shape))
            if self.scale_t is not None:
                self.scale_t.copy_(made.forward[1].transpose(1, 2))
        else:
            made = quantize_fp8_weight(weights[0], self.config)
            self.q[0].copy_(made.data)
            self.q_t[0].copy_(made.data_t)
            self.scale.copy_(made.scale_inv.view(self.scale.shape))
            if self.scale_t is not None:
                self.scale_t[0].copy_(made.scale_inv_t)
        for slot, w in enumerate(weights):
            self.stamp(slot, w)

    def view(self, weights: Sequence[torch.Tensor]) -> QuantizedTensor | QuantizedExperts:
        """The copies as the GEMMs read them (quantized again first where stale): a ``QuantizedTensor``
        whose gradient reaches ``weights[0]``, or with ``experts`` a ``QuantizedExperts``."""
        if self.q.device != weights[0].device:  # the module moved (``.to()``): follow it
            self._allocate(*self.q.shape, weights[0].device)
        if not self.fresh(weights):
            self.refresh(weights)
        if self.experts:
            scale = self.scale if self.block else self.scale.view(-1, 1, 1)
            return QuantizedExperts(
                (self.q, scale), (self.q_t.transpose(1, 2), scale), self.config, True, self.q.shape
            )
        recipe = ScalingRecipe(use_2d_block=True) if self.block else None
        scale = self.scale[0] if self.block else self.scale.view(())
        scale_t = self.scale_t[0] if self.block else scale
        return QuantizedTensor(
            self.q[0],
            scale,
            self.config.granularity,
            self.config.block_size,
            None,
            recipe,
            weights[0].dtype,
            hp=weights[0],
            data_t=self.q_t[0],
            scale_inv_t=scale_t,
        )


def fp8_primary_of(weight: torch.Tensor) -> tuple[Fp8PrimaryWeight, int] | None:
    """``(copies, slot)`` of a weight with FP8 primary copies, else None."""
    return getattr(weight, ATTR, None)


def fp8_primary_view(
    weights: Sequence[torch.Tensor], config: Float8QuantConfig, experts: bool, requantize: bool = False
) -> QuantizedTensor | QuantizedExperts | None:
    """The FP8 copies a forward reads for ``weights`` (a linear's one, or a layer's experts'), made on
    first use; None where the call must quantize the weights itself: inside a torch.compile graph, and
    while a CUDA graph is captured unless the copies are fresh and an optimizer rewrites them in place
    each step (``owner``; else a replay would read copies frozen at capture time).

    ``requantize``: quantize again unless an optimizer owns the copies (a new step has begun, and the
    weights may have been written without their version counter seeing it, as a distributed optimizer
    writes its parameter buffer)."""
    if torch.compiler.is_compiling() or not Fp8PrimaryWeight.supports(weights[0].shape, config):
        return None
    capturing = weights[0].is_cuda and torch.cuda.is_current_stream_capturing()
    primary = fp8_primary_of(weights[0])
    if primary is None:
        if capturing:
            return None
        copies = Fp8PrimaryWeight(weights, config, experts)
    else:
        copies = primary[0]
    if copies.config != config or (capturing and (copies.owner is None or not copies.fresh(weights))):
        return None
    if requantize and copies.owner is None and not capturing:
        copies.refresh(weights)
    return copies.view(weights)


def _check_step_args(weight, grad, exp_avg, exp_avg_sq, master) -> tuple[Fp8PrimaryWeight, int]:
    primary = fp8_primary_of(weight)
    if primary is None:
        raise ValueError("adamw_fp8_step_: weight has no FP8 primary copies (make an Fp8PrimaryWeight)")
    check_tensor("weight", weight, dim=2)
    if not weight.is_contiguous():
        raise ValueError("adamw_fp8_step_: weight must be contiguous")
    check_tensor("grad", grad)
    if grad.shape != weight.shape:
        raise ValueError(f"grad must have weight's shape {tuple(weight.shape)}, got {tuple(grad.shape)}")
    check_dtype("grad.dtype", grad.dtype, _WEIGHT_DTYPES)
    for name, state in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("master", master)):
        if state is None:
            continue
        check_tensor(name, state)
        if state.shape != weight.shape or state.dtype != torch.float32 or not state.is_contiguous():
            raise ValueError(f"{name} must be contiguous fp32 of weight's shape {tuple(weight.shape)}")
        if state.device != weight.device:
            raise ValueError(f"{name} must be on {weight.device}, got {state.device}")
    return primary


def _follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether contiguous ``b`` starts where ``a`` ends, in the same storage."""
    return (
        b.dtype == a.dtype
        and b.data_ptr() == a.data_ptr() + a.numel() * a.element_size()
        and b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    )


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[B, R, C] over B contiguous [R, C] tensors that lie back to back (no copy)."""
    rows, cols = tensors[0].shape
    return tensors[0].as_strided((len(tensors), rows, cols), (rows * cols, cols, 1))


def back_to_back(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether contiguous tensors of one dtype follow each other in one storage, in order."""
    return all(t.is_contiguous() for t in tensors) and all(
        _follows(a, b) for a, b in zip(tensors, tensors[1:], strict=False)
    )


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[B, R, C]: a view where the tensors lie back to back, else a stacked copy."""
    return _stack(tensors) if back_to_back(tensors) else torch.stack(tensors)


def adamw_fp8_step_(
    weights: torch.Tensor | Sequence[torch.Tensor],
    grads: torch.Tensor | Sequence[torch.Tensor],
    exp_avgs: torch.Tensor | Sequence[torch.Tensor],
    exp_avg_sqs: torch.Tensor | Sequence[torch.Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    step: int,
    masters: torch.Tensor | Sequence[torch.Tensor] | None = None,
) -> None:
    """AdamW step ``step`` (1-based, ``torch.optim.AdamW``'s update) of a weight with FP8 primary copies,
    or of a list of them, writing each one's slot of its copies from the updated weight in the same kernel.

    ``exp_avgs``/``exp_avg_sqs`` are fp32 of each weight's shape; with ``masters`` (fp32) the update runs
    on them and the weights receive them rounded. Everything is updated in place. Consecutive slots of one
    set of copies (a layer's experts) whose weights and state lie back to back in memory run as one kernel
    (their gradients are joined first where they do not)."""
    one = isinstance(weights, torch.Tensor)
    weights, grads, exp_avgs, exp_avg_sqs = (
        [t] if one else list(t) for t in (weights, grads, exp_avgs, exp_avg_sqs)
    )
    masters = [masters] if one else list(masters) if masters is not None else [None] * len(weights)
    if not len(weights) == len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(masters):
        raise ValueError("adamw_fp8_step_: weights, grads, exp_avgs, exp_avg_sqs (and masters) must pair up")
    if step < 1:
        raise ValueError(f"step counts from 1, got {step}")
    grads = [g.contiguous() for g in grads]
    states = zip(weights, grads, exp_avgs, exp_avg_sqs, masters, strict=True)
    primaries = [_check_step_args(*args) for args in states]
    start = 0
    for end in range(1, len(weights) + 1):
        if end < len(weights):
            (copies, slot), (prev_copies, prev_slot) = primaries[end], primaries[end - 1]
            lists = [weights, exp_avgs, exp_avg_sqs] + ([masters] if masters[end] is not None else [])
            if (
                copies is prev_copies
                and slot == prev_slot + 1
                and (masters[end] is None) == (masters[end - 1] is None)
                and all(_follows(t[end - 1], t[end]) for t in lists)
            ):
                continue
        run = slice(start, end)
        _launch(primaries[start], weights[run], grads[run], exp_avgs[run], exp_avg_sqs[run], masters[run],
                lr, betas, eps, weight_decay, step)  # fmt: skip
        start = end


def _launch(primary, weights, grads, exp_avgs, exp_avg_sqs, masters, lr, betas, eps, weight_decay, step):
    """One kernel over ``weights``: consecutive slots of ``primary``'s copies from its slot on. Gradients
    that do not lie back to back are joined by one copy (cheaper than a launch per expert)."""
    copies, first = primary
    slots = slice(first, first + len(weights))
    call_op(
        adamw_fp8_step_impl,
        _stack(weights),
        _joined(grads),
        _stack(exp_avgs),
        _stack(exp_avg_sqs),
        None if masters[0] is None else _stack(masters),
        copies.q[slots],
        copies.q_t[slots],
        copies.scale[slots],
        None if copies.scale_t is None else copies.scale_t[slots],
        float(lr),
        float(betas[0]),
        float(betas[1]),
        float(eps),
        float(weight_decay),
        int(step),
        copies.block,
    )
    for offset, weight in enumerate(weights):
        copies.stamp(first + offset, weight)
