"""w2's LoRA in K: the layer's output as the reference computes it, its kernels alone, its checks."""
import pytest
import torch

import moelora_lab as ml
import triton
from moelora_lab.kernels.in_k import act_tail_kernel
from moelora_lab.layer import plan_layer
from moelora_lab.layer_in_k import pack_w2_in_k, w2_in_k_layer
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


def test_activation_writes_h_and_a_zero_tail(device):
    """Every element of h_ext is written (poisoned first): h where the activation is, zeros after it."""
    P, I, W = 7, 40, 64
    c1 = torch.randn(P, 2 * I, device=device)
    h_ext = poisoned((P, W), torch.float32, device)
    token_lora = torch.zeros(P, dtype=torch.int32, device=device)
    act_tail_kernel[(P, triton.cdiv(W, 32))](c1, c1, token_lora, h_ext, 1, I, W, c1.stride(0), 0, W, BLOCK=32,
                                             HAS_DELTA=False)
    gate, up = c1[:, :I], c1[:, I:]
    assert_close(h_ext[:, :I], torch.nn.functional.silu(gate) * up, torch.float32)
    assert torch.equal(h_ext[:, I:], torch.zeros(P, W - I, device=device))


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
