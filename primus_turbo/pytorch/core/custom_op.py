"""When eager code may skip the ``torch.library`` boundary of a custom op.

The custom ops exist for ``torch.compile``, tracing, fake tensors and the profiler. In plain eager
mode, going through the op adds host time (argument re-binding, autograd and dispatch wrappers) that
short kernels cannot hide on a slow host. Public ops therefore call the op's body directly when
nothing could observe the difference, and call the custom op otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["call_op", "custom_op", "direct_call_allowed"]

_BODIES: dict[object, Callable[..., Any]] = {}

_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def direct_call_allowed(*tensors: torch.Tensor) -> bool:
    """True in eager mode with plain tensors and no compile, trace, mode, transform or profiler active."""
    return not (
        torch.compiler.is_compiling()
        or torch._C._get_tracing_state() is not None
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._len_torch_dispatch_stack() > 0
        or torch._C._are_functorch_transforms_active()
        or torch.autograd._profiler_enabled()
        or any(type(t) not in _PLAIN_TENSOR_TYPES for t in tensors)
    )


def custom_op(name: str, mutates_args: Iterable[str] | str = ()) -> Callable[[Callable[..., Any]], Any]:
    """``torch.library.custom_op`` that also remembers the op's Python body for ``call_op``."""

    def register(body: Callable[..., Any]) -> Any:
        op = torch.library.custom_op(name, mutates_args=mutates_args)(body)
        _BODIES[op] = body
        return op

    return register


def call_op(op: Any, *args: Any) -> Any:
    """Run custom op ``op``: its body directly where ``direct_call_allowed``, else through torch.library."""
    if direct_call_allowed(*(a for a in args if isinstance(a, torch.Tensor))):
        return _BODIES[op](*args)
    return op(*args)
