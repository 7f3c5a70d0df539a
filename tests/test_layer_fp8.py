"""The MoE layer with LoRA on a quantized (FP8) base: every schedule that serves it against the spec
(``quant.moe_layer_reference_fp8``), the neutrality of tokens without an adapter, NaN in an unused slot, and the
named refusals of what cannot run it (in_k, the experiments, a backward, the distributed layers, a mixed base)."""
from __future__ import annotations

import warnings

import pytest
import torch

import moelora_lab as ml
from moelora_lab.dist import ExpertPartition, run_local, shard_tp
from moelora_lab.layer import SCHEDULES, gpu_schedule, moe_lora_layer, pack_in_k, resolve_schedule
from moelora_lab.layer.plan import IN_K_MIN_PAIRS_PER_EXPERT
from moelora_lab.quant import FP8Weight, base_gemm, moe_layer_reference_fp8, quantize_experts
from utils import TOL, poisoned

SMALL = ml.MoEShape(64, 32, 4, 2, "fp8-small")          # H, I multiples of 32: block scales of 32 fit
WIDE = ml.MoEShape(256, 128, 4, 2, "fp8-wide")          # the checkpoints' (128, 128) blocks, two along H
SERVING = [n for n, row in SCHEDULES.items() if row.status == "product" and row.refuses_fp8() is None]
REFUSING = [n for n, row in SCHEDULES.items() if row.refuses_fp8() is not None]


def problem(device, shape=SMALL, dtype=torch.float32, M=11, seed=0, block_size=(32, 32), **kw):
    """A fresh problem and its base quantized: (the layer's inputs on the FP8 base, the QuantizedExperts)."""
    p = ml.make_problem(shape, ml.LoRAShape(3, 8), M, dtype=dtype, device=device, seed=seed, **kw)
    inputs = p.layer_inputs()
    q = quantize_experts(inputs["w13"].float(), inputs["w2"].float(), block_size)
    return inputs | dict(w13=q.w13, w2=q.w2), q


def spec(inputs, q):
    names = ("x", "topk_ids", "topk_weights", "token_lora")
    lora = ("w13_lora_a", "w13_lora_b", "w2_lora_a", "w2_lora_b")
    return moe_layer_reference_fp8(*(inputs[n] for n in names), q, *(inputs[n] for n in lora))


def layer(inputs, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)       # the CPU says dual_stream runs on one stream
        return moe_lora_layer(**inputs, **kw)


def dtypes(device):
    return [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])


def close(y, ref, dtype):
    assert not torch.isnan(y).any()
    tol = TOL[dtype]
    torch.testing.assert_close(y.float(), ref, rtol=0, atol=tol * float(ref.abs().max()))


def test_the_product_schedules_serve_a_quantized_base():
    assert "sequential" in SERVING and "dual_stream" in SERVING and "in_k" in REFUSING
    assert all(SCHEDULES[n].status == "experiment" for n in REFUSING if n != "in_k")


@pytest.mark.parametrize("block_size", [(32, 32), None], ids=["blocks32", "per_tensor"])
@pytest.mark.parametrize("join", ["fold", "vllm"])
@pytest.mark.parametrize("schedule", SERVING + ["auto"])
def test_layer_matches_the_fp8_spec(device, schedule, join, block_size):
    for dtype in dtypes(device):
        inputs, q = problem(device, dtype=dtype, block_size=block_size, no_adapter_fraction=0.3, seed=3)
        y = layer(inputs, schedule=schedule, join=join)
        assert y.shape == (11, SMALL.hidden) and y.dtype == dtype
        close(y, spec(inputs, q), dtype)


def test_layer_matches_the_fp8_spec_with_the_checkpoint_blocks(device):
    """(128, 128) blocks and 128-column activation groups, the default: two scales along H."""
    inputs, q = problem(device, WIDE, M=5, block_size=ml.quant.BLOCK_SIZE, seed=4)
    assert q.w13.scale.shape == (4, 2, 2)
    ref = spec(inputs, q)
    close(layer(inputs, schedule="sequential"), ref, torch.float32)
    # the FP8 base is really read: the layer on the unquantized weights differs by far more than the tolerance
    plain = problem(device, WIDE, M=5, seed=4)[0] | {n: q_w.dequantize() for n, q_w in (("w13", q.w13), ("w2", q.w2))}
    assert float((layer(plain, schedule="sequential") - ref).abs().max()) > 1e-3 * float(ref.abs().max())


@pytest.mark.parametrize("join", ["fold", "vllm"])
@pytest.mark.parametrize("schedule", SERVING)
def test_tokens_without_an_adapter_get_the_base_layer_bit_for_bit(device, schedule, join):
    inputs, _ = problem(device, no_adapter_fraction=0.5, seed=5)
    none = inputs["token_lora"] < 0
    assert none.any() and (~none).any()
    y = layer(inputs, schedule=schedule, join=join)
    base = layer({n: v for n, v in inputs.items() if "lora" not in n} | dict(token_lora=inputs["token_lora"]))
    assert torch.equal(y[none], base[none])
    assert not torch.equal(y[~none], base[~none])          # the adapters do add something


@pytest.mark.parametrize("schedule", SERVING)
def test_nan_in_an_unused_adapter_slot_does_not_leak(device, schedule):
    inputs, _ = problem(device, no_adapter_fraction=0.2, seed=6)
    inputs["token_lora"] = inputs["token_lora"].clamp(max=1)            # slot 2 unused
    y = layer(inputs, schedule=schedule)
    for name in ("w13_lora_a", "w13_lora_b", "w2_lora_a", "w2_lora_b"):
        inputs[name] = [t.clone().index_fill_(0, torch.tensor([2], device=t.device), float("nan"))
                        for t in inputs[name]]
    assert torch.equal(layer(inputs, schedule=schedule), y)


def test_base_gemm_dispatches_on_the_weight(device):
    """base_gemm: a tensor runs the bf16 GEMM as it is, an FP8Weight the FP8 one on quantized rows."""
    inputs, q = problem(device, seed=7)
    plan = ml.plan_layer(inputs["topk_ids"], inputs["token_lora"], 4, None, None)
    P, x = inputs["topk_ids"].numel(), inputs["x"]
    w = q.w13.dequantize()
    fp8 = base_gemm(x, q.w13, plan.base_blocks, poisoned((P, 64), x.dtype, device), top_k=2, tiles=plan.tiles)
    plain = base_gemm(x, w, plan.base_blocks, poisoned((P, 64), x.dtype, device), top_k=2, tiles=plan.tiles)
    want = ml.quant.quantize_dequantize_activation(x).repeat_interleave(2, 0)
    want = torch.stack([w[e] @ row for e, row in zip(inputs["topk_ids"].reshape(-1).tolist(), want)])
    torch.testing.assert_close(fp8, want, rtol=1e-5, atol=1e-5)
    assert float((plain - fp8).abs().max()) > 1e-3 * float(want.abs().max())


# ---- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", REFUSING)
def test_schedules_that_cannot_run_a_quantized_base_refuse_by_name(schedule):
    inputs, _ = problem("cpu", seed=8)
    with pytest.raises(ValueError, match=rf"^schedule='{schedule}': cannot run on a quantized \(FP8\) base: .*"
                                         r"use schedule='auto' or one of 'sequential', 'dual_stream'"):
        layer(inputs, schedule=schedule)
    no_lora = {n: v for n, v in inputs.items() if "lora" not in n} | dict(token_lora=inputs["token_lora"])
    with pytest.raises(ValueError, match=rf"^schedule='{schedule}': cannot run on a quantized"):
        layer(no_lora, schedule=schedule)                         # refused with or without LoRA


def test_an_in_k_pack_with_a_quantized_base_is_refused():
    inputs, _ = problem("cpu", seed=8)
    p = ml.make_problem(SMALL, ml.LoRAShape(3, 8), 11, seed=8).layer_inputs()
    pack = pack_in_k(p["w13"], p["w2"], p["w13_lora_b"], p["w2_lora_b"])
    with pytest.raises(ValueError, match=r"^in_k: a pack widens W .* drop in_k"):
        layer(inputs, in_k=pack)


def test_auto_never_picks_in_k_for_a_quantized_base():
    big = IN_K_MIN_PAIRS_PER_EXPERT * 8
    assert gpu_schedule(big, 8, in_k_columns=32) == "in_k"                  # the rule would pick it ...
    assert gpu_schedule(big, 8, in_k_columns=32, quantized=True) == "dual_stream"     # ... but not for FP8
    assert resolve_schedule("auto", torch.device("cpu"), num_pairs=big, num_experts=8, num_loras=4, rank=8,
                            in_k_columns=32, quantized=True) == "sequential"
    with pytest.raises(ValueError, match=r"^schedule='in_k': cannot run on a quantized"):
        resolve_schedule("in_k", torch.device("cpu"), num_loras=4, rank=8, in_k_columns=32, quantized=True)


@pytest.mark.parametrize("what", ["x", "lora"])
def test_a_backward_through_a_quantized_base_is_refused(device, what):
    inputs, _ = problem(device, seed=9)
    y0 = layer(inputs)
    leaf = inputs["x"] if what == "x" else inputs["w2_lora_b"][0]
    leaf.requires_grad_(True)
    y = layer(inputs)                                               # the forward serves inference as it is
    assert y.requires_grad and torch.equal(y.detach(), y0)
    with pytest.raises(ValueError, match=r"^w13, w2: the base is quantized \(FP8Weight\), and the layer has no "
                                         r"backward"):
        y.sum().backward()


def test_a_mixed_base_is_refused_by_name():
    inputs, q = problem("cpu", seed=10)
    w2 = q.w2.dequantize()
    with pytest.raises(TypeError, match=r"^w13, w2: w13 is an FP8Weight but w2 is a Tensor; pass both quantized"):
        layer(inputs | dict(w2=w2))
    with pytest.raises(TypeError, match=r"^w13, w2: w2 is an FP8Weight but w13 is a Tensor"):
        layer(inputs | dict(w13=q.w13.dequantize(), w2=q.w2))


def test_bad_inputs_on_a_quantized_base_name_the_argument():
    inputs, q = problem("cpu", seed=11)
    other, _ = problem("cpu", ml.MoEShape(96, 32, 4, 2), seed=11)
    with pytest.raises(ValueError, match=r"^x: has 64 features but w13 expects H=96"):
        layer(inputs | dict(w13=other["w13"], w2=other["w2"]))
    with pytest.raises(ValueError, match=r"^w2: expected shape \(4, 64, 32\)"):
        layer(inputs | dict(w2=FP8Weight(q.w2.data[:3], q.w2.scale[:3], q.w2.block_size)))
    with pytest.raises(TypeError, match=r"^x: dtype torch.float64 is not supported"):
        layer(inputs | dict(x=inputs["x"].double()))
    with pytest.raises(TypeError, match=r"^w13_lora_a\[0\]: dtype torch.float16 must equal x's dtype torch.float32"):
        layer(inputs | dict(w13_lora_a=[t.half() for t in inputs["w13_lora_a"]]))
    if ml.INTERPRET:                                  # bf16 x: accepted by the checks, refused by the interpreter
        lora16 = {n: [t.bfloat16() for t in inputs[n]] for n in ("w13_lora_a", "w13_lora_b", "w2_lora_a", "w2_lora_b")}
        with pytest.raises(TypeError, match=r"^x: bfloat16 is mis-computed by the Triton interpreter"):
            layer(inputs | dict(x=inputs["x"].bfloat16(), **lora16))


def test_the_distributed_layers_refuse_a_quantized_base_on_every_rank():
    """Rank 1 alone holds an FP8 base: both ranks raise the same TypeError naming it, before any exchange."""
    if not ml.INTERPRET:
        pytest.skip("the gloo processes run the kernels on CPU tensors, under the Triton interpreter")
    for name, errors in (("ep", run_local(fp8_rank, 2, "ep")), ("tp", run_local(fp8_rank, 2, "tp"))):
        assert [e[0] for e in errors] == ["TypeError", "TypeError"] and errors[0][1] == errors[1][1], name
        assert errors[0][1].startswith(f"rank 1: local['w13']: an FP8Weight (a quantized base), which {name}_layer "
                                       "does not run"), errors[0][1]


def fp8_rank(rank: int, world: int, which: str):
    """One rank of the test above: (the error's type, its message) or None."""
    from moelora_lab.dist import ep_layer
    from moelora_lab.dist.tp import tp_layer
    p = ml.make_problem("tiny", ml.LoRAShape(2, 4), 4, seed=0)
    weights = {n: v for n, v in p.layer_inputs().items() if n.startswith(("w13", "w2"))}
    part = ExpertPartition(p.shape.num_experts, world)
    local = part.shard(weights, rank) if which == "ep" else shard_tp(weights, rank, world, fully_sharded=False)
    if rank == 1:
        q = quantize_experts(local["w13"], local["w2"], None)
        local = dict(local, w13=q.w13, w2=q.w2)
    try:
        if which == "ep":
            ep_layer(p.x, p.topk_ids, p.topk_weights, p.token_lora, local, part)
        else:
            tp_layer(p.x, p.topk_ids, p.topk_weights, p.token_lora, local, fully_sharded=False)
    except Exception as e:                               # the test compares every rank's
        return type(e).__name__, str(e)
    return None
