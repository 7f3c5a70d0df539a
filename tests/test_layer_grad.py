"""The layer's gradients (``layer.grad``) against torch autograd of the forward spec, on every product schedule
(CPU interpreter, or CUDA with --gpu; bf16 on a GPU only)."""
from __future__ import annotations

import warnings

import pytest
import torch

import moelora_lab as ml
from moelora_lab.layer import SCHEDULES, moe_lora_layer
from moelora_lab.layer.grad import layer_with_grad
from utils import assert_close, poisoned_allocations, strided

SHAPE = ml.MoEShape(48, 40, 10, 2, "train-test")
RANKS = (8, 3, 0, 8)                               # slot 1 cut to rank 3, slot 2 to rank 0, slot 3 unused
TOKEN_LORA = [0, 1, -1, 2, 1, 0, -1]               # two adapters and rank 0 in one batch, two tokens without
LORA = ("w13_lora_a", "w13_lora_b", "w2_lora_a", "w2_lora_b")
PRODUCT = [name for name, row in SCHEDULES.items() if row.status != "experiment"]
EXPERIMENT = next(name for name, row in SCHEDULES.items() if row.status == "experiment")
NATIVE_BF16 = "bf16 runs natively on a GPU only; the interpreter refuses it in the layer"


def _problem(device, dtype=torch.float32, seed=0):
    """(spec, layer): the same inputs with NaN in memory nothing may read, slot 3 (no token uses it) and the experts
    no pair reaches; the layer's copy also holds NaN past each slot's rank, where the spec's holds zeros."""
    p = ml.make_problem(SHAPE, ml.LoRAShape(4, 8), len(TOKEN_LORA), dtype=dtype, device=device, seed=seed,
                        adapter_ranks=RANKS)
    spec = p.layer_inputs()
    spec["token_lora"] = torch.tensor(TOKEN_LORA, dtype=torch.int32, device=device)
    unused = sorted(set(range(SHAPE.num_experts)) - set(p.topk_ids.flatten().tolist()))
    assert unused, "the problem must leave an expert unreached"
    for w in (spec["w13"], spec["w2"]):
        w[unused] = float("nan")
    for name in LORA:
        for w in spec[name]:
            w[3] = float("nan")
    layer = {n: [w.clone() for w in v] if n in LORA else v for n, v in spec.items()}
    for l, rank in enumerate(RANKS[:3]):
        for a in layer["w13_lora_a"] + layer["w2_lora_a"]:
            a[l, :, rank:] = float("nan")
        for b in layer["w13_lora_b"] + layer["w2_lora_b"]:
            b[l, :, :, rank:] = float("nan")
    return spec, layer


def _leaves(inputs):
    return [inputs["x"], inputs["topk_weights"], *(w for n in LORA for w in inputs[n])]


def _spec_grads(spec, dy, dtype):
    """Autograd of ``moe_layer_reference`` in ``dtype`` (float32 or float64)."""
    inputs = {n: [w.to(dtype) for w in v] if n in LORA else v.to(dtype) if v.is_floating_point() else v
              for n, v in spec.items()}
    leaves = _leaves(inputs)
    for t in leaves:
        t.requires_grad_()
    y = ml.moe_layer_reference(**inputs)
    return torch.autograd.grad(y, leaves, dy.to(dtype))


def _layer_grads(layer, dy, schedule, **kw):
    leaves = _leaves(layer)
    for t in leaves:
        t.requires_grad_()
    extra = {}
    if SCHEDULES[schedule].needs_pack:              # packed from the B that trains: the pack holds no graph
        pack = ml.pack_in_k(layer["w13"], layer["w2"], layer["w13_lora_b"], layer["w2_lora_b"])
        layer = layer | dict(w13=pack.w13, w2=pack.w2)
        extra = dict(in_k=pack)
    with warnings.catch_warnings(), poisoned_allocations():
        warnings.simplefilter("ignore")           # the CPU says dual_stream runs on one stream
        y = moe_lora_layer(**layer, schedule=schedule, **extra, **kw)
        return y, torch.autograd.grad(y, leaves, dy)


@pytest.mark.parametrize("schedule", PRODUCT)
def test_gradients_of_every_product_schedule_match_autograd_of_the_spec(device, schedule):
    """Tokens without an adapter, three adapters, lora_ranks with rank 0, NaN where nothing may read, a strided x."""
    spec, layer = _problem(device)
    layer["x"] = strided(layer["x"], "gapped")
    dy = torch.randn(len(TOKEN_LORA), SHAPE.hidden, device=device)
    y, got = _layer_grads(layer, dy, schedule, lora_ranks=torch.tensor(RANKS, device=device))
    assert y.grad_fn is not None and got[0].stride() == (SHAPE.hidden, 1)
    for want in (_spec_grads(spec, dy, torch.float32), _spec_grads(spec, dy, torch.float64)):
        for g, w in zip(got, want):
            assert g.dtype == torch.float32 and g.shape == w.shape
            assert_close(g, w, torch.float32)
    gx, _, ga13, *_ = got
    assert gx[2].abs().sum() > 0                  # a token without an adapter: its base gradient
    assert ga13[3].abs().sum() == 0 and ga13[1, :, 3:].abs().sum() == 0 and ga13[2].abs().sum() == 0


def test_gradients_in_float16(device):
    spec, layer = _problem(device, torch.float16, seed=3)
    dy = torch.randn(len(TOKEN_LORA), SHAPE.hidden, device=device, dtype=torch.float16)
    _, got = _layer_grads(layer, dy, "sequential", lora_ranks=torch.tensor(RANKS, device=device))
    assert got[0].dtype == torch.float16 and got[1].dtype == torch.float32        # x's and the routing weights'
    for g, w in zip(got, _spec_grads(spec, dy, torch.float64)):
        assert_close(g, w, torch.float16)
    assert all(g.dtype == torch.float16 for g in got[2:])


@pytest.mark.parametrize("schedule", PRODUCT)
def test_gradients_in_bfloat16(device, schedule):
    """bf16 inputs (NaN where nothing may read) against fp32 autograd of the spec from the same rounded values."""
    if device != "cuda":
        pytest.skip(NATIVE_BF16)
    spec, layer = _problem(device, torch.bfloat16, seed=7)
    dy = torch.randn(len(TOKEN_LORA), SHAPE.hidden, device=device, dtype=torch.bfloat16)
    _, got = _layer_grads(layer, dy, schedule, lora_ranks=torch.tensor(RANKS, device=device))
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    assert all(g.dtype == torch.bfloat16 for g in got[2:])
    for g, w in zip(got, _spec_grads(spec, dy, torch.float32)):
        assert_close(g, w, torch.bfloat16)


def test_gradients_in_bfloat16_at_a_real_shape(device):
    """qwen3-30b-a3b's layer (H 2048, I 768, 128 experts, top-8), 64 tokens, two adapters of rank 16 (one cut to
    9), every product schedule against fp32 autograd of the spec."""
    if device != "cuda":
        pytest.skip(NATIVE_BF16 + "; this shape is too large for it")
    p = ml.make_problem("qwen3-30b-a3b", ml.LoRAShape(2, 16), 64, dtype=torch.bfloat16, device=device, seed=9,
                        with_base=False, adapter_ranks=(16, 9), no_adapter_fraction=0.25)
    E, H, I = p.shape.num_experts, p.shape.hidden, p.shape.intermediate
    gen = torch.Generator(device=device).manual_seed(10)       # the base weights drawn where they live: 600M values
    spec = dict(x=p.x, topk_ids=p.topk_ids, topk_weights=p.topk_weights, token_lora=p.token_lora,
                w13=(torch.randn(E, 2 * I, H, generator=gen, device=device) / H ** 0.5).to(torch.bfloat16),
                w2=(torch.randn(E, H, I, generator=gen, device=device) / I ** 0.5).to(torch.bfloat16),
                **{n: list(getattr(p, n)) for n in LORA})
    dy = torch.randn(64, H, generator=gen, device=device).to(torch.bfloat16)
    want = _spec_grads(spec, dy, torch.float32)
    ranks = torch.tensor([16, 9], device=device)
    for schedule in PRODUCT:
        _, got = _layer_grads(dict(spec), dy, schedule, lora_ranks=ranks)
        for g, w in zip(got, want):
            assert_close(g, w, torch.bfloat16)


def test_forward_with_grad_is_the_forward_without(device):
    _, layer = _problem(device, seed=1)
    ranks = torch.tensor(RANKS, device=device)
    for schedule in PRODUCT:
        extra = {}
        if SCHEDULES[schedule].needs_pack:
            pack = ml.pack_in_k(layer["w13"], layer["w2"], layer["w13_lora_b"], layer["w2_lora_b"])
            extra = dict(w13=pack.w13, w2=pack.w2, in_k=pack)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")           # the CPU says dual_stream runs on one stream
            plain = moe_lora_layer(**(layer | extra), schedule=schedule, lora_ranks=ranks)
            y = moe_lora_layer(**(layer | extra | dict(x=layer["x"].clone().requires_grad_())), schedule=schedule,
                               lora_ranks=ranks)
        assert plain.grad_fn is None and y.grad_fn is not None
        assert torch.equal(y, plain), schedule


def test_only_the_lora_factors_train(device):
    """x and the routing weights constants (the usual fine-tuning), the plain layer, and an empty batch."""
    spec, layer = _problem(device, seed=2)
    dy = torch.randn(len(TOKEN_LORA), SHAPE.hidden, device=device)
    factors = [w.requires_grad_() for n in LORA for w in layer[n]]
    got = torch.autograd.grad(moe_lora_layer(**layer, lora_ranks=torch.tensor(RANKS, device=device)), factors, dy)
    for g, w in zip(got, _spec_grads(spec, dy, torch.float64)[2:]):
        assert_close(g, w, torch.float32)
    plain = {n: v for n, v in layer.items() if n not in LORA} | dict(x=layer["x"].clone().requires_grad_())
    gx, = torch.autograd.grad(moe_lora_layer(**plain), [plain["x"]], dy)
    zeros = {n: [torch.zeros_like(w) for w in spec[n]] for n in LORA}
    assert_close(gx, _spec_grads(spec | zeros, dy, torch.float64)[0], torch.float32)
    empty = {n: v[:0] if n in ("x", "topk_ids", "topk_weights", "token_lora") else v for n, v in plain.items()}
    y = moe_lora_layer(**empty)
    assert y.shape == (0, SHAPE.hidden) and torch.autograd.grad(y.sum(), [plain["x"]])[0].abs().sum() == 0


def test_frozen_base_and_experiment_schedules_refuse(device):
    """A backward that needs what the layer does not give raises, naming it; the forward serves all the same
    (inference with weights that are parameters needs no ``torch.no_grad()``)."""
    _, layer = _problem(device, seed=4)
    layer["x"].requires_grad_()
    layer["lora_ranks"] = torch.tensor(RANKS, device=device)      # the layer's copy holds NaN past each rank
    with torch.no_grad():
        want = moe_lora_layer(**layer)
    y = moe_lora_layer(**(layer | dict(w13=layer["w13"].clone().requires_grad_())))
    assert torch.equal(y, want)
    with pytest.raises(ValueError, match=r"w13: requires grad.*w13.requires_grad_\(False\)"):
        y.sum().backward()
    y = moe_lora_layer(**(layer | dict(w2=layer["w2"].clone().requires_grad_(), x=layer["x"].detach())))
    with pytest.raises(ValueError, match=r"w2: requires grad.*w2.detach\(\)"):
        y.sum().backward()
    y = moe_lora_layer(**layer, schedule=EXPERIMENT)
    with torch.no_grad():
        want = moe_lora_layer(**layer, schedule=EXPERIMENT)
    assert torch.equal(y, want) and y.grad_fn is not None
    with pytest.raises(ValueError, match=f"schedule='{EXPERIMENT}': an experiment without a backward"):
        y.sum().backward()
    with torch.no_grad():                          # no gradient asked: the experiments run as they are
        assert moe_lora_layer(**layer, schedule=EXPERIMENT).grad_fn is None


def test_a_pack_of_trained_weights_holds_no_graph(device):
    """pack_in_k packs without autograd: weights that require grad give a pack that does not."""
    _, layer = _problem(device, seed=6)
    trained_b = [b.clone().requires_grad_() for b in layer["w13_lora_b"] + layer["w2_lora_b"]]
    pack = ml.pack_in_k(layer["w13"].requires_grad_(), layer["w2"], trained_b[:2], trained_b[2:])
    assert not any(t.requires_grad for t in (pack.w13, pack.w2, pack.w13_ext, pack.w2_ext))


def test_gradcheck_in_float64(device):
    """The backward's arithmetic against finite differences of the float64 spec (the kernels take no float64:
    the backward runs its float64 form, and the kernels' gradients are checked above)."""
    p = ml.make_problem(ml.MoEShape(6, 5, 3, 2, "tiny-grad"), ml.LoRAShape(2, 3), 4, seed=5, device=device)
    token_lora = torch.tensor([1, -1, 0, 1], dtype=torch.int32, device=device)
    ranks = torch.tensor([3, 2], device=device)
    keep = (torch.arange(3, device=device) < ranks[:, None]).double()                     # [L, r]

    def spec(x, topk_ids, topk_weights, token_lora, w13, w2, a13, b13, a2, b2, *, plan, lora_ranks, **options):
        cut = [a * keep[:, None, :, None] for a in a13], [a * keep[:, None, :, None] for a in a2]
        return ml.moe_layer_reference(x, topk_ids, topk_weights, token_lora, w13, w2, cut[0], b13, cut[1], b2)

    def layer(x, topk_weights, *lora):
        return layer_with_grad(spec, x, p.topk_ids, topk_weights, token_lora, p.w13.double(), p.w2.double(),
                               list(lora[:2]), list(lora[2:4]), [lora[4]], [lora[5]], lora_ranks=ranks)

    inputs = [t.double().requires_grad_() for t in (p.x, p.topk_weights, *p.w13_lora_a, *p.w13_lora_b,
                                                    *p.w2_lora_a, *p.w2_lora_b)]
    assert torch.autograd.gradcheck(layer, inputs)
