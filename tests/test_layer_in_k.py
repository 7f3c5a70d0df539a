"""w2's LoRA in K: the layer's output as the reference computes it, its kernels alone, its checks."""
import pytest
import torch

import moelora_lab as ml
from moelora_lab.layer import plan_layer
from moelora_lab.layer_in_k import _shrink_tail, pack_w2_in_k, w2_in_k_layer
from utils import assert_close, poisoned

SHAPE = ml.MoEShape(48, 40, 6, 2, "in-k-test")        # I = 40: not a multiple of the blocks


def problem(device, dtype=torch.float32, M=9, rank=8, seed=1, **kw):
    return ml.make_problem(SHAPE, ml.LoRAShape(3, rank), M, dtype=dtype, device=device, seed=seed, **kw)


def run(p, **kw):
    inputs = p.layer_inputs()
    w2_ext = pack_w2_in_k(inputs["w2"], inputs["w2_lora_b"])
    args = {n: inputs[n] for n in ("x", "topk_ids", "topk_weights", "token_lora", "w13", "w13_lora_a", "w13_lora_b",
                                   "w2_lora_a")}
    return w2_in_k_layer(**args, w2_ext=w2_ext, **kw)


def dtypes(device):
    return [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])


@pytest.mark.parametrize("rank, M, kw", [(8, 9, dict(no_adapter_fraction=0.3)), (5, 20, {}), (16, 1, {}),
                                         (8, 33, dict(no_adapter_fraction=1.0))])
def test_layer_matches_reference(device, rank, M, kw):
    """Rank not a power of two, a single token, tokens without an adapter, no adapter at all."""
    for dtype in dtypes(device):
        p = problem(device, dtype, M=M, rank=rank, seed=rank + M, **kw)
        assert_close(run(p), ml.moe_layer_reference(**p.layer_inputs()), dtype)


def test_actual_adapter_ranks_and_a_plan(device):
    p = problem(device, rank=16, seed=13, adapter_ranks=(3, 16, 5), no_adapter_fraction=0.3)
    ranks = torch.tensor(p.adapter_ranks, device=device)
    plan = plan_layer(p.topk_ids, p.token_lora, SHAPE.num_experts, 3, 16, schedule="sequential")
    assert_close(run(p, plan=plan, lora_ranks=ranks), ml.moe_layer_reference(**p.layer_inputs()), torch.float32)
    fused = plan_layer(p.topk_ids, p.token_lora, SHAPE.num_experts, 3, 16, schedule="epilogue")
    with pytest.raises(ValueError, match="plan: made for an in-GEMM schedule"):
        run(p, plan=fused)


def test_pack_places_every_slot_after_w2(device):
    p = problem(device)
    w2, b = p.w2, p.w2_lora_b[0]                                          # [E, H, I], [L, E, H, r]
    ext = pack_w2_in_k(w2, p.w2_lora_b)
    I, r = w2.shape[2], b.shape[3]
    assert ext.shape == (6, 48, 40 + 3 * 8) and ext.is_contiguous()
    assert torch.equal(ext[:, :, :I], w2)
    for slot in range(3):
        assert torch.equal(ext[:, :, I + slot * r:I + (slot + 1) * r], b[slot])


def test_one_launch_writes_the_whole_tail(device):
    """Every tail element is written (poisoned first): each pair's shrink in its slot's first r_l
    columns, zeros everywhere else (the other slots, ranks past r_l, pairs without an adapter)."""
    p = problem(device, rank=8, seed=5, adapter_ranks=(3, 8, 5), no_adapter_fraction=0.3)
    M, k = p.topk_ids.shape
    I, L, r = SHAPE.intermediate, 3, 8
    plan = plan_layer(p.topk_ids, p.token_lora, SHAPE.num_experts, L, r, schedule="sequential")
    h = torch.randn(M * k, I, device=device)
    h_ext = torch.cat([h, poisoned((M * k, L * r), torch.float32, device)], dim=1)
    ranks = torch.tensor(p.adapter_ranks, device=device, dtype=torch.int32)
    _shrink_tail(h_ext, p.w2_lora_a[0], plan, p.token_lora.to(torch.int32), k, SHAPE.hidden, I, r, ranks)
    want = torch.zeros(M * k, L * r, device=device)
    slot = p.token_lora.repeat_interleave(k)
    expert = p.topk_ids.reshape(-1)
    for pair in range(M * k):
        if slot[pair] >= 0:
            s, rl = int(slot[pair]), p.adapter_ranks[int(slot[pair])]
            want[pair, s * r:s * r + rl] = p.w2_lora_a[0][s, expert[pair], :rl] @ h[pair]
    assert torch.equal(h_ext[:, :I], h)
    assert_close(h_ext[:, I:], want, torch.float32)


def test_bad_inputs_name_the_argument(device):
    p = problem(device)
    inputs = p.layer_inputs()
    args = {n: inputs[n] for n in ("x", "topk_ids", "topk_weights", "token_lora", "w13", "w13_lora_a", "w13_lora_b",
                                   "w2_lora_a")}
    with pytest.raises(ValueError, match=r"w2_ext: expected a contiguous \[E, H, I \+ L\*r\] = \[6, 48, 64\].*"
                                         "pack_w2_in_k"):
        w2_in_k_layer(**args, w2_ext=inputs["w2"])                       # the base weight, not packed
    with pytest.raises(TypeError, match="w2_lora_b: expected a list of one tensor"):
        pack_w2_in_k(inputs["w2"], inputs["w2_lora_b"][0])
    with pytest.raises(ValueError, match=r"w2_lora_b\[0\]: expected \[L, 6, 48, r\]"):
        pack_w2_in_k(inputs["w2"], [inputs["w13_lora_b"][0]])
    if device == "cpu":
        with pytest.raises(ValueError, match="dual: True needs CUDA streams"):
            run(p, dual=True)
