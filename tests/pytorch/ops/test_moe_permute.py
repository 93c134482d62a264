"""MoE permutation: permute / unpermute against loop references, forward and backward, from routing maps
and from top-k indices with dropped routes, padding, fixed row counts, empty experts, FP8 scales carried,
the op contract and bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from primus_turbo.pytorch.kernels.moe import permute_impl as impl
from primus_turbo.pytorch.ops import moe_permute, moe_unpermute, tokens_per_expert_to_mask
from primus_turbo.triton.moe.permute_kernel import ScatterLaunch, scatter_rows_triton
from primus_turbo.triton.utils.device_info import triton_unavailable_reason
from tests.pytorch.ref.permutation_ref import permute_ref, permuted_probs_ref, unpermute_ref
from tests.pytorch.test_utils import DEVICES

DEVICE = DEVICES[0]


def _routing(tokens, experts, topk, seed=0, empty_expert=None):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=gen)
    if empty_expert is not None:
        scores[:, empty_expert] = -1.0
    top = scores.topk(topk, dim=-1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, top, True)
    probs = torch.rand(tokens, experts, generator=gen) * routing_map
    return top.to(DEVICE), routing_map.to(DEVICE), probs.to(DEVICE)


def _tokens(tokens, hidden, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype).requires_grad_()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pad_multiple", [0, 16])
def test_round_trip_matches_reference(pad_multiple, dtype):
    _, routing_map, probs = _routing(37, 8, 3, empty_expert=5)
    x = _tokens(37, 24, dtype)
    weights = probs.clone().requires_grad_()
    permuted, row_id_map, tokens_per_expert, permuted_probs, _ = moe_permute(
        x, routing_map, weights, num_local_experts=8, pad_multiple=pad_multiple
    )
    expected = permute_ref(x.detach(), routing_map, pad_multiple)
    assert torch.equal(permuted, expected)
    assert torch.equal(tokens_per_expert.cpu(), routing_map.sum(0).cpu()) and tokens_per_expert[5] == 0
    assert row_id_map.dtype == torch.int32 and ((row_id_map >= 0) == routing_map).all()
    torch.testing.assert_close(permuted_probs, permuted_probs_ref(probs.float(), routing_map, pad_multiple))
    # a per-row transform between the two, as the experts would apply
    scale = torch.linspace(0.5, 2.0, permuted.shape[0], device=DEVICE)[:, None]
    out = moe_unpermute(permuted * scale.to(dtype), row_id_map, weights)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    out.backward(grad)
    x_ref = x.detach().clone().requires_grad_()
    w_ref = probs.clone().requires_grad_()
    ref = unpermute_ref(
        permute_ref(x_ref, routing_map, pad_multiple) * scale.to(dtype), routing_map, w_ref, pad_multiple
    )
    ref.backward(grad)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    torch.testing.assert_close(x.grad.float(), x_ref.grad.float(), **tol)
    torch.testing.assert_close(weights.grad.float(), w_ref.grad.float() * routing_map, **tol)


def test_topk_indices_with_dropped_routes_and_topk_probs():
    top, _, _ = _routing(20, 6, 2, seed=3)
    top[::4, 1] = -1  # dropped second choice
    routing_map = torch.zeros(20, 7, dtype=torch.bool, device=DEVICE).scatter(
        1, torch.where(top < 0, 6, top), True
    )[:, :6]
    topk_probs = torch.rand(20, 2, device=DEVICE).requires_grad_()
    x = _tokens(20, 8)
    permuted, row_id_map, counts, permuted_probs, _ = moe_permute(x, top, topk_probs, num_local_experts=6)
    assert torch.equal(permuted, permute_ref(x.detach(), routing_map))
    assert int(counts.sum()) == int(routing_map.sum()) == 35
    out = moe_unpermute(permuted, row_id_map, topk_probs, topk_indices=top)
    expected = x.detach() * torch.where(top >= 0, topk_probs.detach(), 0.0).sum(-1, keepdim=True)
    torch.testing.assert_close(out, expected)
    (out.sum() + permuted_probs.sum()).backward()
    assert topk_probs.grad[::4, 1].abs().sum() == 0 and x.grad is not None


def test_fixed_row_count_pads_or_drops_without_host_sync():
    _, routing_map, probs = _routing(16, 4, 2, seed=4)
    x = _tokens(16, 8)
    permuted, row_id_map, counts, _, _ = moe_permute(
        x, routing_map, num_local_experts=4, num_permuted_tokens=40
    )
    assert permuted.shape == (40, 8) and permuted[32:].abs().sum() == 0
    mask = tokens_per_expert_to_mask(counts, 40)
    assert int(mask.sum()) == 32 and bool(mask[:32].all())
    short, short_map, _, _, _ = moe_permute(x, routing_map, num_local_experts=4, num_permuted_tokens=10)
    assert short.shape == (10, 8) and int((short_map >= 0).sum()) == 10
    assert torch.equal(short, permute_ref(x.detach(), routing_map)[:10])
    padded_mask = tokens_per_expert_to_mask(torch.tensor([3, 0, 5], device=DEVICE), 24, pad_multiple=4)
    assert padded_mask.tolist() == [True] * 3 + [False] + [True] * 5 + [False] * 15


def test_fp8_scales_follow_their_tokens():
    _, routing_map, _ = _routing(12, 4, 2, seed=5)
    x = _tokens(12, 32).detach().to(torch.float8_e4m3fn)
    scales = torch.rand(12, 2, device=DEVICE)
    permuted, _, _, _, permuted_scales = moe_permute(x, routing_map, num_local_experts=4, scales=scales)
    assert permuted.dtype == torch.float8_e4m3fn
    assert torch.equal(permuted.view(torch.uint8), permute_ref(x.view(torch.uint8), routing_map))
    assert torch.equal(permuted_scales, permute_ref(scales, routing_map))


def test_opcheck_and_compile():
    _, routing_map, probs = _routing(10, 4, 2, seed=6)
    x = _tokens(10, 16).detach()
    torch.library.opcheck(impl.moe_expert_layout_impl, (routing_map, 4, -1))
    torch.library.opcheck(impl.moe_expert_layout_impl, (routing_map, 0, 12))
    row_id_map, counts, start = impl.moe_expert_layout_impl(routing_map, 4, -1)
    rows = int(start[-1])
    torch.library.opcheck(impl.moe_expert_bounds_impl, (row_id_map,))
    torch.library.opcheck(impl.moe_scatter_rows_impl, (x, row_id_map, start, counts, None, rows, False))
    torch.library.opcheck(impl.moe_scatter_rows_impl, (x, row_id_map, start, counts, probs, rows, True))
    y = torch.randn(rows, 16, device=DEVICE)
    torch.library.opcheck(impl.moe_merge_rows_impl, (y, row_id_map, probs))
    torch.library.opcheck(impl.moe_route_dots_impl, (x, y, row_id_map))
    torch._dynamo.reset()

    def layer(x, w):
        permuted, row_id_map, _, _, _ = moe_permute(
            x, routing_map, num_local_experts=4, num_permuted_tokens=32
        )
        return moe_unpermute(permuted * 2.0, row_id_map, w)

    leaf, weights = x.clone().requires_grad_(), probs.clone().requires_grad_()
    out = torch.compile(layer, fullgraph=True, backend="aot_eager")(leaf, weights)
    out.sum().backward()
    torch.testing.assert_close(out, layer(x, probs))
    assert leaf.grad is not None and weights.grad is not None


def test_bad_input_raises_clear_error():
    top, routing_map, probs = _routing(8, 4, 2)
    x = _tokens(8, 4).detach()
    with pytest.raises(ValueError, match="columns"):
        moe_permute(x, routing_map, num_local_experts=5)
    with pytest.raises(TypeError, match="int32/int64"):
        moe_permute(x, top.float(), num_local_experts=4)
    with pytest.raises(ValueError, match="rows for"):
        moe_permute(x[:7], routing_map, num_local_experts=4)
    with pytest.raises(ValueError, match="probs must match"):
        moe_permute(x, routing_map, probs[:, :2], num_local_experts=4)
    with pytest.raises(ValueError, match="pad_multiple"):
        moe_permute(x, routing_map, num_local_experts=4, pad_multiple=-1)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="top-k indices"):
            moe_permute(x, top + 3, num_local_experts=4)
    with pytest.raises(TypeError, match="int32 map"):
        moe_unpermute(x, routing_map.long())


@pytest.mark.parametrize(("pad_multiple", "num_rows"), [(8, -1), (0, -1), (4, 9), (0, 40)])
def test_torch_fallback_matches_the_kernels(monkeypatch, pad_multiple, num_rows):
    _, routing_map, probs = _routing(70, 5, 2, seed=8, empty_expert=2)
    x = _tokens(70, 20).detach()

    def run():
        layout = impl.moe_expert_layout_impl(routing_map, pad_multiple, num_rows)
        row_id_map, counts, start = layout
        rows = num_rows if num_rows > 0 else int(start[-1])
        y = torch.randn(rows, 20, generator=torch.Generator().manual_seed(3)).to(DEVICE)
        bounds = impl.moe_expert_bounds_impl(row_id_map)
        routed = counts > 0
        return (
            row_id_map, counts, start[:-1][routed], start[-1], bounds[0][routed], bounds[1],
            *impl.moe_scatter_rows_impl(x, row_id_map, start, counts, None, rows, False),
            *impl.moe_scatter_rows_impl(x, row_id_map, *bounds, probs, rows, True),
            impl.moe_merge_rows_impl(y, row_id_map, probs),
            impl.moe_route_dots_impl(x[:, :20], y, row_id_map),
        )  # fmt: skip

    kernels = run()
    monkeypatch.setattr(impl, "triton_runs_on", lambda device: False)
    fallback = run()
    for mine, theirs in zip(kernels, fallback, strict=True):
        torch.testing.assert_close(mine, theirs.to(mine.dtype), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("pad_multiple", "num_rows"), [(0, -1), (8, -1), (4, 9), (0, 40), (0, 50)])
def test_eager_torch_expression_matches_the_custom_ops(monkeypatch, pad_multiple, num_rows):
    """The CPU's eager expression (PyTorch autograd, no custom op) gives the custom ops' results bitwise
    (on a GPU within the atomics' rounding), forward and backward, from top-k indices with dropped routes,
    padding and fixed row counts."""
    from primus_turbo.pytorch.ops.moe import permute as permute_op

    monkeypatch.setattr(impl, "triton_runs_on", lambda device: False)
    top, _, _ = _routing(30, 6, 3, seed=4, empty_expert=1)
    top[::7, 0] = -1
    probs = torch.rand(top.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE)

    def run():
        x, p = _tokens(30, 12, seed=6), probs.clone().requires_grad_()
        scales = torch.rand(30, 2, generator=torch.Generator().manual_seed(7)).to(DEVICE)
        permuted, row_id_map, counts, permuted_probs, permuted_scales = moe_permute(
            x, top, p, num_local_experts=6, pad_multiple=pad_multiple, num_permuted_tokens=num_rows,
            scales=scales,
        )  # fmt: skip
        out = moe_unpermute(permuted * permuted_probs[:, None], row_id_map, p, topk_indices=top)
        out.square().sum().backward()
        return permuted, row_id_map, counts, permuted_probs, permuted_scales, out, x.grad, p.grad

    eager = run()
    monkeypatch.setattr(permute_op, "direct_call_allowed", lambda *tensors: False)
    for mine, theirs in zip(eager, run(), strict=True):
        if DEVICE == "cpu" or not mine.is_floating_point():
            assert torch.equal(mine, theirs)
        else:  # CUDA's index_add, which both expressions use to merge rows, adds in an atomic order
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)


def test_torch_fallback_takes_empty_and_fp8_inputs(monkeypatch):
    monkeypatch.setattr(impl, "triton_runs_on", lambda device: False)
    x = torch.randn(6, 8, device=DEVICE)
    nothing = torch.full((6, 2), -1, dtype=torch.int64, device=DEVICE)
    permuted, row_id_map, counts, _, _ = moe_permute(x, nothing, num_local_experts=4)
    assert permuted.shape == (0, 8) and int(counts.sum()) == 0
    assert not moe_unpermute(permuted, row_id_map).any()
    _, routing_map, _ = _routing(6, 4, 2)
    fp8 = x.to(torch.float8_e4m3fn)
    permuted, _, _, _, _ = moe_permute(fp8, routing_map, num_local_experts=4, num_permuted_tokens=16)
    expected = permute_ref(fp8.view(torch.uint8), routing_map)
    assert torch.equal(permuted.view(torch.uint8)[: expected.shape[0]], expected)


def test_counts_leave_out_routes_past_a_fixed_row_count():
    _, routing_map, _ = _routing(16, 4, 2, seed=4)
    x = _tokens(16, 8).detach()
    _, row_id_map, counts, _, _ = moe_permute(x, routing_map, num_local_experts=4, num_permuted_tokens=10)
    assert int(counts.sum()) == int((row_id_map >= 0).sum()) == 10


@pytest.mark.skipif(triton_unavailable_reason() is not None, reason="needs Triton (GPU or interpreter)")
@pytest.mark.parametrize(
    "launch",
    [ScatterLaunch(16, 4, True, False), ScatterLaunch(16, 2, False, False), ScatterLaunch(32, 8, True, True)],
    ids=str,
)
def test_scatter_launches_agree(launch):
    _, routing_map, probs = _routing(45, 6, 2, seed=9, empty_expert=4)
    x = _tokens(45, 40).detach()
    row_id_map, counts, start = impl.moe_expert_layout_impl(routing_map, 8, 120)
    for weights, scale in ((None, False), (probs, True)):
        expected = scatter_rows_triton(x, row_id_map, start, counts, weights, 120, scale)
        got = scatter_rows_triton(x, row_id_map, start, counts, weights, 120, scale, launch)
        for mine, theirs in zip(got, expected, strict=True):
            assert torch.equal(mine, theirs)


@settings(max_examples=30 if DEVICE == "cuda" else 4, deadline=None, derandomize=True)
@given(
    tokens=st.integers(1, 70),
    experts=st.integers(1, 9),
    hidden=st.integers(1, 40),
    topk_share=st.floats(0.0, 1.0),
    pad_multiple=st.sampled_from([0, 1, 3, 8]),
    cap_share=st.sampled_from([0.0, 0.5, 1.0, 1.5]),
    topk_input=st.booleans(),
)
def test_permute_round_trip_on_fuzzed_routing(
    tokens, experts, hidden, topk_share, pad_multiple, cap_share, topk_input
):
    """Random token and expert counts (experts with no tokens, tokens with no route), paddings, fixed row
    counts that cut routes or leave spare rows, both routing inputs: rows, counts and the weighted round
    trip against the references, gradients included."""
    topk = max(1, round(topk_share * experts))
    gen = torch.Generator().manual_seed(tokens * 131 + experts * 7 + hidden)
    top = torch.rand(tokens, experts, generator=gen).topk(topk, dim=-1).indices
    top = torch.where(torch.rand(tokens, topk, generator=gen) < 0.2, -1, top)  # dropped routes
    routing_map = torch.zeros(tokens, experts + 1, dtype=torch.bool).scatter(
        1, torch.where(top < 0, experts, top), True
    )
    routing_map = routing_map[:, :experts].to(DEVICE)
    probs = (torch.rand(tokens, experts, generator=gen).to(DEVICE) * routing_map).requires_grad_()
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE).requires_grad_()
    full = permute_ref(x.detach(), routing_map, pad_multiple)
    rows = round(cap_share * full.shape[0]) if cap_share else -1
    expert_map = top.to(DEVICE) if topk_input else routing_map
    weights = (
        probs.gather(1, torch.where(top < 0, 0, top).to(DEVICE)) * (top >= 0).to(DEVICE)
        if topk_input
        else probs
    )
    permuted, row_id_map, counts, permuted_probs, _ = moe_permute(
        x, expert_map, weights, num_local_experts=experts, pad_multiple=pad_multiple, num_permuted_tokens=rows
    )
    kept = full.shape[0] if rows < 0 else min(rows, full.shape[0])
    assert permuted.shape[0] == (full.shape[0] if rows < 0 else rows)
    assert torch.equal(permuted[:kept], full[:kept]) and not permuted[kept:].any()
    assert int(counts.sum()) == int((row_id_map >= 0).sum())
    expected_probs = permuted_probs_ref(probs.detach(), routing_map, pad_multiple)[:kept]
    torch.testing.assert_close(permuted_probs[:kept], expected_probs)
    out = moe_unpermute(permuted, row_id_map, weights, topk_indices=expert_map if topk_input else None)
    kept_map = row_id_map >= 0
    expected = (x.detach()[:, None, :] * torch.where(kept_map, probs.detach(), 0.0)[..., None]).sum(1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    (out.sum() + permuted_probs.sum()).backward()
    grad_x = torch.where(kept_map, probs.detach(), 0.0).sum(1, keepdim=True).expand_as(x)
    torch.testing.assert_close(x.grad, grad_x, rtol=1e-5, atol=1e-5)
    grad_probs = torch.where(kept_map, x.detach().sum(1, keepdim=True) + 1.0, 0.0)
    torch.testing.assert_close(probs.grad, grad_probs, rtol=1e-5, atol=1e-5)
