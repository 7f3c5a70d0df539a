"""Property-based tests: random valid problems through every path and every layer schedule against
the spec (on the interpreter in CI), and random invalid inputs that must raise a named error.

Profiles (``conftest.py``): ``ci`` (the default: fixed seed, bounded examples) and ``thorough``
(``pytest tests/test_properties.py --hypothesis-profile=thorough``).
"""
import warnings

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

import moelora_lab as ml
from moelora_lab.op.paths import PATH_CHOICES
from moelora_lab.layer import AUTO, choices, get_schedule
from utils import STRIDED_KINDS, TOL, strided, strided_inputs

# per test, a multiple of the profile's example count (ci: 25, thorough: 300)
BASE = settings.default.max_examples
RANKS = st.one_of(st.integers(1, 20), st.sampled_from([24, 31, 48, 64, 100, 128, 129, 200, 256, 300, 512]))


@st.composite
def routing(draw, max_tokens=8, max_experts=6, max_loras=3):
    """(topk_ids [M, k], topk_weights [M, k], token_lora [M], E, L), -1 tokens included."""
    E = draw(st.integers(1, max_experts))
    k = draw(st.integers(1, min(E, 3)))
    L = draw(st.integers(1, max_loras))
    M = draw(st.integers(1, max_tokens))
    ids = [draw(st.permutations(range(E)))[:k] for _ in range(M)]
    topk_ids = torch.tensor(ids, dtype=draw(st.sampled_from([torch.int32, torch.int64])))
    topk_weights = torch.tensor(draw(st.lists(st.lists(st.floats(0.05, 1.0), min_size=k, max_size=k),
                                              min_size=M, max_size=M)))
    token_lora = torch.tensor(draw(st.lists(st.integers(-1, L - 1), min_size=M, max_size=M)), dtype=torch.int32)
    return topk_ids, topk_weights, token_lora, E, L


def lora_weights(gen, L, E, r, K, N, S, dtype, ranks=None):
    """S slices of A [L, E, r, K] and B [L, E, N, r]; with ``ranks``, NaN past each slot's rank (never read)."""
    a = [torch.randn(L, E, r, K, generator=gen) / K ** 0.5 for _ in range(S)]
    b = [torch.randn(L, E, N, r, generator=gen) / r ** 0.5 for _ in range(S)]
    spec_a, spec_b = [w.clone() for w in a], [w.clone() for w in b]
    if ranks is not None:
        for slot, rs in enumerate(ranks):
            for wa, wb, sa, sb in zip(a, b, spec_a, spec_b):
                wa[slot, :, rs:], wb[slot, :, :, rs:] = float("nan"), float("nan")
                sa[slot, :, rs:], sb[slot, :, :, rs:] = 0.0, 0.0
    cast = lambda ws: [w.to(dtype) for w in ws]
    return cast(a), cast(b), cast(spec_a), cast(spec_b)


def close(out, ref, dtype, what):
    if ref.numel() == 0:
        return
    assert not torch.isnan(out).any(), f"{what}: {int(torch.isnan(out).sum())} elements never written"
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol * max(float(ref.abs().max()), 1e-3), msg=what)


def dtypes(device):
    return [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])


def to(device, value):
    """Tensors, lists of tensors and None moved to ``device`` (the problem is drawn on the CPU)."""
    if isinstance(value, list):
        return [to(device, v) for v in value]
    return value.to(device) if isinstance(value, torch.Tensor) else value


@pytest.mark.slow
@settings(max_examples=3 * BASE)
@given(data=st.data())
def test_every_path_matches_the_spec(device, data):
    topk_ids, topk_weights, token_lora, E, L = data.draw(routing())
    M, k = topk_ids.shape
    r = data.draw(RANKS, label="rank")
    event(f"rank {'<= 16' if r <= 16 else '17..128' if r <= 128 else '> 128'}")
    K, N = data.draw(st.integers(1, 40), label="K"), data.draw(st.integers(1, 40), label="N")
    S = data.draw(st.sampled_from([1, 2]), label="slices")
    dtype = data.draw(st.sampled_from(dtypes(device)), label="dtype")
    pair_rows = data.draw(st.booleans(), label="pair_rows")
    mul = data.draw(st.booleans(), label="mul_routed_weight")
    add = data.draw(st.booleans(), label="add_inputs")
    ranks = data.draw(st.none() | st.lists(st.integers(0, r), min_size=L, max_size=L), label="lora_ranks")
    enabled = data.draw(st.none() | st.lists(st.booleans(), min_size=L, max_size=L), label="enabled")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    x = torch.randn(M * k if pair_rows else M, K, generator=gen).to(dtype)
    a, b, spec_a, spec_b = lora_weights(gen, L, E, r, K, N, S, dtype, ranks)
    if data.draw(st.booleans(), label="packed_b"):
        b = ml.pack_lora_b(b)
    spec_lora = token_lora
    if enabled is not None:
        flags = torch.tensor(enabled)
        spec_lora = torch.where((token_lora >= 0) & flags[token_lora.clamp(min=0).long()], token_lora, -1)
    start = torch.randn(M, k, S * N, generator=gen).to(dtype)
    x, topk_ids, topk_weights, token_lora, spec_lora, start, a, b, spec_a, spec_b = to(device, [
        x, topk_ids, topk_weights, token_lora, spec_lora, start, a, b, spec_a, spec_b])
    ref = ml.moe_lora_reference(x, topk_ids, topk_weights, spec_lora, spec_a, spec_b, mul_routed_weight=mul)
    owned = (spec_lora >= 0).view(M, 1, 1).expand_as(start)
    kw = dict(mul_routed_weight=mul, add_inputs=add, lora_ranks=None if ranks is None else torch.tensor(ranks),
              enabled=None if enabled is None else to(device, torch.tensor(enabled)))
    for path in PATH_CHOICES:
        out = start.clone() if add else torch.full_like(start, float("nan"))
        ml.moe_lora(x, topk_ids, topk_weights, token_lora, a, b, path=path, output=out, **kw)
        want = ref + start.float() if add else ref
        close(out[owned], want[owned], dtype, f"{path}: rows with an adapter")
        if add:
            assert torch.equal(out[~owned], start[~owned]), f"{path}: rows without an adapter changed"
        else:
            assert torch.isnan(out[~owned]).all(), f"{path}: rows without an adapter were written"


LAYER_RUNS = [(s, j) for s in choices() for j in (("fold",) if s == AUTO else get_schedule(s).joins)]


@pytest.mark.parametrize("schedule, join", LAYER_RUNS)
@settings(max_examples=max(3, BASE // 4))
@given(data=st.data())
def test_every_layer_schedule_matches_the_spec(device, schedule, join, data):
    """Every schedule and join on drawn problems, the inputs as drawn views, NaN in a slot no token uses and
    past each slot's rank, against the spec; a plan made beforehand changes nothing."""
    topk_ids, topk_weights, token_lora, E, L = data.draw(routing(max_tokens=6, max_experts=5))
    M, k = topk_ids.shape
    H, I = data.draw(st.integers(1, 40), label="H"), data.draw(st.integers(1, 40), label="I")
    r = data.draw(st.one_of(st.integers(1, 16), st.sampled_from([24, 40, 64, 100])), label="rank")
    dtype = data.draw(st.sampled_from(dtypes(device)), label="dtype")
    ranks = data.draw(st.none() | st.lists(st.integers(0, r), min_size=L, max_size=L), label="lora_ranks")
    if schedule != AUTO and get_schedule(schedule).too_wide(L + 1, r):
        r = 16 // (L + 1)                          # schedules with a limit on L*r take at least this
        ranks = None if ranks is None else [min(v, r) for v in ranks]
    views = data.draw(st.sampled_from([None, *STRIDED_KINDS]), label="views")
    event(f"views {views}")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    x = torch.randn(M, H, generator=gen).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=gen) / I ** 0.5).to(dtype)
    slot_ranks = None if ranks is None else ranks + [0]          # one more slot, used by no token
    a13, b13, sa13, sb13 = lora_weights(gen, L + 1, E, r, H, I, 2, dtype, slot_ranks)
    a2, b2, sa2, sb2 = lora_weights(gen, L + 1, E, r, I, H, 1, dtype, slot_ranks)
    for w in a13 + b13 + a2 + b2:
        w[L] = float("nan")
    x, topk_ids, topk_weights, token_lora, w13, w2, a13, b13, sa13, sb13, a2, b2, sa2, sb2 = to(device, [
        x, topk_ids, topk_weights, token_lora, w13, w2, a13, b13, sa13, sb13, a2, b2, sa2, sb2])
    ref = ml.moe_layer_reference(x, topk_ids, topk_weights, token_lora, w13, w2, sa13, sb13, sa2, sb2)
    inputs = dict(x=x, topk_ids=topk_ids, topk_weights=topk_weights, token_lora=token_lora, w13=w13, w2=w2,
                  w13_lora_a=a13, w13_lora_b=b13, w2_lora_a=a2, w2_lora_b=b2)
    lora_ranks = None if ranks is None else torch.tensor(slot_ranks, device=device)
    if views is not None:
        inputs = strided_inputs(inputs, views)
        lora_ranks = None if lora_ranks is None else strided(lora_ranks, views)
    extra = {}
    if schedule == AUTO or get_schedule(schedule).needs_pack:
        pack = ml.pack_in_k(inputs["w13"], inputs["w2"], inputs["w13_lora_b"], inputs["w2_lora_b"])
        extra = dict(in_k=pack, w13=pack.w13, w2=pack.w2)
    call = inputs | extra | dict(schedule=schedule, join=join, lora_ranks=lora_ranks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)          # dual_stream on the CPU runs sequentially
        y = ml.moe_lora_layer(**call)
        close(y, ref, dtype, f"{schedule}/{join}, views {views}")
        plan = ml.plan_layer(inputs["topk_ids"], inputs["token_lora"], E, L + 1, r, schedule=schedule)
        assert torch.equal(ml.moe_lora_layer(**call, plan=plan), y)


# ---- invalid inputs ------------------------------------------------------------------------------

def _op_case(seed):
    p = ml.make_problem(ml.MoEShape(24, 20, 4, 2, "bad"), ml.LoRAShape(3, 8), 5, seed=seed, with_base=False)
    kw = dict(x=p.x, topk_ids=p.topk_ids, topk_weights=p.topk_weights, token_lora=p.token_lora,
              lora_a=list(p.w13_lora_a), lora_b=list(p.w13_lora_b))
    return p, kw


def _output_sharing_x(kw):
    buf = torch.zeros(5 * 2 * 40)
    return kw | dict(output=buf.view(5, 2, 40), x=buf[: 5 * 24].view(5, 24))     # an in-place update


def _blocks_of_other_routing(p):
    other = p.topk_ids.flip(0).clone()
    return ml.block_list(other, p.token_lora, 4, 3, 16)


OP_CORRUPTIONS = {
    "topk_ids out of range": (lambda p, kw: kw | dict(topk_ids=p.topk_ids.clone().fill_(4)), "topk_ids"),
    "topk_ids negative": (lambda p, kw: kw | dict(topk_ids=p.topk_ids.flatten().index_fill(0, torch.tensor([3]), -1)
                                                   .view_as(p.topk_ids)), "topk_ids"),
    "topk_ids float": (lambda p, kw: kw | dict(topk_ids=p.topk_ids.float()), "topk_ids"),
    "topk_ids 1-D": (lambda p, kw: kw | dict(topk_ids=p.topk_ids[:, 0]), "topk_ids"),
    "token_lora out of range": (lambda p, kw: kw | dict(token_lora=p.token_lora.clone().fill_(3)), "token_lora"),
    "token_lora below -1": (lambda p, kw: kw | dict(token_lora=p.token_lora.clone().fill_(-2)), "token_lora"),
    "token_lora short": (lambda p, kw: kw | dict(token_lora=p.token_lora[:2]), "token_lora"),
    "topk_weights shape": (lambda p, kw: kw | dict(topk_weights=p.topk_weights.T), "topk_weights"),
    "topk_weights int": (lambda p, kw: kw | dict(topk_weights=p.topk_ids), "topk_weights"),
    "x rows": (lambda p, kw: kw | dict(x=p.x[:3]), "x"),
    "x int": (lambda p, kw: kw | dict(x=p.x.long()), "x"),
    "x features": (lambda p, kw: kw | dict(x=p.x[:, :7]), "lora_a[0]"),
    "lora dtype": (lambda p, kw: kw | dict(lora_a=[w.half() for w in kw["lora_a"]],
                                           lora_b=[w.half() for w in kw["lora_b"]]), "lora_a[0]"),
    "A and B dtypes": (lambda p, kw: kw | dict(lora_b=[w.double() for w in kw["lora_b"]]), "lora_b[0]"),
    "lora_a tensor": (lambda p, kw: kw | dict(lora_a=kw["lora_a"][0]), "lora_a"),
    "slice counts": (lambda p, kw: kw | dict(lora_b=kw["lora_b"][:1]), "lora_a and lora_b"),
    "lora_b rank": (lambda p, kw: kw | dict(lora_b=[w[..., :4] for w in kw["lora_b"]]), "lora_a[0], lora_b[0]"),
    "lora_a rank": (lambda p, kw: kw | dict(lora_a=[w[:, :, :4] for w in kw["lora_a"]]), "lora_a[0], lora_b[0]"),
    "lora_b experts": (lambda p, kw: kw | dict(lora_b=[w[:, :2] for w in kw["lora_b"]]), "lora_a[0], lora_b[0]"),
    "lora_a slots": (lambda p, kw: kw | dict(lora_a=[w[:2] for w in kw["lora_a"]]), "lora_a[0], lora_b[0]"),
    "topk_weights list": (lambda p, kw: kw | dict(topk_weights=p.topk_weights.tolist()), "topk_weights"),
    "topk_weights numpy": (lambda p, kw: kw | dict(topk_weights=p.topk_weights.numpy()), "topk_weights"),
    "mul_routed_weight string": (lambda p, kw: kw | dict(mul_routed_weight="False"), "mul_routed_weight"),
    "add_inputs string": (lambda p, kw: kw | dict(add_inputs="no"), "add_inputs"),
    "validate int": (lambda p, kw: kw | dict(validate=0), "validate"),
    "output expanded": (lambda p, kw: kw | dict(output=torch.zeros(1, 1, 40).expand(5, 2, 40)), "output"),
    "output rows overlap": (lambda p, kw: kw | dict(output=torch.zeros(5 * 2 * 40).as_strided((5, 2, 40), (40, 20, 1))),
                            "output"),
    "output shape": (lambda p, kw: kw | dict(output=torch.zeros(5, 2, 39)), "output"),
    "output dtype": (lambda p, kw: kw | dict(output=torch.zeros(5, 2, 40, dtype=torch.float64)), "output"),
    "output shares x": (lambda p, kw: _output_sharing_x(kw), "output"),
    "enabled shape": (lambda p, kw: kw | dict(enabled=torch.ones(2, dtype=torch.bool)), "enabled"),
    "enabled dtype": (lambda p, kw: kw | dict(enabled=torch.ones(3)), "enabled"),
    "lora_ranks too big": (lambda p, kw: kw | dict(lora_ranks=torch.tensor([1, 9, 2])), "lora_ranks"),
    "lora_ranks negative": (lambda p, kw: kw | dict(lora_ranks=torch.tensor([1, -1, 2])), "lora_ranks"),
    "path": (lambda p, kw: kw | dict(path="naive"), "path"),
    "config": (lambda p, kw: kw | dict(config={"block_m": 16}), "config"),
    "blocks type": (lambda p, kw: kw | dict(blocks=(1, 2, 3)), "blocks"),
    "blocks of other routing": (lambda p, kw: kw | dict(blocks=_blocks_of_other_routing(p)), "blocks"),
    "mul without weights": (lambda p, kw: kw | dict(topk_weights=None, mul_routed_weight=True), "topk_weights"),
}


@settings(max_examples=4 * BASE)
@given(corruption=st.sampled_from(sorted(OP_CORRUPTIONS)), seed=st.integers(0, 100))
def test_invalid_op_inputs_raise_a_named_error(corruption, seed):
    p, kw = _op_case(seed)
    make, name = OP_CORRUPTIONS[corruption]
    bad = make(p, kw)
    with pytest.raises((ValueError, TypeError)) as err:
        ml.moe_lora(**bad)
    assert str(err.value).startswith(name + ":") or str(err.value).startswith(name + " "), str(err.value)


def _layer_case(seed):
    p = ml.make_problem(ml.MoEShape(24, 20, 4, 2, "bad"), ml.LoRAShape(3, 8), 5, seed=seed)
    return p, p.layer_inputs()


LAYER_CORRUPTIONS = {
    "w13 odd": (lambda p, kw: kw | dict(w13=p.w13[:, :39]), "w13"),
    "w13 dtype": (lambda p, kw: kw | dict(w13=p.w13.half()), "w13"),
    "w2 shape": (lambda p, kw: kw | dict(w2=p.w2[:, :, :7]), "w2"),
    "x features": (lambda p, kw: kw | dict(x=p.x[:, :7]), "x"),
    "topk_ids rows": (lambda p, kw: kw | dict(topk_ids=p.topk_ids[:3]), "topk_ids"),
    "topk_ids range": (lambda p, kw: kw | dict(topk_ids=p.topk_ids + 4), "topk_ids"),
    "token_lora range": (lambda p, kw: kw | dict(token_lora=p.token_lora.clone().fill_(3)), "token_lora"),
    "topk_weights none": (lambda p, kw: kw | dict(topk_weights=None), "topk_weights"),
    "three of four": (lambda p, kw: kw | dict(w2_lora_b=None), "w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b"),
    "w2 LoRA slots": (lambda p, kw: kw | dict(w2_lora_a=[w[:2] for w in p.w2_lora_a],
                                              w2_lora_b=[w[:2] for w in p.w2_lora_b]), "w2_lora_a[0]"),
    "w2 LoRA dtype": (lambda p, kw: kw | dict(w2_lora_a=[w.half() for w in p.w2_lora_a],
                                              w2_lora_b=[w.half() for w in p.w2_lora_b]), "w2_lora_a[0]"),
    "w13 LoRA one slice": (lambda p, kw: kw | dict(w13_lora_a=p.w13_lora_a[:1], w13_lora_b=p.w13_lora_b[:1]),
                           "w13_lora_a, w13_lora_b"),
    "w2 LoRA rank": (lambda p, kw: kw | dict(w2_lora_a=[w[:, :, :4] for w in p.w2_lora_a],
                                             w2_lora_b=[w[..., :4] for w in p.w2_lora_b]), "w2_lora_a[0]"),
    "schedule": (lambda p, kw: kw | dict(schedule="fast"), "schedule"),
    "join": (lambda p, kw: kw | dict(join="add"), "join"),
    "side_priority": (lambda p, kw: kw | dict(side_priority="urgent"), "side_priority"),
    "lora_path": (lambda p, kw: kw | dict(lora_path="naive"), "lora_path"),
    "lora_ranks": (lambda p, kw: kw | dict(lora_ranks=torch.tensor([9, 1, 1])), "lora_ranks"),
    "plan type": (lambda p, kw: kw | dict(plan="plan"), "plan"),
    "plan rank": (lambda p, kw: kw | dict(plan=ml.plan_layer(p.topk_ids, p.token_lora, 4, 3, 4)), "plan"),
    "plan routing": (lambda p, kw: kw | dict(plan=ml.plan_layer(p.topk_ids.flip(0).clone(), p.token_lora, 4, 3, 8)),
                     "plan"),
    "plan without LoRA": (lambda p, kw: kw | dict(plan=ml.plan_layer(p.topk_ids, p.token_lora, 4, None, None)),
                          "plan"),
    "lora_ranks without LoRA": (lambda p, kw: {k: v for k, v in kw.items() if "lora_" not in k or k == "token_lora"}
                                | dict(lora_ranks=torch.tensor([1, 2, 3])), "lora_ranks"),
    "topk_weights list": (lambda p, kw: kw | dict(topk_weights=p.topk_weights.tolist()), "topk_weights"),
    "topk_weights numpy": (lambda p, kw: kw | dict(topk_weights=p.topk_weights.numpy()), "topk_weights"),
    "validate string": (lambda p, kw: kw | dict(validate="False"), "validate"),
    "w13 LoRA A rank": (lambda p, kw: kw | dict(w13_lora_a=[w[:, :, :4] for w in p.w13_lora_a]),
                        "w13_lora_a[0], w13_lora_b[0]"),
}


@settings(max_examples=4 * BASE)
@given(corruption=st.sampled_from(sorted(LAYER_CORRUPTIONS)), seed=st.integers(0, 100))
def test_invalid_layer_inputs_raise_a_named_error(corruption, seed):
    p, kw = _layer_case(seed)
    make, name = LAYER_CORRUPTIONS[corruption]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises((ValueError, TypeError)) as err:
            ml.moe_lora_layer(**make(p, kw))
    assert str(err.value).startswith(name + ":"), str(err.value)
