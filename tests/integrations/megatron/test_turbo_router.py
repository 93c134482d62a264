"""The Turbo top-k routing in the place of Megatron's ``topk_routing_with_score_function``: the same probs,
routing map and logits gradient as Megatron's for each score function, group-limited routing, expert bias
and scaling; what it cannot answer the same way goes to Megatron's own function."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.integrations.megatron.router import turbo_topk_routing

CASES = {
    "softmax": dict(score_function="softmax"),
    "softmax-pre": dict(score_function="softmax", use_pre_softmax=True, scaling_factor=2.0),
    "softmax-pre-groups": dict(score_function="softmax", use_pre_softmax=True, num_groups=4, group_topk=2),
    "softmax-scaled": dict(score_function="softmax", scaling_factor=2.5),
    "sigmoid": dict(score_function="sigmoid"),
    "sigmoid-bias-groups": dict(
        score_function="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.5, bias=True
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_megatron(case):
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function as megatron_topk

    options = dict(CASES[case])
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 16, generator=gen, dtype=torch.float32)
    if options.pop("bias", False):
        options["expert_bias"] = torch.randn(16, generator=gen) * 0.1
    weights = torch.randn(64, 16, generator=gen)
    results = []
    for fn in (megatron_topk, turbo_topk_routing(megatron_topk)):
        x = logits.clone().requires_grad_()
        probs, routing_map = fn(x, 4, **options)
        (probs * weights).sum().backward()
        results.append((probs.detach(), routing_map, x.grad))
    (p_ref, m_ref, g_ref), (p, m, g) = results
    assert torch.equal(m, m_ref)
    torch.testing.assert_close(p, p_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-6)


def test_what_it_cannot_answer_goes_to_megatron():
    calls = []

    def original(*args, **kwargs):
        calls.append(args)
        return "megatron"

    routed = turbo_topk_routing(original)
    logits = torch.randn(8, 16)
    assert routed(logits, 2, num_groups=4, group_topk=2) == "megatron"  # softmax after a grouped top-k
    assert routed(logits, 2, router_replay=object()) == "megatron"
    assert routed(logits, 2, dense_output=True) == "megatron"
    assert routed(logits, 2, score_function="sqrtsoftplus") == "megatron"
    assert len(calls) == 4
    probs, routing_map = routed(logits, 2)
    assert routing_map.sum(dim=1).eq(2).all() and len(calls) == 4
