import pytest
import torch

from moelora_lab import PRESETS, LoRAShape, MoEShape, make_problem
from moelora_lab.config import benchmark_routing, draw_adapters, make_routing


def test_presets_have_the_published_shapes():
    want = {
        "qwen3-30b-a3b": (2048, 768, 128, 8),
        "deepseek-v2-lite": (2048, 1408, 64, 6),
        "mixtral-8x7b": (4096, 14336, 8, 2),
        "olmoe-1b-7b": (2048, 1024, 64, 8),
        "gpt-oss-20b": (2880, 2880, 32, 4),
    }
    for name, dims in want.items():
        s = MoEShape.from_name(name)
        assert (s.hidden, s.intermediate, s.num_experts, s.top_k) == dims
        assert s.name == name
    assert "tiny" in PRESETS and PRESETS["tiny"].hidden <= 128


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="preset 'qwen9'.*qwen3-30b-a3b"):
        MoEShape.from_name("qwen9")


@pytest.mark.parametrize("kwargs, match", [
    (dict(hidden=0, intermediate=8, num_experts=4, top_k=2), "MoEShape.hidden: must be >= 1"),
    (dict(hidden=8, intermediate=8, num_experts=4, top_k=5), "top_k: 5 exceeds num_experts=4"),
    (dict(hidden=8.0, intermediate=8, num_experts=4, top_k=2), "MoEShape.hidden: expected an int"),
])
def test_moeshape_validation(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        MoEShape(**kwargs)


def test_lorashape_validation():
    with pytest.raises(ValueError, match="LoRAShape.rank: must be >= 1, got 0"):
        LoRAShape(2, 0)


def _tensors(p):
    return [p.x, p.router_logits, p.topk_weights, p.topk_ids, p.token_lora, p.w13, p.w2,
            *p.w13_lora_a, *p.w13_lora_b, *p.w2_lora_a, *p.w2_lora_b]


def test_same_seed_same_tensors_and_other_seed_differs():
    kw = dict(no_adapter_fraction=0.3, expert_skew=1.0, adapter_popularity="zipf:1.2")
    a = make_problem("tiny", LoRAShape(3, 8), 20, seed=7, **kw)
    b = make_problem("tiny", LoRAShape(3, 8), 20, seed=7, **kw)
    c = make_problem("tiny", LoRAShape(3, 8), 20, seed=8, **kw)
    assert all(torch.equal(u, v) for u, v in zip(_tensors(a), _tensors(b)))
    assert not torch.equal(a.x, c.x)


def test_layouts_and_dtypes():
    s = PRESETS["tiny"]
    L, r, M = 3, 16, 10
    p = make_problem(s, LoRAShape(L, r), M, dtype=torch.float16)
    H, I, E, k = s.hidden, s.intermediate, s.num_experts, s.top_k
    assert p.x.shape == (M, H) and p.x.dtype == torch.float16
    assert p.topk_ids.shape == (M, k) and p.topk_ids.dtype == torch.int32
    assert p.topk_weights.dtype == torch.float32 and p.token_lora.dtype == torch.int32
    assert p.w13.shape == (E, 2 * I, H) and p.w2.shape == (E, H, I)
    assert len(p.w13_lora_a) == 2 and len(p.w2_lora_a) == 1
    assert p.w13_lora_a[1].shape == (L, E, r, H) and p.w13_lora_b[0].shape == (L, E, I, r)
    assert p.w2_lora_a[0].shape == (L, E, r, I) and p.w2_lora_b[0].shape == (L, E, H, r)
    assert torch.allclose(p.topk_weights.sum(1), torch.ones(M))


def test_adapter_ranks_zero_pad_past_the_rank():
    p = make_problem("tiny", LoRAShape(2, 16), 4, adapter_ranks=(4, 16))
    a, b = p.w13_lora_a[0], p.w13_lora_b[0]
    assert torch.all(a[0, :, 4:] == 0) and torch.all(b[0, :, :, 4:] == 0)
    assert torch.any(a[0, :, :4] != 0) and torch.any(a[1, :, 15] != 0)
    with pytest.raises(ValueError, match="adapter_ranks: expected 2 ints in \\[0, 16\\]"):
        make_problem("tiny", LoRAShape(2, 16), 4, adapter_ranks=(4, 17))


def test_popularity_families():
    g = torch.Generator().manual_seed(0)
    assert torch.all(draw_adapters(9, 4, "identical", g) == 0)
    assert draw_adapters(6, 4, "distinct", g).tolist() == [0, 1, 2, 3, 0, 1]
    z = draw_adapters(4000, 8, "zipf:2", g)
    counts = torch.bincount(z, minlength=8)
    assert counts[0] > counts[1] > counts[3]  # 1 : 1/4 : 1/16 in expectation
    u = torch.bincount(draw_adapters(4000, 4, "uniform", g), minlength=4)
    assert u.min() > 800
    with pytest.raises(ValueError, match="adapter_popularity: 'zipf:x' needs a positive exponent"):
        draw_adapters(3, 4, "zipf:x", g)
    with pytest.raises(ValueError, match="adapter_popularity: 'popular' is not one of"):
        make_problem("tiny", LoRAShape(2, 4), 4, adapter_popularity="popular")


def test_sequences_share_an_adapter_and_no_adapter_fraction():
    p = make_problem("tiny", LoRAShape(4, 4), 32, num_sequences=4, seed=3)
    per_seq = p.token_lora.view(4, 8)
    assert torch.all(per_seq == per_seq[:, :1])
    none = make_problem("tiny", LoRAShape(4, 4), 32, no_adapter_fraction=1.0)
    assert torch.all(none.token_lora == -1)
    some = make_problem("tiny", LoRAShape(4, 4), 400, no_adapter_fraction=0.5, seed=1)
    assert 120 < int((some.token_lora == -1).sum()) < 280


def test_expert_skew_concentrates_routing():
    flat = make_problem("tiny", LoRAShape(1, 4), 512, seed=0, with_base=False)
    skew = make_problem("tiny", LoRAShape(1, 4), 512, seed=0, expert_skew=3.0, with_base=False)
    top = lambda p: torch.bincount(p.topk_ids.flatten().long(), minlength=8).max().item()
    assert top(skew) > 1.5 * top(flat)
    assert skew.w13 is None
    with pytest.raises(ValueError, match="with_base=False"):
        skew.layer_inputs()


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(num_tokens=0), ValueError, "num_tokens: must be >= 1"),
    (dict(dtype=torch.int32), TypeError, "dtype: torch.int32 is not supported"),
    (dict(no_adapter_fraction=1.5), ValueError, "no_adapter_fraction: must be in \\[0, 1\\]"),
    (dict(expert_skew=-1.0), ValueError, "expert_skew: must be >= 0"),
])
def test_make_problem_validation(kwargs, exc, match):
    args = dict(num_tokens=4) | kwargs
    with pytest.raises(exc, match=match):
        make_problem("tiny", LoRAShape(2, 4), **args)


def test_make_problem_type_errors():
    with pytest.raises(TypeError, match="lora: expected a LoRAShape"):
        make_problem("tiny", (2, 4), 4)
    with pytest.raises(TypeError, match="shape: expected a MoEShape"):
        make_problem(42, LoRAShape(2, 4), 4)


def test_layer_lora_weights_shapes_packing_and_device():
    from moelora_lab.config import layer_lora_weights, random_lora_weights
    from moelora_lab.op.face import pack_lora_b
    shape = MoEShape.from_name("tiny")
    H, I, E = shape.hidden, shape.intermediate, shape.num_experts
    w = layer_lora_weights(shape, 3, 4, torch.Generator().manual_seed(0), torch.float32)
    assert [a.shape for a in w["w13_lora_a"]] == [(3, E, 4, H)] * 2 and [b.shape for b in w["w13_lora_b"]] == [(3, E, I, 4)] * 2
    assert [a.shape for a in w["w2_lora_a"]] == [(3, E, 4, I)] and [b.shape for b in w["w2_lora_b"]] == [(3, E, H, 4)]
    assert w["w2_lora_b"][0].stride(2) == 1 and w["w2_lora_a"][0].device.type == "cpu"      # B packed N-fastest
    # the same draws as one op at a time, w13 first, then B packed
    gen = torch.Generator().manual_seed(0)
    a13, b13 = random_lora_weights(shape, "w13", 3, 4, gen, torch.float32)
    a2, b2 = random_lora_weights(shape, "w2", 3, 4, gen, torch.float32)
    assert all(torch.equal(x, y) for x, y in zip([*a13, *b13, *a2, *b2],
                                                 [*w["w13_lora_a"], *w["w13_lora_b"], *w["w2_lora_a"], *w["w2_lora_b"]]))
    assert b13[0].stride(3) == 1 and pack_lora_b(b13)[0].stride(2) == 1
    assert float(a13[0].std()) == pytest.approx(H ** -0.5, rel=0.2)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(shape="tiny"), TypeError, "shape: expected a MoEShape"),
    (dict(op="w3"), ValueError, "op: 'w3' is not one of 'w13', 'w2'"),
    (dict(num_loras=0), ValueError, "num_loras"),
    (dict(rank=-1), ValueError, "rank"),
    (dict(generator=0), TypeError, "generator: expected a torch.Generator"),
    (dict(dtype=torch.int32), TypeError, "dtype: torch.int32 is not supported"),
])
def test_random_lora_weights_validation(kwargs, exc, match):
    from moelora_lab.config import random_lora_weights
    args = dict(shape=MoEShape.from_name("tiny"), op="w13", num_loras=2, rank=4, generator=torch.Generator(),
                dtype=torch.float32) | kwargs
    with pytest.raises(exc, match=match):
        random_lora_weights(**args)


def test_benchmark_routing_gives_adapters_at_random_or_in_turn():
    shape = MoEShape.from_name("tiny")
    used = {how: [set(benchmark_routing(shape, 4, 64, seed, how)["token_lora"].tolist()) for seed in range(8)]
            for how in ("uniform", "distinct")}
    assert all(u == {0, 1, 2, 3} for u in used["distinct"])       # 8 sequences, adapter i mod 4: all in use
    assert any(len(u) < 4 for u in used["uniform"])                 # at random, one is often left out
    r = benchmark_routing(shape, 4, 64, 3, "distinct")["token_lora"]
    assert r.tolist() == [(t * 8 // 64) % 4 for t in range(64)]
    same = benchmark_routing(shape, 4, 64, 3), make_routing(shape, 4, 64, seed=67, num_sequences=8)
    assert all(torch.equal(same[0][n], same[1][n]) for n in same[1])  # the default is the committed data's routing
    with pytest.raises(ValueError, match="adapters: 'round_robin' is not one of uniform, distinct"):
        benchmark_routing(shape, 4, 8, 0, "round_robin")
