"""Hand-counted checks of the analytic traffic model (moelora_lab.profile.traffic)."""
from types import SimpleNamespace

import pytest
import torch

from moelora_lab.profile import Traffic, Workload, count_workload, layer_traffic, lora_op_traffic

# Shared case: M=2 tokens, k=2, E=4 experts, L=2 adapters, both tokens on adapter 0.
# Pairs (adapter, expert): (0,0) (0,1) | (0,1) (0,2)  -> P=4, distinct (adapter, expert)=3,
# distinct experts {0,1,2}=3.
TOPK = torch.tensor([[0, 1], [1, 2]])
LORA = torch.tensor([0, 0])
# Op sizes: K=8, N=4, r=2, S=2, b=2 bytes.
OP = dict(in_features=8, out_features=4, num_slices=2, rank=2)


@pytest.fixture
def wl() -> Workload:
    return count_workload(TOPK, LORA, num_experts=4, num_loras=2)


def test_count_workload_shared_pair(wl):
    assert wl == Workload(num_tokens=2, top_k=2, tokens_with_adapter=2, pairs_with_adapter=4,
                          touched_adapter_experts=3, touched_experts=3)


def test_count_workload_no_adapter_and_repeats():
    # token 1 has no adapter: its experts (1, 2) count for touched_experts only.
    # adapter pairs: (0,0) (0,1) (1,3) (1,0) -> 4 distinct; experts {0,1,2,3} -> 4.
    w = count_workload(torch.tensor([[0, 1], [1, 2], [3, 0]]), torch.tensor([0, -1, 1]), 4, 2)
    assert (w.tokens_with_adapter, w.pairs_with_adapter) == (2, 4)
    assert (w.touched_adapter_experts, w.touched_experts) == (4, 4)
    # every pair on expert 2 with adapter 1: one (adapter, expert), one expert, P = 4.
    w = count_workload(torch.tensor([[2, 2], [2, 2]], dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32), 4, 2)
    assert (w.pairs_with_adapter, w.touched_adapter_experts, w.touched_experts) == (4, 1, 1)
    # no token has an adapter: nothing LoRA-touched, but expert 3 is still used by the base layer.
    w = count_workload(torch.tensor([[3], [3]]), torch.tensor([-1, -1]), 4, 2)
    assert (w.tokens_with_adapter, w.pairs_with_adapter, w.touched_adapter_experts, w.touched_experts) == (0, 0, 0, 1)


def test_count_workload_errors():
    with pytest.raises(ValueError, match=r"topk_ids: value 4 is out of range; accepted values are 0 \.\. 3"):
        count_workload(torch.tensor([[0, 4]]), torch.tensor([0]), 4, 2)
    with pytest.raises(ValueError, match=r"token_lora: value 2 is out of range; accepted values are -1 \.\. 1"):
        count_workload(TOPK, torch.tensor([0, 2]), 4, 2)
    with pytest.raises(ValueError, match=r"token_lora: expected shape \(2,\)"):
        count_workload(TOPK, torch.tensor([0, 0, 0]), 4, 2)
    with pytest.raises(TypeError, match="topk_ids: dtype torch.float32 is not supported"):
        count_workload(TOPK.float(), LORA, 4, 2)
    with pytest.raises(ValueError, match="num_experts: must be >= 1, got 0"):
        count_workload(TOPK, LORA, 0, 2)


def test_workload_dense():
    # E=4, d=M*k=2: 4*(1-(3/4)^2) = 1.75 -> 2; E*L=8: 8*(1-(7/8)^2) = 1.875 -> 2.
    w = Workload.dense(1, 2, 4, 2)
    assert w == Workload(1, 2, 1, 2, 2, 2)
    # E=8, d=64: 8*(1-(7/8)^64) = 7.9989 -> 8; E*L=32: 32*(1-(31/32)^64) = 27.79 -> 28.
    w = Workload.dense(32, 2, 8, 4)
    assert (w.pairs_with_adapter, w.touched_experts, w.touched_adapter_experts) == (64, 8, 28)
    for m, k, e, n_l in [(0, 1, 1, 1), (1, 1, 64, 8), (3, 2, 16, 4), (4096, 8, 128, 16)]:
        w = Workload.dense(m, k, e, n_l)
        assert w.touched_experts <= min(e, m * k)
        assert w.touched_adapter_experts <= min(e * n_l, m * k)
    with pytest.raises(ValueError, match="top_k: must be <= 4, got 5"):
        Workload.dense(2, 5, 4, 2)


def test_workload_validation():
    with pytest.raises(ValueError, match="tokens_with_adapter: must be <= 2, got 3"):
        Workload(2, 2, 3, 4, 1, 1)
    with pytest.raises(ValueError, match="touched_adapter_experts: must be <= 4, got 5"):
        Workload(2, 2, 2, 4, 5, 1)
    with pytest.raises(TypeError, match="num_tokens: expected an int, got float"):
        Workload(2.0, 2, 2, 4, 1, 1)


def test_one_shot(wl):
    t = lora_op_traffic("one_shot", wl, **OP)
    # x: X=2 tokens * K=8 * 2 B = 32
    # W1 = S*r*K + S*N*r = 32 + 16 = 48 elements; 3 touched (adapter, expert): A 3*32*2=192, B 3*16*2=96
    # out: P*S*N*b = 4*2*4*2 = 64 written, 64 read (add_inputs)
    assert (t.part("x"), t.part("lora_a"), t.part("lora_b")) == (32, 192, 96)
    assert (t.part("out_read"), t.part("out_write")) == (64, 64)
    assert (t.bytes_read, t.bytes_written, t.bytes) == (384, 64, 448)
    # 2*P*S*r*(K+N) = 2*4*2*2*12 = 384, + P*S*N = 32
    assert (t.flops, t.launches) == (416, 1)
    assert t.intensity == pytest.approx(416 / 448)


def test_two_kernel_and_difference(wl):
    t = lora_op_traffic("two_kernel", wl, **OP)
    # T [S, M*k, r] is allocated uninitialised (no fill): shrink writes P*S*r*b = 4*2*2*2 = 32, expand reads 32.
    assert (t.part("intermediate_write"), t.part("intermediate_read")) == (32, 32)
    assert "intermediate_zero" not in dict(t.parts)
    # reads: one-shot's 384 + T 32 = 416; writes: out 64 + T 32 = 96; shrink + expand: 2 launches
    assert (t.bytes_read, t.bytes_written, t.flops, t.launches) == (416, 96, 416, 2)
    one = lora_op_traffic("one_shot", wl, **OP)
    assert t.bytes - one.bytes == 64
    # fp32 intermediate: 4*2*2*4 = 64 written, 64 read
    t32 = lora_op_traffic("two_kernel", wl, **OP, intermediate_bytes=4)
    assert (t32.part("intermediate_write"), t32.part("intermediate_read")) == (64, 64)
    assert t32.bytes - one.bytes == 128


def test_two_kernel_moves_only_the_rows_of_pairs_with_an_adapter():
    # M=3, k=2, token 1 has no adapter -> P=4, adapter pairs (0,0) (0,1) (1,3) (1,0): 4 distinct.
    w = count_workload(torch.tensor([[0, 1], [1, 2], [3, 0]]), torch.tensor([0, -1, 1]), 4, 2)
    t = lora_op_traffic("two_kernel", w, **OP)
    # T has S*M*k = 2*3*2 = 12 rows, but only the P*S = 8 rows of pairs with an adapter move:
    # shrink writes / expand reads 4*2*2*2 = 32 each (the 2*2*2*2 = 16 B of token 1's rows never move)
    assert (t.part("intermediate_write"), t.part("intermediate_read")) == (32, 32)
    assert t.bytes - lora_op_traffic("one_shot", w, **OP).bytes == 64
    # one_shot: x 2*8*2=32 + weights 4*48*2=384 + out 4*2*4*2=64 read + 64 written = 544
    assert lora_op_traffic("one_shot", w, **OP).bytes == 544
    assert t.bytes == 608 and t.launches == 2


def test_small_batch_and_naive(wl):
    sb = lora_op_traffic("small_batch", wl, **OP)
    # weights per pair: P*W1*b = 4*48*2 = 384 (A 4*32*2=256, B 4*16*2=128)
    assert (sb.part("lora_a"), sb.part("lora_b")) == (256, 128)
    assert (sb.bytes_read, sb.bytes_written, sb.launches) == (32 + 384 + 64, 64, 1)
    # (0, 1) is shared by two pairs, so per-pair weight reads exceed the one-shot reads by 1*48*2 = 96
    assert sb.bytes - lora_op_traffic("one_shot", wl, **OP).bytes == 96
    nv = lora_op_traffic("gather_bmm", wl, **OP)
    # reads: x 32 + gather 384 + copy read 384 + fp32 intermediate 4*2*2*4 = 64 + out 64 = 928
    # writes: copy 384 + intermediate 64 + out 64 = 512; launches 4*S + 1 = 9
    assert (nv.bytes_read, nv.bytes_written, nv.flops, nv.launches) == (928, 512, 416, 9)
    assert nv.part("lora_a_copy_write") == 256


def test_x_rows_pair_and_no_add(wl):
    t = lora_op_traffic("one_shot", wl, **OP, x_rows="pair", add_inputs=False, dtype_bytes=4)
    # x: P=4 rows * 8 * 4 B = 128; weights 3*48*4 = 576; out written 4*2*4*4 = 128, not read
    assert (t.part("x"), t.bytes_read, t.bytes_written) == (128, 704, 128)
    assert t.flops == 384 and t.part("out_read") == 0


def test_traffic_add_and_floor():
    a = Traffic(10, 5, 100, 1, (("x", 10), ("y", 5)))
    b = Traffic(1, 2, 3, 2, (("y", 2), ("z", 1)))
    c = a + b
    assert c == Traffic(11, 7, 103, 3, (("x", 10), ("y", 7), ("z", 1)))
    assert sum([a, b]) == c
    assert hash(c) == hash(Traffic(11, 7, 103, 3, (("x", 10), ("y", 7), ("z", 1))))
    assert c.floor_us(1e6) == pytest.approx(18.0)  # 18 B at 1 MB/s = 18 us
    assert Traffic(0, 0, 5, 0).intensity == 0.0
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s: must be > 0, got 0"):
        c.floor_us(0)


def test_lora_op_errors(wl):
    with pytest.raises(ValueError, match="path: 'fused' is not one of 'two_kernel', 'one_shot', 'small_batch', 'gather_bmm'"):
        lora_op_traffic("fused", wl, **OP)
    with pytest.raises(ValueError, match="x_rows: 'tokens' is not one of 'token', 'pair'"):
        lora_op_traffic("one_shot", wl, **OP, x_rows="tokens")
    with pytest.raises(ValueError, match="rank: must be >= 1, got -1"):
        lora_op_traffic("one_shot", wl, **{**OP, "rank": -1})
    with pytest.raises(ValueError, match="dtype_bytes: must be >= 1, got 0"):
        lora_op_traffic("one_shot", wl, **OP, dtype_bytes=0)
    with pytest.raises(TypeError, match="add_inputs: expected a bool, got int 1"):
        lora_op_traffic("one_shot", wl, **OP, add_inputs=1)
    with pytest.raises(TypeError, match="workload: expected a Workload"):
        lora_op_traffic("one_shot", (2, 2), **OP)


SHAPE = SimpleNamespace(hidden=8, intermediate=4, num_experts=4, top_k=2)


def test_layer_traffic(wl):
    st = layer_traffic(SHAPE, 2, wl)
    assert list(st) == ["base_w13", "lora_w13", "act", "base_w2", "lora_w2", "sum", "total", "floor"]
    # The LoRA stages write their deltas (no read of the output: add_inputs False); the activation
    # and the top-k sum read them back for the P_a = 4 pairs with an adapter.
    # base_w13: x 2*8*2=32 + w13 3*(2*4)*8*2=384 + c1 2*2*8*2=64 -> 480
    # lora_w13: the one-shot op above less its output read 4*2*4*2=64 -> 384
    # act: read c1 64 + d13 4*8*2=64, write h 2*2*4*2=32 -> 160
    # base_w2: h 32 + w2 3*8*4*2=192 + c3 2*2*8*2=64 -> 288
    # lora_w2: x pairs 4*4*2=32; W1=1*2*4+1*8*2=24, 3*24*2=144; d2 written 4*8*2=64 -> 240
    # sum: read c3 64 + d2 4*8*2=64, write y 2*8*2=32 -> 160
    bytes_ = {name: st[name].bytes for name in st}
    assert bytes_ == {"base_w13": 480, "lora_w13": 384, "act": 160, "base_w2": 288, "lora_w2": 240,
                      "sum": 160, "total": 1712, "floor": 1072}
    assert dict(st["act"].parts)["d13"] == 64 and dict(st["sum"].parts)["d2"] == 64
    stages = [st[n] for n in ["base_w13", "lora_w13", "act", "base_w2", "lora_w2", "sum"]]
    assert st["total"] == sum(stages)
    # floor: x 32 + base 3*(8*8 + 8*4)*2 = 576 + LoRA 3*(48+24)*2 = 432 + y 32 = 1072
    assert st["floor"].bytes <= st["total"].bytes
    assert st["floor"].flops == st["total"].flops
    # flops: 2*2*2*8*8=512, 416-32=384, 5*2*2*4+4*8=112, 2*2*2*8*4+2*2*8=288, lora_w2 2*4*1*2*12=192,
    # 2*1*8+4*8=48
    assert st["total"].flops == 512 + 384 + 112 + 288 + 192 + 48


def test_layer_traffic_without_lora_and_errors(wl):
    st = layer_traffic(SHAPE, 2, wl, with_lora=False)
    assert list(st) == ["base_w13", "act", "base_w2", "sum", "total", "floor"]
    # 480 + 96 + 288 + 96 = 960; floor 32 + 576 + 32 = 640
    assert (st["total"].bytes, st["floor"].bytes) == (960, 640)
    nv = layer_traffic(SHAPE, 2, wl, lora_path="gather_bmm")
    assert nv["lora_w13"] == lora_op_traffic("gather_bmm", wl, **dict(OP, add_inputs=False))
    with pytest.raises(ValueError, match="workload: top_k is 2 but shape.top_k is 3"):
        layer_traffic(SimpleNamespace(hidden=8, intermediate=4, num_experts=4, top_k=3), 2, wl)
    with pytest.raises(TypeError, match="shape: expected an object with .*missing 'hidden'"):
        layer_traffic(SimpleNamespace(intermediate=4, num_experts=4, top_k=2), 2, wl)
    with pytest.raises(ValueError, match="lora_path: 'bmm' is not one of"):
        layer_traffic(SHAPE, 2, wl, lora_path="bmm")


def test_layer_traffic_fp8_base(wl):
    """An FP8 base: weights at 1 byte an element + 4 a scale block, each GEMM's input quantized first."""
    st = layer_traffic(SHAPE, 2, wl, base="fp8", fp8_block=(4, 3), fp8_group=3)
    assert list(st) == ["quant_x", "base_w13", "lora_w13", "act", "quant_h", "base_w2", "lora_w2", "sum",
                        "total", "floor"]
    # weights of one expert: w13 [8, 8] 64 + 4*ceil(8/4)*ceil(8/3)=24 -> 88; w2 [8, 4] 32 + 4*2*ceil(4/3)=16 -> 48
    # quant_x: read x 2*8*2=32, write xq 2*8=16 + scales 2*ceil(8/3)*4=24 -> 72
    # base_w13: xq 40 + w13 3*88=264 + c1 64 -> 368
    # quant_h: read h 2*2*4*2=32, write hq 4*4=16 + scales 4*ceil(4/3)*4=32 -> 80
    # base_w2: hq 48 + w2 3*48=144 + c3 64 -> 256; the LoRA stages and the joins as on the bf16 base
    bytes_ = {name: st[name].bytes for name in st}
    assert bytes_ == {"quant_x": 72, "base_w13": 368, "lora_w13": 384, "act": 160, "quant_h": 80,
                      "base_w2": 256, "lora_w2": 240, "sum": 160, "total": 1720, "floor": 904}
    assert dict(st["quant_x"].parts) == {"x": 32, "xq": 40} and dict(st["base_w13"].parts)["xq"] == 40
    assert dict(st["base_w2"].parts) == {"hq": 48, "w2": 144, "c3": 64}
    # floor: x read once in its dtype 32 + base 3*(88+48)=408 + LoRA 432 + y 32
    assert dict(st["floor"].parts) == {"x": 32, "base_weights": 408, "lora_weights": 432, "y": 32}
    # FLOPs: the bf16 base's 1536 + the quantizations' 2 per element (2*8*2 + 2*4*4)
    assert st["total"].flops == st["floor"].flops == 1536 + 32 + 32
    assert st["total"].launches == layer_traffic(SHAPE, 2, wl)["total"].launches + 2


def test_layer_traffic_fp8_default_blocks_and_errors(wl):
    # (128, 128) blocks and groups of 128: one scale per expert weight and per row here
    st = layer_traffic(SHAPE, 2, wl, with_lora=False, base="fp8")
    # quant_x 32 + 2*(8+4)=24; base_w13 24 + 3*(64+4) + 64; quant_h 32 + 4*(4+4)=32; base_w2 32 + 3*(32+4) + 64;
    # act 96, sum 96
    assert st["total"].bytes == 56 + 292 + 64 + 204 + 96 + 96
    assert st["floor"].bytes == 32 + 3 * (68 + 36) + 32
    assert layer_traffic(SHAPE, 2, wl, base="dtype") == layer_traffic(SHAPE, 2, wl)   # the default: unchanged
    with pytest.raises(ValueError, match="base: 'int8' is not one of"):
        layer_traffic(SHAPE, 2, wl, base="int8")
    with pytest.raises(TypeError, match=r"fp8_block: expected a pair \(BN, BK\)"):
        layer_traffic(SHAPE, 2, wl, base="fp8", fp8_block=128)
    with pytest.raises(ValueError, match="fp8_group"):
        layer_traffic(SHAPE, 2, wl, base="fp8", fp8_group=0)
