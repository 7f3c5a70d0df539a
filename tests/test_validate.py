"""No silent wrong answer: the shortcuts of the op and the layer (blocks=, plan=, enabled=, output=)
and odd-but-valid inputs either compute the right thing or raise a named error."""
import warnings

import pytest
import torch

import moelora_lab as ml
from moelora_lab.bench.eager_sweep import syncs_per_call
from moelora_lab.op.dispatch import KernelConfig
from moelora_lab.layer import moe_lora_layer, plan_layer
from moelora_lab.op.face import moe_lora
from moelora_lab.validate import check_no_overlap, check_values
from utils import assert_close, lora_case, poisoned

PATHS = ["reference", "one_shot", "two_kernel", "small_batch"]
BLOCK_PATHS = ["one_shot", "two_kernel"]
SHAPE = ml.MoEShape(48, 40, 6, 2, "validate-test")


def tiles(device):
    kw = dict(num_warps=1, num_stages=1) if device == "cpu" else {}
    return KernelConfig(block_m=16, block_n=32, block_k=32, **kw)


def cfg_for(path, device):
    return None if path == "reference" else tiles(device)


def layer_problem(device, M=9, rank=8, seed=1, **kw):
    return ml.make_problem(SHAPE, ml.LoRAShape(3, rank), M, device=device, seed=seed, **kw)


# ---- enabled= ---------------------------------------------------------------------------------

@pytest.mark.parametrize("path", PATHS)
def test_enabled_never_gives_an_adapter_to_a_token_without_one(device, path):
    p = lora_case(10, device=device, seed=21, no_adapter_fraction=0.5)
    assert (p.token_lora < 0).any() and (p.token_lora == 0).any()      # slot 0 is enabled and used
    out = moe_lora(**p.w13_lora_inputs(), path=path, enabled=torch.ones(3, dtype=torch.bool, device=device),
                   output=poisoned((10, 2, 80), torch.float32, device), add_inputs=False, config=cfg_for(path, device))
    none = (p.token_lora < 0)
    assert torch.isnan(out[none]).all(), "rows of tokens without an adapter were written"
    ref = ml.moe_lora_reference(**p.w13_lora_inputs())
    assert_close(out[~none], ref[~none], torch.float32)


@pytest.mark.parametrize("path", BLOCK_PATHS)
def test_enabled_is_honoured_with_reused_blocks(device, path):
    p = lora_case(12, device=device, seed=22)
    blocks = ml.block_list(p.topk_ids, p.token_lora, 8, 3, 16)
    enabled = torch.tensor([True, False, True], device=device)
    out = moe_lora(**p.w13_lora_inputs(), path=path, enabled=enabled, blocks=blocks, config=tiles(device),
                   output=poisoned((12, 2, 80), torch.float32, device), add_inputs=False)
    off = p.token_lora == 1
    assert off.any() and torch.isnan(out[off]).all(), "a disabled slot's rows were written"
    masked = torch.where(off, -1, p.token_lora)
    ref = ml.moe_lora_reference(p.x, p.topk_ids, p.topk_weights, masked, p.w13_lora_a, p.w13_lora_b)
    on = masked >= 0
    assert_close(out[on], ref[on], torch.float32)


# ---- reused blocks and plans --------------------------------------------------------------------

def test_blocks_built_for_other_routing_are_rejected(device):
    p = lora_case(8, device=device, seed=23)
    q = lora_case(9, device=device, seed=24)
    kw = dict(path="one_shot", config=tiles(device))
    with pytest.raises(ValueError, match="blocks: built for M=9, but this call has M=8"):
        moe_lora(**p.w13_lora_inputs(), blocks=ml.block_list(q.topk_ids, q.token_lora, 8, 3, 16), **kw)
    with pytest.raises(ValueError, match="blocks: built for E=9, but this call has E=8"):
        moe_lora(**p.w13_lora_inputs(), blocks=ml.block_list(p.topk_ids, p.token_lora, 9, 3, 16), **kw)
    with pytest.raises(ValueError, match="blocks: built for L=4, but this call has L=3"):
        moe_lora(**p.w13_lora_inputs(), blocks=ml.block_list(p.topk_ids, p.token_lora, 8, 4, 16), **kw)
    other = p.topk_ids.flip(0).clone()               # same shape, other routing
    with pytest.raises(ValueError, match="blocks: not built for this call's topk_ids \\(it was built from another"):
        moe_lora(**p.w13_lora_inputs(), blocks=ml.block_list(other, p.token_lora, 8, 3, 16), **kw)
    blocks = ml.block_list(p.topk_ids, p.token_lora, 8, 3, 16)
    p.token_lora[0] = (p.token_lora[0] + 1) % 3       # routing changed in place after the blocks were built
    with pytest.raises(ValueError, match="blocks: not built for this call's token_lora \\(the tensor was modified"):
        moe_lora(**p.w13_lora_inputs(), blocks=blocks, **kw)


def test_wrong_shapes_are_caught_with_blocks_and_plans(device):
    p = lora_case(8, device=device, seed=25)
    blocks = ml.block_list(p.topk_ids, p.token_lora, 8, 3, 16)
    kw = p.w13_lora_inputs() | dict(path="one_shot", blocks=blocks, config=tiles(device), mul_routed_weight=True)
    with pytest.raises(ValueError, match="topk_weights: expected shape \\(8, 2\\)"):
        moe_lora(**(kw | dict(topk_weights=p.topk_weights[:4])))
    q = layer_problem(device, seed=26)
    plan = plan_layer(q.topk_ids, q.token_lora, SHAPE.num_experts, 3, 8)
    with pytest.raises(ValueError, match="topk_weights: expected shape \\(9, 2\\)"):
        moe_lora_layer(**(q.layer_inputs() | dict(topk_weights=q.topk_weights[:, :1])), plan=plan)
    with pytest.raises(ValueError, match="token_lora: expected shape \\(9,\\)"):
        moe_lora_layer(**(q.layer_inputs() | dict(token_lora=q.token_lora[:5])), plan=plan)


def test_plans_for_other_routing_or_adapters_are_rejected(device):
    p = layer_problem(device, seed=27)
    q = layer_problem(device, seed=28, M=7)
    E = SHAPE.num_experts
    with pytest.raises(ValueError, match="plan: built for M=7, but this call has M=9"):
        moe_lora_layer(**p.layer_inputs(), plan=plan_layer(q.topk_ids, q.token_lora, E, 3, 8))
    other = layer_problem(device, seed=29)                  # same shapes, other routing draw
    with pytest.raises(ValueError, match="plan: not built for this call's topk_ids"):
        moe_lora_layer(**p.layer_inputs(), plan=plan_layer(other.topk_ids, p.token_lora, E, 3, 8))
    with pytest.raises(ValueError, match="plan: made for a layer with 3 adapters of rank 4, but this call is with 3 "
                                         "adapters of rank 8"):
        moe_lora_layer(**p.layer_inputs(), plan=plan_layer(p.topk_ids, p.token_lora, E, 3, 4))
    plan = plan_layer(p.topk_ids, p.token_lora, E, 3, 8)
    y = moe_lora_layer(**p.layer_inputs(), plan=plan)
    p.topk_ids[0] = p.topk_ids[0].flip(0)                   # changed in place: the plan is stale
    with pytest.raises(ValueError, match="plan: not built for this call's topk_ids \\(the tensor was modified"):
        moe_lora_layer(**p.layer_inputs(), plan=plan)
    assert y.shape == (9, SHAPE.hidden)


def test_the_layer_checks_ids_unless_its_plan_did(device, monkeypatch):
    """A plan made with validate=True vouches for its (unchanged) routing: no second check, no sync.
    One made with validate=False does not: the layer checks the ids itself."""
    import moelora_lab.layer.face as layer_mod
    seen = []
    monkeypatch.setattr(layer_mod, "check_values", lambda ranges: seen.append([r[0] for r in ranges]))
    p = layer_problem(device, seed=30)
    E = SHAPE.num_experts
    for plan_checked, expect in ((True, []), (False, ["topk_ids", "token_lora"])):
        seen.clear()
        plan = plan_layer(p.topk_ids, p.token_lora, E, 3, 8, validate=plan_checked)
        moe_lora_layer(**p.layer_inputs(), plan=plan)
        assert seen == [expect]
    seen.clear()
    moe_lora_layer(**p.layer_inputs(), plan=plan, validate=False)
    assert seen == []


# ---- the layer's LoRA weights ----------------------------------------------------------------------

def test_layer_w2_lora_must_match_w13_lora():
    p = layer_problem("cpu", seed=31)
    inputs = p.layer_inputs()
    fewer = dict(w2_lora_a=[w[:2] for w in p.w2_lora_a], w2_lora_b=[w[:2] for w in p.w2_lora_b])
    for schedule in ("sequential", "fused"):
        with pytest.raises(ValueError, match="w2_lora_a\\[0\\]: has 2 adapter slots of rank 8, but w13_lora_a has 3"):
            moe_lora_layer(**(inputs | fewer), schedule=schedule)
    half = dict(w2_lora_a=[w.half() for w in p.w2_lora_a], w2_lora_b=[w.half() for w in p.w2_lora_b])
    with pytest.raises(TypeError, match="w2_lora_a\\[0\\]: dtype torch.float16 must equal x's dtype torch.float32"):
        moe_lora_layer(**(inputs | half))
    with pytest.raises(ValueError, match="topk_weights: required by the layer"):
        moe_lora_layer(**(inputs | dict(topk_weights=None)))


# ---- output= ------------------------------------------------------------------------------------------

def test_output_sharing_memory_with_an_input_is_rejected(device):
    M, k = 6, 2                                               # w2 with H == I: an in-place delta would fit
    shape = ml.MoEShape(48, 48, 8, 2, "square")
    q = ml.make_problem(shape, ml.LoRAShape(3, 8), M, device=device, seed=33, with_base=False)
    h = torch.randn(M * k, 48, device=device)
    args = (h, q.topk_ids, q.topk_weights, q.token_lora, q.w2_lora_a, [w[:, :, :48] for w in q.w2_lora_b])
    with pytest.raises(ValueError, match="output: shares memory with x; the kernels would read values"):
        moe_lora(*args, output=h.view(M, k, 48), mul_routed_weight=True, path="one_shot", config=tiles(device))
    with pytest.raises(ValueError, match="output: shares memory with lora_b\\[0\\]"):
        moe_lora(*args, output=args[5][0].reshape(-1)[: M * k * 48].view(M, k, 48), mul_routed_weight=True)
    out = torch.zeros(M, k, 48, device=device)                 # a separate buffer is fine
    moe_lora(*args, output=out, mul_routed_weight=True, path="one_shot", config=tiles(device))
    assert_close(out, ml.moe_lora_reference(*args, mul_routed_weight=True), torch.float32)


def test_overlap_check_is_exact_about_ranges():
    base = torch.zeros(100)
    check_no_overlap("out", base[:50], x=base[50:])                      # adjacent, not overlapping
    with pytest.raises(ValueError, match="out: shares memory with x"):
        check_no_overlap("out", base[:51], x=base[50:])
    check_no_overlap("out", base, x=torch.zeros(0), w=[None, 3])


# ---- rank 0 ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", PATHS + ["auto"])
@pytest.mark.parametrize("add_inputs", [False, True])
def test_rank_zero_is_the_zero_delta_on_every_path(device, path, add_inputs):
    p = lora_case(7, device=device, seed=34, no_adapter_fraction=0.3)
    a0 = [w[:, :, :0] for w in p.w13_lora_a]
    b0 = [w[..., :0] for w in p.w13_lora_b]
    init = torch.randn(7, 2, 80, device=device)
    out = moe_lora(p.x, p.topk_ids, p.topk_weights, p.token_lora, a0, b0, path=path, output=init.clone(),
                   add_inputs=add_inputs, config=cfg_for(path, device) if path != "auto" else None)
    has = (p.token_lora >= 0).view(-1, 1, 1).expand_as(out)
    assert torch.equal(out[~has], init[~has])
    assert torch.equal(out[has], init[has] if add_inputs else torch.zeros_like(init[has]))


@pytest.mark.parametrize("schedule", ["sequential", "dual_stream", "fused", "auto"])
def test_rank_zero_layer_is_the_base_layer(device, schedule):
    p = layer_problem(device, seed=35, rank=1)
    inputs = p.layer_inputs()
    zero = dict(w13_lora_a=[w[:, :, :0] for w in p.w13_lora_a], w13_lora_b=[w[..., :0] for w in p.w13_lora_b],
                w2_lora_a=[w[:, :, :0] for w in p.w2_lora_a], w2_lora_b=[w[..., :0] for w in p.w2_lora_b])
    base = {k: v for k, v in inputs.items() if "lora_" not in k}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        y = moe_lora_layer(**(inputs | zero), schedule=schedule)
        plan = plan_layer(p.topk_ids, p.token_lora, SHAPE.num_experts, 3, 0, schedule=schedule)
        assert torch.equal(moe_lora_layer(**(inputs | zero), schedule=schedule, plan=plan), y)
    assert torch.equal(y, moe_lora_layer(**base))


# ---- named errors ----------------------------------------------------------------------------------------------

def test_named_errors_for_missing_or_unknown_arguments(device):
    p = lora_case(4, seed=36, device=device)
    with pytest.raises(ValueError, match="topk_weights: required with mul_routed_weight=True"):
        moe_lora(p.x, p.topk_ids, None, p.token_lora, p.w13_lora_a, p.w13_lora_b, mul_routed_weight=True)
    out = moe_lora(p.x, p.topk_ids, None, p.token_lora, p.w13_lora_a, p.w13_lora_b, path="one_shot",
                   config=tiles(device))          # w13 needs no routing weight
    assert_close(out, ml.moe_lora_reference(**p.w13_lora_inputs()), torch.float32)
    with pytest.raises(ValueError, match="path: 'naive' is not one of 'reference', 'two_kernel', 'one_shot', "
                                         "'small_batch', 'auto'"):
        moe_lora(**p.w13_lora_inputs(), path="naive")
    q = layer_problem(device, seed=37)
    E = SHAPE.num_experts
    with pytest.raises(ValueError, match="lora_path: 'bogus' is not one of 'two_kernel', 'one_shot', 'small_batch'"):
        plan_layer(q.topk_ids, q.token_lora, E, 3, 8, lora_path="bogus")
    with pytest.raises(ValueError, match="lora_path: 'reference' is not one of"):
        moe_lora_layer(**q.layer_inputs(), lora_path="reference")
    with pytest.raises(TypeError, match="rank: expected an int \\(the LoRA rank r of the weights\\)"):
        plan_layer(q.topk_ids, q.token_lora, E, 3, None)
    with pytest.raises(ValueError, match="schedule: 'fast' is not one of"):
        plan_layer(q.topk_ids, q.token_lora, E, 3, 8, schedule="fast")
    with pytest.raises(ValueError, match="KernelConfig.programs: must be >= 1, got -3"):
        KernelConfig(programs=-3)
    with pytest.raises(ValueError, match="num_experts: must be >= 1, got 0"):
        plan_layer(q.topk_ids, q.token_lora, 0, 3, 8)


def test_check_values_reads_all_ranges_at_once():
    ok = torch.tensor([0, 1, 2])
    check_values([("a", ok, 0, 3, ""), ("b", ok, -1, 5, ""), ("c", None, 0, 1, ""), ("d", ok[:0], 9, 10, "")])
    with pytest.raises(ValueError, match="b: value 2 is out of range; accepted values are 0 .. 1 \\(slots\\)"):
        check_values([("a", ok, 0, 3, ""), ("b", ok, 0, 2, "slots")])
    with pytest.raises(ValueError, match="a: value -1 is out of range"):
        check_values([("a", ok - 1, 0, 3, "")])


def test_validate_false_skips_only_the_value_checks(device):
    p = lora_case(5, seed=38, device=device)
    bad = p.topk_ids.clone()
    bad[0, 0] = 8                                              # expert 8 of 8: out of range
    with pytest.raises(ValueError, match="topk_ids: value 8 is out of range"):
        moe_lora(p.x, bad, p.topk_weights, p.token_lora, p.w13_lora_a, p.w13_lora_b, path="reference")
    with pytest.raises(ValueError, match="topk_ids: expected a 2-D tensor"):      # shapes: always checked
        moe_lora(p.x, bad[0], p.topk_weights, p.token_lora, p.w13_lora_a, p.w13_lora_b, validate=False)
    good = moe_lora(**p.w13_lora_inputs(), validate=False, path="one_shot", config=tiles(device))
    assert_close(good, ml.moe_lora_reference(**p.w13_lora_inputs()), torch.float32)


# ---- device synchronisations (GPU) ----------------------------------------------------------------------

@pytest.mark.gpu
def test_eager_calls_synchronise_once_or_not_at_all():
    p = ml.make_problem("qwen3-30b-a3b", ml.LoRAShape(4, 16), 16, dtype=torch.bfloat16, device="cuda", seed=3)
    E, L = 128, 4
    op = p.w13_lora_inputs()
    blocks = ml.block_list(p.topk_ids, p.token_lora, E, L, 16)
    plan = plan_layer(p.topk_ids, p.token_lora, E, L, 16)
    ranks = torch.full((L,), 8, dtype=torch.int32, device="cuda")
    calls = {
        "op": (lambda: moe_lora(**op), 1),
        "op, validate=False": (lambda: moe_lora(**op, validate=False), 0),
        "op, checked blocks": (lambda: moe_lora(**op, blocks=blocks, path="one_shot"), 0),
        "op, checked blocks and lora_ranks": (lambda: moe_lora(**op, blocks=blocks, lora_ranks=ranks, path="one_shot"), 1),
        "layer": (lambda: moe_lora_layer(**p.layer_inputs()), 1),
        "layer, validate=False": (lambda: moe_lora_layer(**p.layer_inputs(), validate=False), 0),
        "layer, checked plan": (lambda: moe_lora_layer(**p.layer_inputs(), plan=plan), 0),
        "layer, fused": (lambda: moe_lora_layer(**p.layer_inputs(), schedule="fused"), 1),
    }
    for fn, _ in calls.values():
        fn()                                            # compile first
    counts = {name: syncs_per_call(fn) for name, (fn, _) in calls.items()}
    assert counts == {name: want for name, (_, want) in calls.items()}


def test_wants_grad_looks_through_lists_and_dicts_and_respects_no_grad():
    from moelora_lab.validate import wants_grad
    plain, leaf = torch.ones(2), torch.ones(2, requires_grad=True)
    assert not wants_grad(plain, None, [plain], {"a": [plain]})
    assert wants_grad(None, [plain, leaf])
    assert wants_grad({"w": {"lora": [plain, leaf]}})
    with torch.no_grad():
        assert not wants_grad(leaf)
