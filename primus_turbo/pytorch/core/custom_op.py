"""When eager code may skip the ``torch.library`` boundary of a custom op.

The custom ops exist for ``torch.compile``, tracing, fake tensors and the profiler. In plain eager
mode, going through the op adds host time (argument re-binding, autograd and dispatch wrappers) that
short kernels cannot hide on a slow host. Public ops therefore call the op's body directly when
nothing could observe the difference, and call the custom op otherwise. ``apply_function`` does the
same for ``torch.autograd.Function.apply``, whose Python wrapper (default-argument binding, functorch
dead-wrapper unwrapping) costs about as much as the C++ node it creates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["apply_function", "call_op", "custom_op", "direct_call_allowed"]

_BODIES: dict[object, Callable[..., Any]] = {}

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_is_compiling = torch.compiler.is_compiling
_tracing_state = torch._C._get_tracing_state
_torch_function_mode = torch._C._is_torch_function_mode_enabled
_dispatch_stack = torch._C._len_torch_dispatch_stack
_functorch_active = torch._C._are_functorch_transforms_active
_profiler_enabled = torch.autograd._profiler_enabled
_C_APPLY = torch._C._FunctionBase.__dict__["apply"]


def _mode_free() -> bool:
    """No compile, trace, torch-function or dispatch mode, functorch transform or profiler is active."""
    return not (
        _is_compiling()
        or _tracing_state() is not None
        or _torch_function_mode()
        or _dispatch_stack()
        or _functorch_active()
        or _profiler_enabled()
    )


def direct_call_allowed(*tensors: object) -> bool:
    """True in eager mode with plain tensors and no compile, trace, mode, transform or profiler active.

    Non-tensor arguments may be passed too; they are ignored."""
    if not _mode_free():
        return False
    for t in tensors:
        cls = type(t)
        if cls is not _Tensor and cls is not _Parameter and isinstance(t, _Tensor):
            return False
    return True


def custom_op(name: str, mutates_args: Iterable[str] | str = ()) -> Callable[[Callable[..., Any]], Any]:
    """``torch.library.custom_op`` that also remembers the op's Python body for ``call_op``."""

    def register(body: Callable[..., Any]) -> Any:
        op = torch.library.custom_op(name, mutates_args=mutates_args)(body)
        _BODIES[op] = body
        return op

    return register


def call_op(op: Any, *args: Any) -> Any:
    """Run custom op ``op``: its body directly where ``direct_call_allowed``, else through torch.library."""
    if direct_call_allowed(*args):
        return _BODIES[op](*args)
    return op(*args)


def apply_function(fn: type[torch.autograd.Function], *args: Any) -> Any:
    """``fn.apply(*args)``, straight into autograd's C++ entry where ``direct_call_allowed`` (positional
    arguments only; ``fn`` must not define ``setup_context``)."""
    if direct_call_allowed(*args):
        return _C_APPLY.__get__(None, fn)(*args)
    return fn.apply(*args)
