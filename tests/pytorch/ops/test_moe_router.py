"""MoE router: routing map, probs and aux-loss scores against the fp64 reference, gradients to the logits
from both outputs, group-limited selection with expert bias, the op contract and bad input."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.pytorch.kernels.moe import router_impl as impl
from primus_turbo.pytorch.ops import fused_group_topk_routing_with_aux_score as route
from tests.pytorch.ref.moe_ref import router_ref
from tests.pytorch.test_utils import DEVICES

DEVICE = DEVICES[0]
# (tokens, experts, topk, groups, selected groups, score function, scaling, expert bias)
CASES = {
    "deepseek-v3": (37, 64, 8, 8, 4, "sigmoid", 2.5, True),
    "qwen-softmax": (33, 60, 4, 1, 1, "softmax", 1.0, False),
    "mixtral": (50, 8, 2, 1, 1, "softmax", 1.0, False),
    "top1-sigmoid": (20, 16, 1, 1, 1, "sigmoid", 1.0, True),
    "groups-softmax": (25, 32, 4, 4, 2, "softmax", 1.0, False),
}
if DEVICE == "cuda":
    CASES["deepseek-v3-full"] = (4096, 256, 8, 8, 4, "sigmoid", 2.5, True)


def _inputs(tokens, experts, bias, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen).to(DEVICE, dtype).requires_grad_()
    expert_bias = (torch.randn(experts, generator=gen) * 0.1).to(DEVICE) if bias else None
    return logits, expert_bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name, dtype):
    tokens, experts, topk, groups, selected, function, scaling, bias = CASES[name]
    logits, expert_bias = _inputs(tokens, experts, bias, dtype)
    probs, routing_map, aux = route(logits, topk, groups, selected, function, scaling, expert_bias)
    leaf = logits.detach().clone().requires_grad_()
    ref_probs, ref_map, ref_aux = router_ref(leaf, topk, groups, selected, function, scaling, expert_bias)
    assert routing_map.dtype == torch.bool and torch.equal(routing_map, ref_map)
    assert (routing_map.sum(-1) == topk).all()
    assert probs.dtype == aux.dtype == torch.float32
    torch.testing.assert_close(probs.double(), ref_probs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(aux.double(), ref_aux, rtol=1e-5, atol=1e-6)
    gen = torch.Generator().manual_seed(1)
    gp, ga = (torch.randn(tokens, experts, generator=gen).to(DEVICE) for _ in range(2))
    ((probs * gp).sum() + (aux * ga).sum()).backward()
    ((ref_probs * gp.double()).sum() + (ref_aux * ga.double()).sum()).backward()
    assert logits.grad.dtype == dtype
    tol = {"rtol": 1e-4, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-3}
    torch.testing.assert_close(logits.grad.double(), leaf.grad.double(), **tol)


@pytest.mark.parametrize("name", ["deepseek-v3", "mixtral"])
def test_triton_and_torch_paths_agree(name):
    tokens, experts, topk, groups, selected, function, scaling, bias = CASES[name]
    logits, expert_bias = _inputs(tokens, experts, bias)
    options = (topk, groups, selected, function == "softmax", scaling)
    torch_out = impl.router_fwd_reference(logits.detach(), expert_bias, *options)
    fused = impl.moe_router_fwd_impl(logits.detach(), expert_bias, *options)
    assert torch.equal(fused[1], torch_out[1])
    torch.testing.assert_close(fused[0], torch_out[0], rtol=1e-6, atol=1e-7)
    grads = [torch.randn_like(torch_out[0]) for _ in range(2)]
    bwd_options = (topk, function == "softmax", scaling)
    expected = impl.router_bwd_reference(logits.detach(), torch_out[1], *grads, *bwd_options)
    actual = impl.moe_router_bwd_impl(logits.detach(), fused[1], *grads, *bwd_options)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-7)


def test_expert_bias_moves_the_selection_not_the_weights():
    logits, _ = _inputs(16, 8, False)
    bias = torch.zeros(8, device=DEVICE)
    bias[3] = 100.0
    probs, routing_map, _ = route(logits.detach(), 2, score_function="sigmoid", expert_bias=bias)
    assert routing_map[:, 3].all()
    scores = torch.sigmoid(logits.detach())
    picked = torch.where(routing_map, scores, 0.0)
    torch.testing.assert_close(probs, picked / picked.sum(-1, keepdim=True))


def test_probs_gradient_only_and_empty_tokens():
    logits, _ = _inputs(9, 16, False)
    probs, _, _ = route(logits, 4)
    probs.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    empty = torch.zeros(0, 16, device=DEVICE, requires_grad=True)
    probs, routing_map, aux = route(empty, 4)
    (probs.sum() + aux.sum()).backward()
    assert probs.shape == routing_map.shape == (0, 16) and empty.grad.shape == (0, 16)


def test_opcheck_and_compile():
    logits, bias = _inputs(12, 32, True)
    args = (logits.detach(), bias, 4, 4, 2, False, 2.0)
    torch.library.opcheck(impl.moe_router_fwd_impl, args)
    probs, routing_map, _ = impl.moe_router_fwd_impl(*args)
    bwd = (logits.detach(), routing_map, torch.randn_like(probs), torch.randn_like(probs), 4, False, 2.0)
    torch.library.opcheck(impl.moe_router_bwd_impl, bwd)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda x: route(x, 4, 4, 2, "sigmoid", 2.0, bias), fullgraph=True, backend="aot_eager"
    )
    probs, _, aux = compiled(logits)
    (probs.sum() + aux.square().sum()).backward()
    assert logits.grad is not None


@pytest.mark.parametrize("used", ["probs", "aux"])
@pytest.mark.parametrize("name", ["deepseek-v3", "mixtral"])
def test_backward_of_one_used_output(name, used):
    """An unused output's gradient reaches the kernel as None (not a zero tensor) and counts as zero."""
    tokens, experts, topk, groups, selected, function, scaling, bias = CASES[name]
    logits, expert_bias = _inputs(tokens, experts, bias)
    probs, _, aux = route(logits, topk, groups, selected, function, scaling, expert_bias)
    grad = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    ((probs if used == "probs" else aux) * grad).sum().backward()
    zero = torch.zeros_like(grad)
    grads = (grad, zero) if used == "probs" else (zero, grad)
    _, routing, _ = impl.router_fwd_reference(logits.detach(), expert_bias, topk, groups, selected,
                                              function == "softmax", scaling)  # fmt: skip
    expected = impl.router_bwd_reference(
        logits.detach(), routing, *grads, topk, function == "softmax", scaling
    )
    torch.testing.assert_close(logits.grad, expected, rtol=1e-5, atol=1e-7)
    none_grads = (grad, None) if used == "probs" else (None, grad)
    bwd = (logits.detach(), routing, *none_grads, topk, function == "softmax", scaling)
    torch.library.opcheck(impl.moe_router_bwd_impl, bwd)


@pytest.mark.deterministic
def test_deterministic_bitwise():
    results = []
    for _ in range(3):
        logits, bias = _inputs(64, 64, True)
        probs, _, aux = route(logits, 8, 8, 4, "sigmoid", 2.5, bias)
        (probs.sum() + aux.sum()).backward()
        results.append((probs, aux, logits.grad))
    assert all(torch.equal(x, y) for other in results[1:] for x, y in zip(results[0], other, strict=True))


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"topk": 0}, ValueError, "topk must be a positive int"),
        ({"topk": 70}, ValueError, "exceeds"),
        ({"groups": 3}, ValueError, "power of two"),
        ({"groups": 8, "selected_groups": 3, "topk": 8}, ValueError, "divide topk"),
        ({"groups": 8, "selected_groups": 1, "topk": 16}, ValueError, "eligible experts"),
        ({"selected_groups": 2}, ValueError, "without groups"),
        ({"score_function": "relu"}, ValueError, "score_function"),
        ({"expert_bias": "bias"}, TypeError, "expert_bias must be a torch.Tensor"),
    ],
)
def test_bad_input_raises_clear_error(kwargs, error, match):
    logits, _ = _inputs(4, 64, False)
    options = {"topk": 4, **kwargs}
    with pytest.raises(error, match=match):
        route(logits, **options)
    with pytest.raises(TypeError, match="logits.dtype"):
        route(logits.int(), 2)


def test_strided_bias_and_ties_route_alike_on_both_paths():
    wide = torch.zeros(16, device=DEVICE)
    wide[14] = 10.0
    bias = wide[0::2]  # expert 7 biased, a strided view
    logits, _ = _inputs(4, 8, False)
    _, routing_map, _ = route(logits.detach(), 2, score_function="sigmoid", expert_bias=bias)
    assert routing_map[:, 7].all()
    # equal scores: both paths pick the lowest expert indices
    flat = torch.zeros(3, 64, device=DEVICE)
    options = (4, 8, 2, False, 1.0)
    fused = impl.moe_router_fwd_impl(flat, None, *options)[1]
    reference = impl.router_fwd_reference(flat, None, *options)[1]
    assert torch.equal(fused, reference) and fused[:, :4].all()
