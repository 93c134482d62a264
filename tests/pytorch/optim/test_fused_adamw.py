"""FusedAdamW: FP8-primary weights stepped by the fused kernel, everything else by torch.optim.AdamW;
state dicts that load into torch.optim.AdamW and back; the forward reading the FP8 copies gives what
quantizing the weight in the call gives."""

from __future__ import annotations

import copy

import pytest
import torch

from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, ScalingGranularity
from primus_turbo.pytorch.ops import Fp8PrimaryWeight, gemm_fp8, quantize_fp8_weight
from primus_turbo.pytorch.optim import FusedAdamW
from tests.pytorch.test_utils import DEVICES

DEVICE = DEVICES[0]
BLOCK = 128 if DEVICE == "cuda" else 32
CONFIG = Float8QuantConfig(granularity=ScalingGranularity.BLOCKWISE, block_size=BLOCK)
SHAPE = (2 * BLOCK, BLOCK)
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _params(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.nn.Parameter(torch.randn(SHAPE, generator=gen).to(dtype).to(DEVICE))
    bias = torch.nn.Parameter(torch.randn(SHAPE[0], generator=gen).to(dtype).to(DEVICE))
    return weight, bias


def _grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype).to(DEVICE)


@pytest.mark.parametrize("torch_fused", [False, True], ids=["foreach", "torch-fused"])
def test_matches_torch_adamw(torch_fused):
    """The FP8-primary weight lands where torch.optim.AdamW puts it, the other parameter bit for bit (with
    ``fused=True`` through torch's fused kernel), and the FP8 copies are the quantized weight after every
    step."""
    fused, plain = _params(), _params()
    copies = Fp8PrimaryWeight([fused[0]], CONFIG, experts=False)
    opt = FusedAdamW(fused, fused=torch_fused, **HYPER)
    ref = torch.optim.AdamW(plain, fused=torch_fused, **HYPER)
    for step in range(3):
        _grads(fused, step)
        _grads(plain, step)
        opt.step()
        ref.step()
        assert copies.fresh([fused[0]]) and copies.owner is opt
        made = quantize_fp8_weight(fused[0].detach(), CONFIG)
        assert torch.equal(copies.q[0].view(torch.uint8), made.data.view(torch.uint8))
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(fused[1], plain[1])
    assert fused[0].grad is not None  # the hidden gradient is back after the step


def test_master_weights_and_state_dict_round_trip():
    """bf16 weights with fp32 masters; the state dict loads into torch.optim.AdamW, and back into a fresh
    FusedAdamW it continues the run exactly."""
    params = _params(torch.bfloat16)
    Fp8PrimaryWeight([params[0]], CONFIG, experts=False)
    opt = FusedAdamW(params, master_weights=True, **HYPER)
    for step in range(2):
        _grads(params, step)
        opt.step()
    state = opt.state[params[0]]
    assert state["exp_avg"].dtype == torch.float32 and "master_param" in state
    assert torch.equal(params[0].detach(), state["master_param"].to(torch.bfloat16))
    saved = opt.state_dict()  # live tensors: each load gets a copy, as from a checkpoint file
    weights = [p.detach().clone() for p in params]

    plain = [torch.nn.Parameter(w.clone()) for w in weights]
    torch_opt = torch.optim.AdamW(plain, **HYPER)
    torch_opt.load_state_dict(copy.deepcopy(saved))
    _grads(plain, 2)
    torch_opt.step()  # a bf16 run continues from the checkpoint

    resumed = [torch.nn.Parameter(w.clone()) for w in weights]
    Fp8PrimaryWeight([resumed[0]], CONFIG, experts=False)
    again = FusedAdamW(resumed, master_weights=True, **HYPER)
    again.load_state_dict(copy.deepcopy(saved))
    for opt_, ps in ((opt, params), (again, resumed)):
        _grads(ps, 2)
        opt_.step()
    for a, b in zip(params, resumed, strict=True):
        assert torch.equal(a, b)


def test_forward_reads_copies():
    """``gemm_fp8`` given the copies computes what it computes quantizing the weight, gradients included."""
    weight, _ = _params(torch.bfloat16)
    copies = Fp8PrimaryWeight([weight], CONFIG, experts=False)
    x = torch.randn(64, SHAPE[1], device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    out = gemm_fp8(x, copies.view([weight]), trans_b=True, config=CONFIG)
    out.sum().backward()
    grads = (x.grad.clone(), weight.grad.clone())
    x.grad = weight.grad = None
    ref = gemm_fp8(x, weight, trans_b=True, config=CONFIG)
    ref.sum().backward()
    assert torch.equal(out, ref)
    assert torch.equal(grads[0], x.grad) and torch.equal(grads[1], weight.grad)


def test_unsupported_options():
    params = _params()
    Fp8PrimaryWeight([params[0]], CONFIG, experts=False)
    params[0].grad = torch.zeros_like(params[0])
    with pytest.raises(ValueError, match="do not support amsgrad"):
        FusedAdamW(params, amsgrad=True).step()
    opt = FusedAdamW(params)
    params[0].grad = torch.zeros_like(params[0]).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


def test_experts_share_one_state_allocation():
    """A layer's experts get their moments as slices of one allocation (so one kernel steps them), also
    after a state-dict load, and land where torch.optim.AdamW puts them."""
    config = Float8QuantConfig()
    stacked = torch.randn(3, *SHAPE, device=DEVICE)
    experts = [torch.nn.Parameter(w) for w in stacked.clone().unbind()]
    plain = [torch.nn.Parameter(w) for w in stacked.clone().unbind()]
    copies = Fp8PrimaryWeight(experts, config, experts=True)
    opt, ref = FusedAdamW(experts, **HYPER), torch.optim.AdamW(plain, **HYPER)
    for step in range(2):
        grads = torch.randn(3, *SHAPE, generator=torch.Generator().manual_seed(step)).to(DEVICE)
        for p, q, g in zip(experts, plain, grads.unbind(), strict=True):
            p.grad, q.grad = g, g.clone()
        opt.step()
        ref.step()
    pointers = {opt.state[p]["exp_avg"].untyped_storage().data_ptr() for p in experts}
    assert len(pointers) == 1 and copies.fresh(experts)
    for p, q in zip(experts, plain, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    saved = opt.state_dict()
    # as from torch.optim.AdamW: each state tensor its own allocation
    saved["state"] = {i: {k: v.clone() for k, v in s.items()} for i, s in saved["state"].items()}
    resumed = FusedAdamW(experts, **HYPER)
    resumed.load_state_dict(saved)
    assert len({resumed.state[p]["exp_avg"].untyped_storage().data_ptr() for p in experts}) == 3
    resumed.step()
    for key in ("exp_avg", "exp_avg_sq"):
        assert len({resumed.state[p][key].untyped_storage().data_ptr() for p in experts}) == 1
