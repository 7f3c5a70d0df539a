"""The backward's spec (``train.reference``) against torch autograd of the forward spec, in float64."""
from __future__ import annotations

import pytest
import torch

import moelora_lab as ml
from moelora_lab.train import moe_lora_backward_reference


def _inputs(pair_rows: bool, seed: int = 1):
    p = ml.make_problem("tiny", ml.LoRAShape(num_loras=3, rank=5), num_tokens=9, seed=seed)
    inp = p.w13_lora_inputs()
    x = torch.randn(9 * 2, 64, dtype=torch.float64) if pair_rows else inp["x"].double()
    token_lora = inp["token_lora"].clone()
    token_lora[0] = -1                                           # a token without an adapter
    return dict(x=x, topk_ids=inp["topk_ids"], topk_weights=inp["topk_weights"].double(), token_lora=token_lora,
                lora_a=[a.double() for a in inp["lora_a"]], lora_b=[b.double() for b in inp["lora_b"]])


@pytest.mark.parametrize("mul, pair_rows", [(False, False), (True, True), (True, False)])
def test_backward_spec_is_autograd_of_the_forward_spec(mul, pair_rows):
    inp = _inputs(pair_rows)
    ranks = torch.tensor([5, 3, 0])                              # slot 1 cut to rank 3, slot 2 off
    leaves = [inp["x"], inp["topk_weights"], *inp["lora_a"], *inp["lora_b"]]
    for t in leaves:
        t.requires_grad_()
    keep = (torch.arange(5) < ranks[:, None, None])[..., None].double()       # [L, 1, r, 1]
    out = ml.moe_lora_reference(inp["x"], inp["topk_ids"], inp["topk_weights"], inp["token_lora"],
                                [a * keep for a in inp["lora_a"]], inp["lora_b"], mul_routed_weight=mul)
    grad_out = torch.randn_like(out)
    want = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    nan_a = [a.detach().clone() for a in inp["lora_a"]]
    for a in nan_a:
        a[1, :, 3:] = float("nan")                               # past slot 1's rank: never read
        a[2] = float("nan")                                      # slot 2 has rank 0
    got = moe_lora_backward_reference(inp["x"].detach(), inp["topk_ids"], inp["topk_weights"].detach(),
                                      inp["token_lora"], nan_a, [b.detach() for b in inp["lora_b"]], grad_out,
                                      mul_routed_weight=mul, lora_ranks=ranks)
    assert got.x.dtype == torch.float64
    torch.testing.assert_close(got.x, want[0], rtol=1e-12, atol=1e-12)
    if mul:
        torch.testing.assert_close(got.topk_weights, want[1], rtol=1e-12, atol=1e-12)
    else:
        assert got.topk_weights is None and want[1] is None
    for g, w in zip(got.lora_a + got.lora_b, want[2:]):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    assert got.lora_a[0][2].abs().sum() == 0 and got.lora_b[0][1, :, :, 3:].abs().sum() == 0
    if not pair_rows:
        assert got.x[0].abs().sum() == 0


def test_backward_spec_turns_disabled_slots_off():
    inp = _inputs(False)
    grad_out = torch.randn(9, 2, 64, dtype=torch.float64)
    on = moe_lora_backward_reference(**inp, grad_out=grad_out)
    off = moe_lora_backward_reference(**inp, grad_out=grad_out, enabled=torch.tensor([True, False, True]))
    assert on.lora_a[0][1].abs().sum() > 0 and off.lora_a[0][1].abs().sum() == 0
    torch.testing.assert_close(off.lora_a[0][0], on.lora_a[0][0])


def test_the_spec_refuses_float64_nowhere_but_the_kernels_do():
    inp = _inputs(False)
    assert ml.moe_lora_reference(**inp).dtype == torch.float64
    with pytest.raises(TypeError, match="float64 is not supported"):
        ml.moe_lora(**inp, path="two_kernel")
