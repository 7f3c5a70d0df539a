"""The base grouped GEMM and its two joins (activation, top-k sum) against the reference."""
import pytest
import torch

import moelora_lab as ml
from moelora_lab import base_moe as moe, rules
from moelora_lab.routing.device import make_blocks
from moelora_lab.base_moe import fused_columns, gemm_tiles, moe_gemm
from utils import assert_close, poisoned

SHAPE = ml.MoEShape(48, 40, 6, 2, "moe-test")     # K and N not multiples of the tiles


def case(device, dtype, M, rank, seed, **kw):
    return ml.make_problem(SHAPE, ml.LoRAShape(3, rank), M, dtype=dtype, device=device, seed=seed, **kw)


def base_rows(p, x, w):
    """Every pair's x row (its token's for token rows) times its expert's W (fp32)."""
    M, k = p.topk_ids.shape
    rows = x.float().repeat_interleave(k, 0) if x.shape[0] == M else x.float()
    return torch.einsum("pk,pnk->pn", rows, w.float()[p.topk_ids.reshape(-1).long()])


def routed(p, out, mul):
    """out times each pair's routing weight where ``mul``."""
    return out * p.topk_weights.reshape(-1, 1).float() if mul else out


def expected_base(p, x, w, mul):
    """The grouped GEMM's output without LoRA (fp32)."""
    return routed(p, base_rows(p, x, w), mul)


def launch(gemm, p, x, w, mul, **tile_changes):
    """``gemm(x, w, blocks, out, top_k=, topk_weights=, tiles=)`` over p's routing, with the rule's tiles
    changed by ``tile_changes``, into an out whose unwritten rows stay NaN (and fail)."""
    M, k = p.topk_ids.shape
    tiles = dict(gemm_tiles(M * k, SHAPE.num_experts), **tile_changes)
    blocks = make_blocks(p.topk_ids, torch.zeros_like(p.token_lora), SHAPE.num_experts, 1, tiles["BLOCK_M"])
    out = poisoned((M * k, w.shape[1]), x.dtype, x.device)
    weights = p.topk_weights.reshape(-1).float().contiguous() if mul else None
    return gemm(x, w, blocks, out, top_k=k, topk_weights=weights, tiles=tiles)


def run(p, x, w, mul, **tile_changes):
    return launch(moe_gemm, p, x, w, mul, **tile_changes)


def last_blocks_by_half(blocks, num_pairs):
    """How many experts' last blocks end in their first half, and how many in their second half."""
    pairs = blocks.sorted_pairs.reshape(blocks.num_blocks, -1).cpu()
    expert = blocks.block_expert.cpu()
    last = [b for b in range(blocks.num_blocks) if expert[b] >= 0
            and (b + 1 == blocks.num_blocks or expert[b + 1] != expert[b])]
    firsts = sum(int(pairs[b, pairs.shape[1] // 2] >= num_pairs) for b in last)
    return firsts, len(last) - firsts


def half_tile_case(device, block_m):
    """A problem (29 tokens, fp32) and a w2 input h whose experts' last blocks of ``block_m`` pairs end in
    both halves, some in the first (a half tile with HALF_TAIL), some in the second."""
    M = 29
    p = case(device, torch.float32, M, 8, seed=11, no_adapter_fraction=0.3)
    k, E = SHAPE.top_k, SHAPE.num_experts
    firsts, seconds = last_blocks_by_half(make_blocks(p.topk_ids, None, E, 1, block_m), M * k)
    assert firsts > 0 and seconds > 0, (firsts, seconds)
    return p, torch.randn(M * k, SHAPE.intermediate, device=device, dtype=torch.float32)


@pytest.mark.parametrize("block_m", [16, 8])
def test_half_tiles_for_blocks_whose_second_half_is_padding(device, block_m):
    """HALF_TAIL: a block whose pairs end in its first half runs a tile of half the rows; every row still
    written (the output is poisoned) and equal to the reference, with last blocks of both kinds present."""
    p, h = half_tile_case(device, block_m)
    want13, want2 = expected_base(p, p.x, p.w13, False), expected_base(p, h, p.w2, True)
    for half in (True, False):
        tiles = dict(BLOCK_M=block_m, HALF_TAIL=half)
        assert_close(run(p, p.x, p.w13, mul=False, **tiles), want13, torch.float32)
        assert_close(run(p, h, p.w2, mul=True, **tiles), want2, torch.float32)


def test_rows_computed_counts_whole_and_half_tiles():
    per_expert = torch.tensor([0, 1, 64, 65, 128, 129, 200, 256])
    for half in (False, True):
        want = 0
        for n in per_expert.tolist():
            full, left = divmod(n, 128)
            want += 128 * full + (0 if left == 0 else 64 if half and left <= 64 else 128)
        assert moe.rows_computed(per_expert, 128, half) == want
    assert moe.rows_computed(per_expert, 128, True) < moe.rows_computed(per_expert, 128, False)


def test_half_tail_rule_and_its_errors(device):
    assert [moe.half_tail(bm) for bm in (16, 64, 128, 256)] == [False, False, True, True]
    p = case(device, torch.float32, 5, 8, seed=1)
    with pytest.raises(ValueError, match="tiles: HALF_TAIL must be True or False"):
        run(p, p.x, p.w13, mul=False, HALF_TAIL="yes")
    with pytest.raises(ValueError, match="True with an even BLOCK_M"):
        run(p, p.x, p.w13, mul=False, BLOCK_M=5, HALF_TAIL=True)


@pytest.mark.parametrize("tiles", [{}, dict(BLOCK_N=32, BLOCK_K=16)])
def test_w_tiles_by_tma_match_reference(device, tiles):
    """W_TMA: the W tile as one bulk copy of the [E*N, K] view; N and K not multiples of the tiles, so
    tiles reach into the next expert's rows (never stored) and past the tensor (zeros)."""
    p = case(device, torch.float16, 13, 8, seed=3, no_adapter_fraction=0.3)
    out13 = run(p, p.x, p.w13, mul=False, W_TMA=True, **tiles)
    assert_close(out13, expected_base(p, p.x, p.w13, False), torch.float16)
    h = torch.randn(13 * SHAPE.top_k, SHAPE.intermediate, device=device, dtype=torch.float16)
    out2 = run(p, h, p.w2, mul=True, W_TMA=True, **tiles)
    assert_close(out2, expected_base(p, h, p.w2, True), torch.float16)


def test_w_tma_auto_loads_by_tma_where_it_can(device):
    """W_TMA="auto" (the GPU rule's value): TMA bulk copies where the GPU and the weight allow them,
    pointer loads elsewhere, the same result either way; a value the launcher does not know is refused."""
    p = case(device, torch.float16, 6, 8, seed=5)
    strided = p.w13.transpose(1, 2).contiguous().transpose(1, 2)          # same values, K not fastest
    hopper = torch.device(device).type == "cuda" and torch.cuda.get_device_capability()[0] >= 9
    assert moe._tma_fits(p.w13) == (hopper and not moe.INTERPRET) and not moe._tma_fits(strided)
    assert not moe._tma_fits(p.w13.float())                                 # 16-bit weights only
    want = expected_base(p, p.x, p.w13, False)
    for w in (p.w13, strided):
        assert_close(run(p, p.x, w, mul=False, W_TMA="auto"), want, torch.float16)
    with pytest.raises(ValueError, match="tiles: W_TMA must be True, False or 'auto', got 'yes'"):
        run(p, p.x, p.w13, mul=False, W_TMA="yes")
    assert all(moe.gpu_gemm_tiles(pe, lora=lora)["W_TMA"] == "auto" for pe in (1, 24, 200) for lora in (False, True))


def test_w_tma_refuses_a_strided_weight(device):
    p = case(device, torch.float16, 4, 8, seed=0)
    strided = p.w13.transpose(1, 2).contiguous().transpose(1, 2)          # same values, K not fastest
    with pytest.raises(ValueError, match="w: W_TMA=True needs rows of unit column stride"):
        run(p, p.x, strided, mul=False, W_TMA=True)
    odd = torch.full((*p.w13.shape[:2], p.w13.shape[2] + 3), float("nan"), device=device, dtype=torch.float16)
    odd[:, :, :p.w13.shape[2]] = p.w13                                  # rows 6 bytes apart from 16-byte steps
    with pytest.raises(ValueError, match="16-byte aligned"):
        run(p, p.x, odd[:, :, :p.w13.shape[2]], mul=False, W_TMA=True)


@pytest.mark.parametrize("w_tma", [True, "auto"])
def test_a_column_slice_of_a_wider_weight_by_tma(device, w_tma):
    """The views ``layer_in_k.pack_in_k`` hands out: rows further apart than K (16-byte aligned). The
    columns past K are NaN, so a tile that read them would fail."""
    p = case(device, torch.float16, 7, 8, seed=6)
    E, N, K = p.w13.shape
    wide = torch.full((E, N, K + 16), float("nan"), device=device, dtype=torch.float16)
    wide[:, :, :K] = p.w13
    view = wide[:, :, :K]
    assert moe._tma_refusal(view) == moe._tma_refusal(p.w13)         # accepted wherever the contiguous one is
    want = expected_base(p, p.x, p.w13, False)
    assert_close(run(p, p.x, view, mul=False, W_TMA=w_tma), want, torch.float16)


def test_fused_columns():
    assert fused_columns(4, 16) == 64 and fused_columns(3, 5) == 16 and fused_columns(3, 48) == 256


@pytest.mark.parametrize("tile", [True, False])
@pytest.mark.parametrize("top_k, cols", [(6, 40), (8, 1030)])
def test_joins_drop_the_delta_of_tokens_without_an_adapter(device, top_k, cols, tile, monkeypatch):
    """The activation and the top-k sum read a delta row before they know the token's adapter: rows of tokens
    without one hold NaN here (never written by the LoRA) and must not reach the output; the outputs start as
    NaN, so an unwritten element fails too. k = 6 pads the sum's tile of rows, 1030 columns split into tiles."""
    monkeypatch.setattr(rules, "SUM_TILE_MAX_PAIRS", 10**6 if tile else 0)     # the sum's two forms
    gen = torch.Generator().manual_seed(top_k)
    M = 7
    assert moe.rows_as_tile(M * top_k) == tile
    P = M * top_k
    token_lora = torch.tensor([0, -1, 2, -1, 1, 0, -1], dtype=torch.int32).to(device)
    no_adapter = (token_lora < 0).repeat_interleave(top_k)
    c1, d13 = (torch.randn(P, 2 * cols, generator=gen).to(device) for _ in range(2))
    c3, d2 = (torch.randn(P, cols, generator=gen).to(device) for _ in range(2))
    d13[no_adapter], d2[no_adapter] = float("nan"), float("nan")
    h = moe.silu_and_mul(c1, poisoned((P, cols), torch.float32, device), top_k=top_k, delta=d13, token_lora=token_lora)
    g = c1 + torch.nan_to_num(d13)
    assert_close(h, torch.nn.functional.silu(g[:, :cols]) * g[:, cols:], torch.float32)
    y = moe.topk_sum(c3, poisoned((M, cols), torch.float32, device), top_k=top_k, delta=d2, token_lora=token_lora)
    assert_close(y, (c3 + torch.nan_to_num(d2)).view(M, top_k, cols).sum(1), torch.float32)
    plain = moe.topk_sum(c3, poisoned((M, cols), torch.float32, device), top_k=top_k)
    assert_close(plain, c3.view(M, top_k, cols).sum(1), torch.float32)


def test_the_sum_takes_rows_as_a_tile_up_to_its_pairs():
    assert moe.rows_as_tile(1) and moe.rows_as_tile(rules.SUM_TILE_MAX_PAIRS)
    assert not moe.rows_as_tile(rules.SUM_TILE_MAX_PAIRS + 1)
