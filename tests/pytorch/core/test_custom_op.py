"""The eager shortcuts of ``core.custom_op``: an op's body or autograd's C++ ``apply`` run directly only
where nothing could observe the difference, and give the same results as the full path."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from primus_turbo.pytorch.core.custom_op import apply_function, call_op, custom_op, direct_call_allowed


@custom_op("primus_turbo_test::scaled", mutates_args=())
def _scaled(x: torch.Tensor, alpha: float) -> torch.Tensor:
    return x * alpha


@_scaled.register_fake
def _scaled_fake(x, alpha):
    return torch.empty_like(x)


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha):
        ctx.save_for_backward(x)
        ctx.alpha = alpha
        return x * x * alpha

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 2 * x * ctx.alpha, None


class _Subclass(torch.Tensor):
    pass


class _PassThrough(TorchFunctionMode):
    """A torch-function mode that observes every call and changes nothing."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_direct_only_in_plain_eager():
    x = torch.randn(3)
    assert direct_call_allowed(x, 2.0, None)
    assert not direct_call_allowed(x.as_subclass(_Subclass))
    with _PassThrough():
        assert not direct_call_allowed(x)
    with torch.autograd.profiler.profile():
        assert not direct_call_allowed(x)


def test_call_op_runs_the_body_directly_or_through_the_op():
    x = torch.randn(4)
    torch.testing.assert_close(call_op(_scaled, x, 3.0), x * 3.0)
    with _PassThrough():
        torch.testing.assert_close(call_op(_scaled, x, 3.0), x * 3.0)


def test_apply_function_matches_apply_with_gradients():
    for mode in (None, _PassThrough()):
        x = torch.randn(5, requires_grad=True)
        ref = torch.randn(5).copy_(x.detach()).requires_grad_()
        if mode is None:
            out = apply_function(_Square, x, 1.5)
        else:
            with mode:
                out = apply_function(_Square, x, 1.5)
        out.sum().backward()
        _Square.apply(ref, 1.5).sum().backward()
        assert out.grad_fn is not None and type(out.grad_fn).__name__ == "_SquareBackward"
        torch.testing.assert_close(x.grad, ref.grad)


def test_apply_function_compiles_fullgraph():
    def step(x):
        return apply_function(_Square, x, 2.0).sum()

    x = torch.randn(6, requires_grad=True)
    torch.compile(step, fullgraph=True, backend="aot_eager")(x).backward()
    torch.testing.assert_close(x.grad, 4 * x.detach())
