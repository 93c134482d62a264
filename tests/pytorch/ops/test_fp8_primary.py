"""FP8 primary weights: the fused AdamW step against the TORCH reference and torch.optim.AdamW, its FP8
copies equal to quantizing the stored weight (bit for bit), experts' slots, staleness, the op contract
and bad input."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, Format, ScalingGranularity
from primus_turbo.pytorch.kernels.optim import adamw_fp8_impl as impl
from primus_turbo.pytorch.ops import quantize_fp8_experts, quantize_fp8_weight
from primus_turbo.pytorch.ops.fp8_primary import Fp8PrimaryWeight, adamw_fp8_step_, fp8_primary_of
from tests.pytorch.test_utils import DEVICES

DEVICE = DEVICES[0]
G = ScalingGranularity
BLOCK = 128 if DEVICE == "cuda" else 32
CONFIGS = {
    "tensorwise": Float8QuantConfig(),
    "blockwise": Float8QuantConfig(granularity=G.BLOCKWISE, block_size=BLOCK),
}
# E5M2 copies (Format.E5M2 runs every operand in it)
E5M2_CONFIGS = {
    "tensorwise-e5m2": Float8QuantConfig(format=Format.E5M2),
    "blockwise-e5m2": Float8QuantConfig(format=Format.E5M2, granularity=G.BLOCKWISE, block_size=BLOCK),
}
SHAPE = (2 * BLOCK, 3 * BLOCK)
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _randn(shape, dtype=torch.float32, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEVICE)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _state(shape):
    return torch.zeros(shape, device=DEVICE), torch.zeros(shape, device=DEVICE)


def _assert_copies_match_weight(copies: Fp8PrimaryWeight, weight: torch.Tensor, config) -> None:
    """The FP8 copies are what ``quantize_fp8_weight`` makes of the weight as stored."""
    made = quantize_fp8_weight(weight, config)
    assert torch.equal(_bits(copies.q[0]), _bits(made.data))
    assert torch.equal(_bits(copies.q_t[0]), _bits(made.data_t))
    assert torch.equal(copies.scale.view(-1), made.scale_inv.reshape(-1))
    if copies.scale_t is not None:
        assert torch.equal(copies.scale_t[0], made.scale_inv_t)


@pytest.mark.parametrize("name", [*CONFIGS, *E5M2_CONFIGS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_copies_equal_quantized_weight(name, dtype):
    """After every fused step the copies are the quantization of the stored weight, and the update is
    the TORCH reference's."""
    config = {**CONFIGS, **E5M2_CONFIGS}[name]
    weight, ref = _randn(SHAPE, dtype), _randn(SHAPE, dtype)
    copies = Fp8PrimaryWeight([weight], config, experts=False)
    ref_copies = Fp8PrimaryWeight([ref], config, experts=False)
    m, v = _state(SHAPE)
    rm, rv = _state(SHAPE)
    for step in (1, 2, 3):
        grad = _randn(SHAPE, dtype, seed=step)
        adamw_fp8_step_(weight, grad, m, v, step=step, **HYPER)
        args = [t.view(1, *SHAPE) for t in (ref, grad, rm, rv)]
        st = ref_copies.scale_t
        impl.adamw_fp8_step_reference(
            *args, None, ref_copies.q, ref_copies.q_t, ref_copies.scale, st,
            HYPER["lr"], *HYPER["betas"], HYPER["eps"], HYPER["weight_decay"], step, ref_copies.block,
        )  # fmt: skip
        _assert_copies_match_weight(copies, weight, config)
        assert copies.fresh([weight])
    if dtype is not torch.float32:
        # a step smaller than a 16-bit ulp rounds to no move or one ulp: an fp32 rounding difference in the
        # update (fused multiply-adds, division) can flip that, at most one ulp a step
        ulp = ref.float().abs() * 2.0 ** (-7 if dtype is torch.bfloat16 else -10)
        assert ((weight.float() - ref.float()).abs() <= 3 * ulp).all()
    else:
        torch.testing.assert_close(weight, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m, rm, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v, rv, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("block", [64, 128])
def test_blocks_updated_in_several_chunks(block):
    """2-D blocks larger than the kernel's 32-row update chunk: the tile's amax gathers every chunk."""
    config = Float8QuantConfig(granularity=G.BLOCKWISE, block_size=block)
    weight = _randn((2 * block, block), torch.bfloat16)
    weight[block + 5, 7] = 40.0  # the largest value sits in a later chunk of the second tile
    copies = Fp8PrimaryWeight([weight], config, experts=False)
    m, v = _state(weight.shape)
    adamw_fp8_step_(weight, _randn(weight.shape, torch.bfloat16, seed=1), m, v, step=1, **HYPER)
    _assert_copies_match_weight(copies, weight, config)


def test_update_matches_torch_adamw():
    """fp32 weight: three fused steps land where ``torch.optim.AdamW`` does."""
    weight = _randn(SHAPE)
    reference = torch.nn.Parameter(weight.clone())
    copies = Fp8PrimaryWeight([weight], CONFIGS["tensorwise"], experts=False)
    torch_opt = torch.optim.AdamW([reference], **HYPER)
    m, v = _state(SHAPE)
    for step in (1, 2, 3):
        grad = _randn(SHAPE, seed=step)
        adamw_fp8_step_(weight, grad, m, v, step=step, **HYPER)
        reference.grad = grad.clone()
        torch_opt.step()
    torch.testing.assert_close(weight, reference.detach(), rtol=1e-5, atol=1e-6)
    assert copies.fresh([weight])


def test_master_weight():
    """With an fp32 master the update runs on it and the bf16 weight is its rounding."""
    config = CONFIGS["blockwise"]
    master = _randn(SHAPE)
    weight = master.to(torch.bfloat16)
    copies = Fp8PrimaryWeight([weight], config, experts=False)
    fp32 = master.clone()
    m, v = _state(SHAPE)
    fm, fv = _state(SHAPE)
    for step in (1, 2):
        grad = _randn(SHAPE, torch.bfloat16, seed=step)
        adamw_fp8_step_(weight, grad, m, v, step=step, masters=master, **HYPER)
        fp32_copies = Fp8PrimaryWeight([fp32], CONFIGS["tensorwise"], experts=False)
        adamw_fp8_step_(fp32, grad.float(), fm, fv, step=step, **HYPER)
        del fp32_copies
    torch.testing.assert_close(master, fp32, rtol=1e-5, atol=1e-6)
    assert torch.equal(weight, master.to(torch.bfloat16))
    _assert_copies_match_weight(copies, weight, config)


@pytest.mark.parametrize("name", CONFIGS)
def test_experts_slots(name):
    """Each expert's step writes its own slot; together they are ``quantize_fp8_experts`` of the stack."""
    config = CONFIGS[name]
    experts = [_randn(SHAPE, torch.bfloat16, seed=10 + i, scale=1 + i) for i in range(3)]
    copies = Fp8PrimaryWeight(experts, config, experts=True)
    for i, w in enumerate(experts):
        m, v = _state(SHAPE)
        adamw_fp8_step_(w, _randn(SHAPE, torch.bfloat16, seed=i), m, v, step=1, **HYPER)
    assert copies.fresh(experts)
    view = copies.view(experts)
    made = quantize_fp8_experts(torch.stack(experts), config, trans_b=True)
    for (q, s), (rq, rs) in ((view.forward, made.forward), (view.dgrad, made.dgrad)):
        assert torch.equal(_bits(q.contiguous()), _bits(rq.contiguous()))
        assert torch.equal(s, rs)


@pytest.mark.parametrize("name", CONFIGS)
def test_back_to_back_experts_step_as_one_kernel(name, monkeypatch):
    """Experts whose weights, gradients and moments are slices of one allocation each run as one launch,
    with the results of stepping them one by one."""
    from primus_turbo.pytorch.ops import fp8_primary

    config = CONFIGS[name]
    weights = _randn((3, *SHAPE), torch.bfloat16)
    grads = _randn((3, *SHAPE), torch.bfloat16, seed=3)
    joined = list(weights.clone().unbind())  # back to back
    apart = [w.clone() for w in weights.unbind()]  # three allocations
    sides, launch = {}, fp8_primary._launch
    for name_, experts in (("joined", joined), ("apart", apart)):
        copies = Fp8PrimaryWeight(experts, config, experts=True)
        moments = (torch.zeros(3, *SHAPE, device=DEVICE), torch.zeros(3, *SHAPE, device=DEVICE))
        if name_ == "apart":
            moments = tuple([t.clone() for t in m.unbind()] for m in moments)
        launches = []
        monkeypatch.setattr(fp8_primary, "_launch", lambda *a, record=launches, go=launch: (
            record.append(len(a[1])), go(*a)))  # fmt: skip
        for step in (1, 2):
            adamw_fp8_step_(experts, list(grads.unbind()), *(list(m) for m in moments), step=step, **HYPER)
        sides[name_] = copies, launches
    assert sides["joined"][1] == [3, 3] and sides["apart"][1] == [1, 1, 1] * 2
    (a, _), (b, _) = sides["joined"], sides["apart"]
    assert torch.equal(_bits(a.q), _bits(b.q)) and torch.equal(_bits(a.q_t), _bits(b.q_t))
    assert torch.equal(a.scale, b.scale)
    for x, y in zip(joined, apart, strict=True):
        assert torch.equal(x, y)


def test_stale_copies_are_quantized_again():
    """An in-place change by anything but the fused step makes the copies stale; ``view`` redoes them."""
    config = CONFIGS["tensorwise"]
    weight = _randn(SHAPE, torch.bfloat16)
    copies = Fp8PrimaryWeight([weight], config, experts=False)
    assert not copies.fresh([weight])
    copies.view([weight])
    assert copies.fresh([weight])
    with torch.no_grad():
        weight.mul_(3)
    assert not copies.fresh([weight])
    view = copies.view([weight])
    assert view.hp is weight
    _assert_copies_match_weight(copies, weight, config)


def test_weight_with_copies_pickles_without_its_optimizer():
    """A parameter carries its copies through pickling (whole-model saves, checkpoint writers that keep
    parameters); the copy is owned by no optimizer and is stale until quantized. (``copy.deepcopy`` of a
    parameter keeps no attributes: the copy makes its own copies on first use.)"""
    import io

    weight = torch.nn.Parameter(_randn(SHAPE, torch.bfloat16))
    copies = Fp8PrimaryWeight([weight], CONFIGS["tensorwise"], experts=False)
    copies.view([weight])
    copies.owner = torch.optim.SGD([weight], lr=0.1)
    buffer = io.BytesIO()
    torch.save(weight, buffer)
    buffer.seek(0)
    clone = torch.load(buffer, weights_only=False)
    twin = fp8_primary_of(clone)[0]
    assert twin is not copies and twin.owner is None and not twin.fresh([clone])
    assert torch.equal(_bits(twin.view([clone]).data), _bits(copies.q[0]))


def test_non_finite_gradient_gives_nan_scale():
    config = CONFIGS["blockwise"]
    weight = _randn(SHAPE, torch.bfloat16)
    copies = Fp8PrimaryWeight([weight], config, experts=False)
    grad = _randn(SHAPE, torch.bfloat16, seed=1)
    grad[0, 0] = float("nan")
    m, v = _state(SHAPE)
    adamw_fp8_step_(weight, grad, m, v, step=1, **HYPER)
    assert copies.scale[0, 0, 0].isnan() and not copies.scale[0, 1:, :].isnan().any()


def _op_args(name, dtype=torch.bfloat16):
    config = CONFIGS[name]
    weight = _randn(SHAPE, dtype)
    copies = Fp8PrimaryWeight([weight], config, experts=False)
    m, v = _state(SHAPE)
    grad = _randn(SHAPE, dtype, seed=1)
    view = [t.view(1, *SHAPE) for t in (weight, grad, m, v)]
    return (*view, None, copies.q, copies.q_t, copies.scale, copies.scale_t, 1e-2, 0.9, 0.95, 1e-8, 0.1, 1,
            copies.block)  # fmt: skip


@pytest.mark.parametrize("name", CONFIGS)
def test_opcheck(name):
    # opcheck's schema test multiplies every input tensor, which torch does not implement for fp8 dtypes;
    # the mutation schema is covered by the fake and AOT tests
    torch.library.opcheck(
        impl.adamw_fp8_step_impl,
        _op_args(name),
        test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"),
    )


def test_compile_fullgraph():
    """The step compiles as one graph and writes what eager writes."""
    eager, compiled = _op_args("blockwise"), _op_args("blockwise")

    def step(*args):
        torch.ops.primus_turbo.adamw_fp8_step(*args)

    step(*eager)
    torch.compile(step, fullgraph=True, backend="aot_eager")(*compiled)
    for a, b in zip(eager[:9], compiled[:9], strict=True):
        if a is not None:
            assert torch.equal(
                _bits(a) if a.element_size() == 1 else a, _bits(b) if b.element_size() == 1 else b
            )


def test_bad_input():
    config = CONFIGS["blockwise"]
    weight = _randn(SHAPE, torch.bfloat16)
    m, v = _state(SHAPE)
    with pytest.raises(ValueError, match="no FP8 primary copies"):
        adamw_fp8_step_(weight, weight, m, v, step=1, **HYPER)
    Fp8PrimaryWeight([weight], config, experts=False)
    with pytest.raises(ValueError, match="grad must have weight's shape"):
        adamw_fp8_step_(weight, weight[:, :BLOCK], m, v, step=1, **HYPER)
    with pytest.raises(ValueError, match="exp_avg must be contiguous fp32"):
        adamw_fp8_step_(weight, weight, m.bfloat16(), v, step=1, **HYPER)
    with pytest.raises(ValueError, match="step counts from 1"):
        adamw_fp8_step_(weight, weight, m, v, step=0, **HYPER)
    with pytest.raises(ValueError, match="TENSORWISE or BLOCKWISE"):
        Fp8PrimaryWeight([weight], Float8QuantConfig(granularity=G.ROWWISE), experts=False)
    with pytest.raises(ValueError, match="multiples of"):
        Fp8PrimaryWeight([_randn((BLOCK + 1, BLOCK))], config, experts=False)
    with pytest.raises(ValueError, match="one weight"):
        Fp8PrimaryWeight([weight, weight], config, experts=False)
    with pytest.raises(ValueError, match="share one shape"):
        Fp8PrimaryWeight([weight, weight[:BLOCK]], config, experts=True)
