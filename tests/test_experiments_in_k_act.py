"""The ``in_k_act`` schedule (``in_k`` with the activation in the w13 GEMM's epilogue) and its kernel."""
import pytest
import torch

import moelora_lab as ml
from moelora_lab.base_moe import gemm_tiles, moe_gemm, silu_and_mul
from moelora_lab.experiments.in_k_act import gemm_act
from moelora_lab.layer import SCHEDULES, moe_lora_layer
from moelora_lab.routing.device import make_blocks
from test_moe import SHAPE, case, half_tile_case
from utils import assert_close, poisoned

[ROW] = [name for name, row in SCHEDULES.items() if row.runner == "moelora_lab.experiments.in_k_act:run"]


def two_kernels(x, w, blocks, k, tiles, x_tail=None):
    """What the separate kernels compute from token rows x: c1 through memory, then the activation."""
    P = x.shape[0] * k
    c1 = torch.empty(P, w.shape[1], dtype=x.dtype, device=x.device)
    moe_gemm(x, w, blocks, c1, top_k=k, tiles=dict(tiles), x_tail=x_tail)
    h = torch.empty(P, w.shape[1] // 2, dtype=x.dtype, device=x.device)
    return silu_and_mul(c1, h, top_k=k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("half", [True, False])
def test_gemm_act_is_the_gemm_then_the_activation_bit_for_bit(device, dtype, half):
    """Token rows, experts whose last blocks end in either half (HALF_TAIL runs half tiles), I = 40 not a
    multiple of the tile; every row of h written (it starts as NaN) and equal to the two launches'."""
    p, _ = half_tile_case(device, 16)
    x, w13 = p.x.to(dtype), p.w13.to(dtype)
    M, k = p.topk_ids.shape
    tiles = dict(gemm_tiles(M * k, SHAPE.num_experts), BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, HALF_TAIL=half)
    blocks = make_blocks(p.topk_ids, None, SHAPE.num_experts, 1, 16)
    h = poisoned((M * k, SHAPE.intermediate), dtype, device)
    got = gemm_act(x, w13, blocks, h, top_k=k, tiles=tiles)
    assert torch.equal(got, two_kernels(x, w13, blocks, k, tiles))


def test_gemm_act_reads_each_halfs_tail(device):
    """With an x tail [2, P, C] (the LoRA in K) gate reads slice 0's rows and up slice 1's, as ``moe_gemm`` does."""
    p = case(device, torch.float32, 7, 8, seed=4)
    M, k = p.topk_ids.shape
    H, I, E, C = SHAPE.hidden, SHAPE.intermediate, SHAPE.num_experts, 12
    tiles = dict(gemm_tiles(M * k, E), BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)
    at = ml.base_moe.tail_start(H)
    w = torch.zeros(E, 2 * I, at + C, device=device)
    w[:, :, :H] = p.w13
    w[:, :, at:] = torch.randn(E, 2 * I, C, generator=torch.Generator().manual_seed(2)).to(device)
    tail = torch.randn(2, M * k, C, generator=torch.Generator().manual_seed(3)).to(device)
    blocks = make_blocks(p.topk_ids, None, E, 1, 16)
    x = torch.full((M, at + 16), float("nan"), device=device)   # NaN right past x's columns: none may be read
    x[:, :H] = p.x
    x = x[:, :H]
    got = gemm_act(x, w, blocks, poisoned((M * k, I), torch.float32, device), top_k=k, tiles=tiles, x_tail=tail)
    assert torch.equal(got, two_kernels(p.x, w, blocks, k, tiles, x_tail=tail))
    swapped = two_kernels(p.x, w, blocks, k, tiles, x_tail=tail.flip(0).contiguous())
    assert not torch.allclose(got, swapped)                 # the slices' tails are not interchangeable


@pytest.mark.parametrize("rank, M, kw", [(8, 9, dict(no_adapter_fraction=0.3)), (5, 20, {}), (16, 1, {})])
def test_in_k_act_layer_matches_reference(device, rank, M, kw):
    """Ranks 8, 5 (not a power of two) and 16; tokens without an adapter; one token; fp32 and fp16 (bf16 on a GPU)."""
    for dtype in [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else []):
        p = ml.make_problem(SHAPE, ml.LoRAShape(3, rank), M, dtype=dtype, device=device, seed=rank + M, **kw)
        inputs = p.layer_inputs()
        pack = ml.pack_in_k(inputs["w13"], inputs["w2"], inputs["w13_lora_b"], inputs["w2_lora_b"])
        got = moe_lora_layer(**dict(inputs, w13=pack.w13, w2=pack.w2), in_k=pack, schedule=ROW)
        assert_close(got, ml.moe_layer_reference(**inputs), dtype)


def test_in_k_act_equals_in_k_bit_for_bit(device):
    """The activation from registers rounds as c1 would have been stored: the same h, so the same y as ``in_k``."""
    for dtype in (torch.float32, torch.float16):
        p = case(device, dtype, 11, 8, seed=9, no_adapter_fraction=0.3)
        kw = p.layer_inputs()
        pack = ml.pack_in_k(kw["w13"], kw["w2"], kw["w13_lora_b"], kw["w2_lora_b"])
        kw = dict(kw, w13=pack.w13, w2=pack.w2, in_k=pack)
        [in_k] = [n for n, row in SCHEDULES.items() if row.needs_pack and row.status == "product"]
        assert torch.equal(moe_lora_layer(**kw, schedule=ROW), moe_lora_layer(**kw, schedule=in_k)), dtype


def test_gemm_act_runs_every_tile_of_the_gpu_rule(device):
    """The base GEMM's GPU tiles, small to the largest (on a GPU in fp16, which they are made for; on the CPU the
    interpreter runs the same sizes in fp32), W by TMA where the rule says so: bit for bit the two launches."""
    from moelora_lab.base_moe import gpu_gemm_tiles
    dtype = torch.float16 if device == "cuda" else torch.float32
    p = case(device, dtype, 29, 8, seed=12)
    M, k = p.topk_ids.shape
    for per_expert in (1, 24, 64, 512):
        tiles = gpu_gemm_tiles(per_expert)
        blocks = make_blocks(p.topk_ids, None, SHAPE.num_experts, 1, tiles["BLOCK_M"])
        h = poisoned((M * k, SHAPE.intermediate), dtype, device)
        got = gemm_act(p.x, p.w13, blocks, h, top_k=k, tiles=tiles)
        assert torch.equal(got, two_kernels(p.x, p.w13, blocks, k, tiles)), tiles
