"""``FusedAdamW``: ``torch.optim.AdamW`` whose step also writes the FP8 copies of weights that have FP8
primary copies (``ops.fp8_primary``), one kernel per weight (per layer for its experts), so no forward
quantizes them.

Other parameters take ``torch.optim.AdamW``'s own step. The state keeps AdamW's keys (``step``,
``exp_avg``, ``exp_avg_sq``; fp32 moments for FP8-primary weights) and, with ``master_weights``, an fp32
``master_param`` per FP8-primary low-precision weight: the state dict loads into ``torch.optim.AdamW``
and the model's weights stay a plain bf16 checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from primus_turbo.pytorch.ops.fp8_primary import adamw_fp8_step_, back_to_back, fp8_primary_of

__all__ = ["FusedAdamW"]

_UNSUPPORTED = ("amsgrad", "capturable", "differentiable")
_FP32_STATE = ("exp_avg", "exp_avg_sq", "master_param")


class FusedAdamW(torch.optim.AdamW):
    """AdamW (``torch.optim.AdamW``'s arguments and update) writing FP8 primary weights in its step.

    ``master_weights``: keep an fp32 master copy of each FP8-primary bf16/fp16 weight and update that
    (the weight is then its rounding), as mixed-precision optimizers do. Weights may get their FP8 copies
    after the optimizer is made (a module makes them on its first FP8 forward). ``fused=True`` runs
    torch's fused kernel for the other parameters. Not supported for FP8-primary weights: ``amsgrad``,
    ``capturable``, ``differentiable``; sparse gradients."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        master_weights: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kwargs)
        self.master_weights = master_weights

    def _init_state(self, params: list[torch.Tensor]) -> None:
        """AdamW's state for FP8-primary weights: created where missing, fp32 (also after a state-dict
        load), masters where asked for. A layer's experts (slots of one set of copies) get each state
        tensor as slices of one allocation, so that their step runs as one kernel."""
        by_copies: dict[int, list[torch.Tensor]] = {}
        for p in params:
            by_copies.setdefault(id(fp8_primary_of(p)[0]), []).append(p)
        for members in by_copies.values():
            members.sort(key=lambda p: fp8_primary_of(p)[1])
            for p in members:
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                    state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                for key in ("exp_avg", "exp_avg_sq"):
                    if state[key].dtype != torch.float32 or not state[key].is_contiguous():
                        state[key] = state[key].float().contiguous()
                if self.master_weights and p.dtype != torch.float32 and "master_param" not in state:
                    state["master_param"] = p.detach().float().contiguous()
            for key in _FP32_STATE:
                tensors = [self.state[p].get(key) for p in members]
                if len(members) > 1 and all(t is not None for t in tensors) and not back_to_back(tensors):
                    joined = torch.stack(tensors)
                    for p, part in zip(members, joined, strict=True):
                        self.state[p][key] = part

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``torch.optim.Optimizer.load_state_dict``, keeping the fp32 moments and masters of FP8-primary
        weights fp32 (the base class casts every state tensor to its parameter's dtype)."""
        super().load_state_dict(state_dict)
        saved = state_dict["state"]
        for group, saved_group in zip(self.param_groups, state_dict["param_groups"], strict=True):
            for p, index in zip(group["params"], saved_group["params"], strict=True):
                if fp8_primary_of(p) is None or index not in saved:
                    continue
                for key in _FP32_STATE:
                    if key in saved[index]:
                        self.state[p][key] = saved[index][key].to(device=p.device, dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step: the fused FP8 step for FP8-primary weights, ``torch.optim.AdamW``'s for the rest."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        hidden = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None and fp8_primary_of(p) is not None]
            if not params:
                continue
            unsupported = [key for key in _UNSUPPORTED if group.get(key)]
            if unsupported:
                raise ValueError(f"FusedAdamW: FP8 primary weights do not support {', '.join(unsupported)}")
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("FusedAdamW does not support sparse gradients")
            self._init_state(params)
            # a layer's experts in slot order, so that the back-to-back ones run as one kernel
            primaries = {id(p): fp8_primary_of(p) for p in params}
            order: dict[int, int] = {}
            for p in params:
                order.setdefault(id(primaries[id(p)][0]), len(order))
            params.sort(key=lambda p: (order[id(primaries[id(p)][0])], primaries[id(p)][1]))
            for copies, _ in {id(c): (c, s) for c, s in primaries.values()}.values():
                if copies.owner is not self:
                    copies.owner = self  # the copies are rewritten in place every step from now on
            steps = [self.state[p]["step"] for p in params]
            torch._foreach_add_(steps, 1)
            by_step: dict[int, list[torch.Tensor]] = {}
            for p, step in zip(params, torch.stack(steps).tolist(), strict=True):
                by_step.setdefault(int(step), []).append(p)
            for step, stepped in by_step.items():
                states = [self.state[p] for p in stepped]
                masters = [s.get("master_param") for s in states]
                adamw_fp8_step_(
                    stepped,
                    [-p.grad if group["maximize"] else p.grad for p in stepped],
                    [s["exp_avg"] for s in states],
                    [s["exp_avg_sq"] for s in states],
                    lr=float(group["lr"]),
                    betas=group["betas"],
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    step=step,
                    masters=masters,
                )
            for p in params:
                hidden.append((p, p.grad))
                p.grad = None
        try:
            super().step()
        finally:
            for p, grad in hidden:
                p.grad = grad
        return loss
