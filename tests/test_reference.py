import pytest
import torch

import moelora_lab as ml
from moelora_lab import LoRAShape, MoEShape, make_problem
from moelora_lab.reference import (moe_layer_reference, moe_layer_reference_loop, moe_lora_backward_reference,
                                   moe_lora_reference, moe_lora_reference_loop)

SMALL = MoEShape(24, 16, 6, 3, "small")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mul", [False, True])
def test_loop_equals_vectorized_token_rows(dtype, mul):
    p = make_problem(SMALL, LoRAShape(3, 5), 9, dtype=dtype, seed=int(mul), no_adapter_fraction=0.3)
    a = moe_lora_reference(**p.w13_lora_inputs(), mul_routed_weight=mul)
    b = moe_lora_reference_loop(**p.w13_lora_inputs(), mul_routed_weight=mul)
    assert a.dtype == torch.float32 and a.shape == (9, 3, 2 * 16)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_pair_rows_and_zero_rows_without_adapter():
    p = make_problem(SMALL, LoRAShape(2, 4), 7, seed=5, no_adapter_fraction=0.5)
    h = torch.randn(7 * 3, 16)
    args = (h, p.topk_ids, p.topk_weights, p.token_lora, p.w2_lora_a, p.w2_lora_b)
    a = moe_lora_reference(*args, mul_routed_weight=True)
    torch.testing.assert_close(a, moe_lora_reference_loop(*args, mul_routed_weight=True))
    none = p.token_lora < 0
    assert none.any() and torch.all(a[none] == 0) and torch.all(a[~none].abs().sum(-1) > 0)


def test_reference_matches_a_hand_computed_pair():
    # one token, one slot, rank 1: delta = b * (a . x) * w
    x = torch.tensor([[1.0, 2.0]])
    a = torch.tensor([[[[3.0, 4.0]]]])          # [L=1, E=1, r=1, K=2]: a.x = 11
    b = torch.tensor([[[[2.0], [-1.0]]]])       # [L=1, E=1, N=2, r=1]
    ids, w, lora = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([[0.5]]), torch.zeros(1, dtype=torch.int32)
    out = moe_lora_reference(x, ids, w, lora, [a], [b], mul_routed_weight=True)
    assert out.tolist() == [[[11.0, -5.5]]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_layer_loop_equals_vectorized(dtype):
    p = make_problem(SMALL, LoRAShape(2, 4), 6, dtype=dtype, seed=2, no_adapter_fraction=0.3)
    a = moe_layer_reference(**p.layer_inputs())
    torch.testing.assert_close(a, moe_layer_reference_loop(**p.layer_inputs()), rtol=1e-5, atol=1e-5)
    assert a.shape == (6, SMALL.hidden)


def test_layer_lora_changes_only_tokens_with_adapter():
    p = make_problem(SMALL, LoRAShape(2, 4), 8, seed=4, no_adapter_fraction=0.5)
    with_lora = moe_layer_reference(**p.layer_inputs())
    zero = dict(p.layer_inputs())
    for name in ("w13_lora_b", "w2_lora_b"):
        zero[name] = tuple(torch.zeros_like(t) for t in zero[name])
    base = moe_layer_reference(**zero)
    changed = (with_lora - base).abs().sum(-1) > 1e-6
    assert torch.equal(changed, p.token_lora >= 0)


def _inputs():
    p = make_problem(SMALL, LoRAShape(2, 4), 4)
    return p, list(p.w13_lora_inputs().values())


@pytest.mark.parametrize("mutate, exc, match", [
    (lambda a: a.__setitem__(0, a[0][:3]), ValueError, "x: has 3 rows; expected M=4 \\(token rows\\) or M\\*k=12"),
    (lambda a: a.__setitem__(0, a[0].int()), TypeError, "x: dtype torch.int32 is not supported"),
    (lambda a: a.__setitem__(4, a[4][0]), TypeError, "lora_a: expected a non-empty list or tuple"),
    (lambda a: a.__setitem__(5, a[5][:1]), ValueError, "lora_a and lora_b: got 2 and 1 slices"),
    (lambda a: a.__setitem__(5, (a[5][0], a[5][1][:, :, :5])), ValueError, "lora_b\\[1\\]: expected shape"),
    (lambda a: a.__setitem__(5, (a[5][0], a[5][1].half())), TypeError, "lora_b\\[1\\]: dtype torch.float16"),
    (lambda a: a.__setitem__(0, a[0][:, :10]), ValueError, "lora_a\\[0\\]: expects K=24 input features"),
    (lambda a: a.__setitem__(1, a[1] + 6), ValueError, "topk_ids: value .* accepted values are 0 .. 5"),
    (lambda a: a.__setitem__(2, a[2][:, :1]), ValueError, "topk_weights: expected shape \\(4, 3\\)"),
    (lambda a: a.__setitem__(3, a[3] - 5), ValueError, "token_lora: value .* accepted values are -1 .. 1"),
])
def test_validation_messages(mutate, exc, match):
    _, args = _inputs()
    mutate(args)
    with pytest.raises(exc, match=match):
        moe_lora_reference(*args)


def test_layer_validation_messages():
    p, _ = _inputs()
    bad = dict(p.layer_inputs(), w2=p.w2[:, :, :5])
    with pytest.raises(ValueError, match="w2: expected shape \\(6, 24, 16\\)"):
        moe_layer_reference(**bad)
    bad = dict(p.layer_inputs(), w13=p.w13[:, :31])
    with pytest.raises(ValueError, match="w13: dim 1 must be 2\\*I"):
        moe_layer_reference(**bad)


# --- the backward's spec: torch autograd of the forward spec, in float64

def _grad_inputs(pair_rows: bool, seed: int = 1, device="cpu"):
    p = ml.make_problem("tiny", ml.LoRAShape(num_loras=3, rank=5), num_tokens=9, seed=seed, device=device)
    inp = p.w13_lora_inputs()
    x = torch.randn(9 * 2, 64, dtype=torch.float64).to(device) if pair_rows else inp["x"].double()
    token_lora = inp["token_lora"].clone()
    token_lora[0] = -1                                           # a token without an adapter
    return dict(x=x, topk_ids=inp["topk_ids"], topk_weights=inp["topk_weights"].double(), token_lora=token_lora,
                lora_a=[a.double() for a in inp["lora_a"]], lora_b=[b.double() for b in inp["lora_b"]])


@pytest.mark.parametrize("mul, pair_rows", [(False, False), (True, True), (True, False)])
def test_backward_spec_is_autograd_of_the_forward_spec(mul, pair_rows):
    inp = _grad_inputs(pair_rows)
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
    inp = _grad_inputs(False)
    grad_out = torch.randn(9, 2, 64, dtype=torch.float64)
    on = moe_lora_backward_reference(**inp, grad_out=grad_out)
    off = moe_lora_backward_reference(**inp, grad_out=grad_out, enabled=torch.tensor([True, False, True]))
    assert on.lora_a[0][1].abs().sum() > 0 and off.lora_a[0][1].abs().sum() == 0
    torch.testing.assert_close(off.lora_a[0][0], on.lora_a[0][0])


def test_the_spec_refuses_float64_nowhere_but_the_kernels_do(device):
    inp = _grad_inputs(False, device=device)
    assert ml.moe_lora_reference(**inp).dtype == torch.float64
    with pytest.raises(TypeError, match="float64 is not supported"):
        ml.moe_lora(**inp, path="two_kernel")
