"""Autotuner hooks shared by the kernels that can accumulate into their output."""

from __future__ import annotations

import functools

import torch
import triton.testing
from triton.tools.tensor_descriptor import TensorDescriptor

__all__ = ["KeepAccumulatedOutput", "tuning_bench"]

# Timing of one autotune candidate: 10 ms of warm-up and a 40 ms window. Triton's default (25 + 100 ms)
# makes the first call of every new GEMM shape cost seconds; configs that differ by less than the
# shorter window resolves are interchangeable.
tuning_bench = functools.partial(triton.testing.do_bench, warmup=10, rep=40)


class KeepAccumulatedOutput:
    """``pre_hook``/``post_hook`` pair: timing runs of an accumulating launch (``ACCUMULATE`` true) must
    leave the caller's output unchanged, so it is saved before tuning and restored after."""

    def __init__(self, out_arg: str) -> None:
        self.out_arg = out_arg
        self.saved: torch.Tensor | None = None

    def _out(self, nargs: dict) -> torch.Tensor:
        out = nargs[self.out_arg]
        return out.base if isinstance(out, TensorDescriptor) else out

    def save(self, nargs: dict, reset_only: bool = False) -> None:
        if nargs.get("ACCUMULATE") and not reset_only:
            self.saved = self._out(nargs).clone()

    def restore(self, nargs: dict, exception: BaseException | None) -> None:
        if self.saved is not None:
            self._out(nargs).copy_(self.saved)
            self.saved = None
