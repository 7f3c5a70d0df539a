"""The ``in_join`` schedule (the LoRA inside the activation and the top-k sum) against the reference."""
import pytest
import torch

import moelora_lab as ml
from moelora_lab.layer import moe_lora_layer, plan_layer
from moelora_lab.experiments.in_join import act_lora, join_block, sum_lora
from utils import assert_close, check_layer_schedule, poisoned, shrink_spec

SHAPE = ml.MoEShape(48, 40, 6, 2, "layer-test")      # H = 48, I = 40: neither a multiple of the join's tiles


def problem(device, dtype=torch.float32, M=9, seed=1, rank=8, **kw):
    return ml.make_problem(SHAPE, ml.LoRAShape(3, rank), M, dtype=dtype, device=device, seed=seed, **kw)


def nan_past_ranks(inputs, ranks):
    """A and B with NaN past each slot's rank: a read of a rank the slot does not have poisons the output."""
    out = dict(inputs)
    for name, axis in (("w13_lora_a", 2), ("w2_lora_a", 2), ("w13_lora_b", 3), ("w2_lora_b", 3)):
        slices = []
        for w in inputs[name]:
            w = w.clone()
            for slot, r in enumerate(ranks):
                w[slot].narrow(axis - 1, r, w.shape[axis] - r).fill_(float("nan"))
            slices.append(w)
        out[name] = slices
    return out


@pytest.mark.parametrize("rank, M, kw", [(8, 9, dict(no_adapter_fraction=0.3)), (5, 20, {}), (16, 1, {}),
                                         (48, 7, dict(expert_skew=2.0))])
def test_in_join_layer_matches_reference(device, rank, M, kw):
    """Ranks 8, 5 (not a power of two), 16 and 48; tokens without an adapter; experts left empty by skew."""
    check_layer_schedule(device, "in_join", SHAPE, rank, M, rank + M + 2, **kw)


def test_in_join_reads_no_rank_past_a_slot_and_skips_disabled_slots(device):
    """Per-slot ranks 3, 0 (a disabled adapter) and 5 of 8, with NaN past them in every A and B."""
    p = problem(device, rank=8, seed=21, adapter_ranks=(3, 0, 5), no_adapter_fraction=0.2, adapter_popularity="distinct")
    assert set(p.token_lora.tolist()) >= {0, 1, 2}
    ranks = torch.tensor(p.adapter_ranks, device=device)
    ref = ml.moe_layer_reference(**p.layer_inputs())
    plan = plan_layer(p.topk_ids, p.token_lora, SHAPE.num_experts, 3, 8, schedule="in_join")
    assert plan.lora_path == "two_kernel" and plan.lora_blocks is not None
    out = moe_lora_layer(**nan_past_ranks(p.layer_inputs(), p.adapter_ranks), lora_ranks=ranks, schedule="in_join",
                         plan=plan)
    assert_close(out, ref, torch.float32)


def test_join_kernels_write_every_output_and_read_only_what_the_shrinks_wrote(device):
    """act_lora and sum_lora alone, against torch: T1 is NaN wherever the shrink writes nothing, h and y
    start as NaN, so an unwritten output or a read of an unwritten T1 row fails."""
    p = problem(device, M=11, rank=6, seed=5, no_adapter_fraction=0.4)
    inputs = p.layer_inputs()
    M, k = p.topk_ids.shape
    P, I, H = M * k, SHAPE.intermediate, SHAPE.hidden
    ranks = [6, 6, 6]
    t1 = shrink_spec(p, p.x, inputs["w13_lora_a"], ranks)
    assert torch.isnan(t1).any() and not torch.isnan(t1).all()
    c1 = torch.randn(P, 2 * I, device=device)
    ids, lora = p.topk_ids.reshape(-1), p.token_lora.to(torch.int32)
    h = poisoned((P, I), torch.float32, device)
    t2 = act_lora(c1, t1, inputs["w13_lora_b"], inputs["w2_lora_a"], ids, lora, None, h)
    pair_lora = lora.long().repeat_interleave(k)
    has = pair_lora >= 0
    bg, bu = (b[pair_lora.clamp(min=0), ids.long()] for b in inputs["w13_lora_b"])        # [P, I, r]
    t1z = torch.nan_to_num(t1)
    gate = c1[:, :I] + torch.where(has[:, None], torch.einsum("pir,pr->pi", bg, t1z[0]), 0)
    up = c1[:, I:] + torch.where(has[:, None], torch.einsum("pir,pr->pi", bu, t1z[1]), 0)
    h_ref = torch.nn.functional.silu(gate) * up
    assert_close(h, h_ref, torch.float32)
    a2 = inputs["w2_lora_a"][0][pair_lora.clamp(min=0), ids.long()]                        # [P, r, I]
    assert t2.shape == (P, -(-I // join_block(I, 8)), 6)
    assert_close(t2[has].sum(1), torch.einsum("pri,pi->pr", a2, h_ref)[has], torch.float32)
    c3 = torch.randn(P, H, device=device)
    w = p.topk_weights.reshape(-1).float()
    y = sum_lora(c3, t2, inputs["w2_lora_b"], ids, w, lora, None, poisoned((M, H), torch.float32, device))
    b2 = inputs["w2_lora_b"][0][pair_lora.clamp(min=0), ids.long()]                        # [P, H, r]
    d2 = torch.where(has[:, None], w[:, None] * torch.einsum("phr,pr->ph", b2, torch.nan_to_num(t2.sum(1))), 0)
    assert_close(y, (c3 + d2).view(M, k, H).sum(1), torch.float32)


def test_join_block_keeps_the_weight_tile_small():
    assert [join_block(768, r) for r in (16, 64, 256, 512)] == [128, 64, 16, 16]
    assert join_block(40, 8) == 64 and join_block(8, 8) == 16 and join_block(768, 16, 64) == 64


@pytest.mark.parametrize("block", [16, 32])
def test_act_lora_with_given_tiles_and_its_errors(device, block):
    """The activation with the probe's tiles gives the same h and T2 sums as the rule's; bad tiles are refused."""
    p = problem(device, M=5, rank=8, seed=8)
    inputs = p.layer_inputs()
    P, I = 5 * SHAPE.top_k, SHAPE.intermediate
    t1 = torch.randn(2, P, 8, device=device)
    c1 = torch.randn(P, 2 * I, device=device)
    args = (c1, t1, inputs["w13_lora_b"], inputs["w2_lora_a"], p.topk_ids.reshape(-1), p.token_lora.to(torch.int32),
            None)
    h_rule, h = poisoned((P, I), torch.float32, device), poisoned((P, I), torch.float32, device)
    t2_rule = act_lora(*args, h_rule)
    t2 = act_lora(*args, h, block=block, num_warps=1)
    assert t2.shape[1] == -(-I // block) != t2_rule.shape[1]
    assert_close(h, h_rule, torch.float32)
    has = p.token_lora.repeat_interleave(SHAPE.top_k) >= 0
    assert_close(t2[has].sum(1), t2_rule[has].sum(1), torch.float32)
    for bad in (8, 48, 32.0):
        with pytest.raises(ValueError, match="block: expected a power of two >= 16"):
            act_lora(*args, h, block=bad)


def test_in_join_refuses_what_it_cannot_mean(device):
    p = problem(device, seed=3)
    with pytest.raises(ValueError, match="join: 'vllm' has no meaning with schedule='in_join'"):
        moe_lora_layer(**p.layer_inputs(), schedule="in_join", join="vllm")
    with pytest.raises(ValueError, match="lora_path: 'one_shot' has no meaning with schedule='in_join'"):
        moe_lora_layer(**p.layer_inputs(), schedule="in_join", lora_path="one_shot")
    fused = plan_layer(p.topk_ids, p.token_lora, SHAPE.num_experts, 3, 8, schedule="fused")
    with pytest.raises(TypeError, match="plan: made for another schedule"):
        moe_lora_layer(**p.layer_inputs(), schedule="in_join", plan=fused)


@pytest.mark.gpu
def test_in_join_under_cuda_graphs_equals_eager_and_is_race_free():
    p = ml.make_problem("qwen3-30b-a3b", ml.LoRAShape(4, 16), 16, dtype=torch.bfloat16, device="cuda", seed=9)
    eager = moe_lora_layer(**p.layer_inputs(), schedule="in_join")
    assert_close(eager, ml.moe_layer_reference(**p.layer_inputs()), torch.bfloat16)
    for _ in range(50):
        assert torch.equal(moe_lora_layer(**p.layer_inputs(), schedule="in_join"), eager)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe_lora_layer(**p.layer_inputs(), schedule="in_join")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_lora_layer(**p.layer_inputs(), schedule="in_join")
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


def test_in_join_with_many_column_tiles(device, monkeypatch):
    """Small tiles: the activation runs 3 column tiles of 16 and the sum reads their T2 parts 2 at a time."""
    import moelora_lab.experiments.in_join as lij
    monkeypatch.setattr(lij, "TILE_ELEMENTS", 32)
    assert lij.join_block(SHAPE.intermediate, 8) == 16
    p = problem(device, rank=8, seed=31, no_adapter_fraction=0.3)
    assert_close(moe_lora_layer(**p.layer_inputs(), schedule="in_join"), ml.moe_layer_reference(**p.layer_inputs()),
                 torch.float32)
