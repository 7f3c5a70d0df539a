"""The grouped GEMM with the LoRA inside it (the ``fused`` and ``epilogue`` schedules' kernel) against the
reference and against the base GEMM."""
import pytest
import torch

import moelora_lab as ml
from moelora_lab.experiments.in_gemm import GemmLoRA, moe_gemm_lora
from test_moe import SHAPE, base_rows, case, half_tile_case, launch, routed, run
from utils import assert_close, shrink_spec


def expected(p, x, w, lora_a, lora_b, mul, ranks=None):
    """Every pair's base row plus, for pairs with an adapter, its LoRA delta (fp32)."""
    M, k = p.topk_ids.shape
    if ranks is not None:   # the spec on weights cut to each slot's rank
        keep = torch.arange(lora_a[0].shape[2], device=x.device)[None, :] < ranks[:, None]
        lora_a = [torch.where(keep[:, None, :, None], a, torch.zeros_like(a)) for a in lora_a]
        lora_b = [torch.where(keep[:, None, None, :], b, torch.zeros_like(b)) for b in lora_b]
    delta = ml.moe_lora_reference(x, p.topk_ids, p.topk_weights, p.token_lora, lora_a, lora_b)
    return routed(p, base_rows(p, x, w) + delta.reshape(M * k, -1), mul)


def run_lora(p, x, w, lora, mul, **tile_changes):
    return launch(lambda *args, **kw: moe_gemm_lora(*args, lora, **kw), p, x, w, mul, **tile_changes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M, rank, kw", [(9, 8, dict(no_adapter_fraction=0.3)), (20, 5, {}), (1, 16, {})])
def test_in_gemm_lora_matches_reference(device, dtype, M, rank, kw):
    """w13 (token rows, 2 slices of 40 columns) and w2 (pair rows, routing weights)."""
    p = case(device, dtype, M, rank, seed=M + rank, **kw)
    tl32 = p.token_lora.to(torch.int32)
    out13 = run_lora(p, p.x, p.w13, GemmLoRA(tl32, p.w13_lora_a, p.w13_lora_b), mul=False)
    assert_close(out13, expected(p, p.x, p.w13, p.w13_lora_a, p.w13_lora_b, False), dtype)
    h = torch.randn(M * SHAPE.top_k, SHAPE.intermediate, device=device, dtype=dtype)
    out2 = run_lora(p, h, p.w2, GemmLoRA(tl32, p.w2_lora_a, p.w2_lora_b), mul=True)
    assert_close(out2, expected(p, h, p.w2, p.w2_lora_a, p.w2_lora_b, True), dtype)


def test_in_gemm_lora_runs_half_tiles(device):
    """HALF_TAIL with the LoRA inside: the half tile's rows carry their LoRA too (the output is poisoned)."""
    p, h = half_tile_case(device, 16)
    tl32 = p.token_lora.to(torch.int32)
    lora13, lora2 = GemmLoRA(tl32, p.w13_lora_a, p.w13_lora_b), GemmLoRA(tl32, p.w2_lora_a, p.w2_lora_b)
    want13 = expected(p, p.x, p.w13, p.w13_lora_a, p.w13_lora_b, False)
    want2 = expected(p, h, p.w2, p.w2_lora_a, p.w2_lora_b, True)
    for half in (True, False):
        tiles = dict(BLOCK_M=16, HALF_TAIL=half)
        assert_close(run_lora(p, p.x, p.w13, lora13, mul=False, **tiles), want13, torch.float32)
        assert_close(run_lora(p, h, p.w2, lora2, mul=True, **tiles), want2, torch.float32)


@pytest.mark.parametrize("tiles", [{}, dict(BLOCK_N=32, BLOCK_K=16)])
def test_in_gemm_lora_with_w_tiles_by_tma(device, tiles):
    """W_TMA with the LoRA inside: N and K not multiples of the tiles (see test_moe's TMA test)."""
    p = case(device, torch.float16, 13, 8, seed=3, no_adapter_fraction=0.3)
    lora13 = GemmLoRA(p.token_lora.to(torch.int32), p.w13_lora_a, p.w13_lora_b)
    out13 = run_lora(p, p.x, p.w13, lora13, mul=False, W_TMA=True, **tiles)
    assert_close(out13, expected(p, p.x, p.w13, p.w13_lora_a, p.w13_lora_b, False), torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_in_gemm_lora_expand_reads_only_what_the_shrink_wrote(device, dtype):
    """GemmLoRA(shrunk=T) (the ``epilogue`` schedule): the GEMM skips the shrink and expands T before its
    K loop; T rows of pairs without an adapter and ranks past a slot's rank are NaN and must never be read."""
    p = case(device, dtype, 11, 8, seed=5, no_adapter_fraction=0.3, adapter_ranks=(8, 3, 5))
    tl32, ranks = p.token_lora.to(torch.int32), torch.tensor([8, 3, 5], dtype=torch.int32, device=device)
    t13 = shrink_spec(p, p.x, p.w13_lora_a, ranks)
    out13 = run_lora(p, p.x, p.w13, GemmLoRA(tl32, p.w13_lora_a, p.w13_lora_b, ranks, shrunk=t13), mul=False)
    assert_close(out13, expected(p, p.x, p.w13, p.w13_lora_a, p.w13_lora_b, False, ranks), dtype)
    doubled = run_lora(p, p.x, p.w13, GemmLoRA(tl32, p.w13_lora_a, p.w13_lora_b, ranks, shrunk=2 * t13), mul=False)
    assert_close(doubled, 2 * out13.float() - base_rows(p, p.x, p.w13), dtype)      # it expands the T it is given
    h = torch.randn(11 * SHAPE.top_k, SHAPE.intermediate, device=device, dtype=dtype)
    t2 = shrink_spec(p, h, p.w2_lora_a, ranks)
    out2 = run_lora(p, h, p.w2, GemmLoRA(tl32, p.w2_lora_a, p.w2_lora_b, ranks, shrunk=t2), mul=True)
    assert_close(out2, expected(p, h, p.w2, p.w2_lora_a, p.w2_lora_b, True, ranks), dtype)


def test_in_gemm_lora_touches_only_rows_with_an_adapter(device):
    """With adapters on some tokens only, the other rows are exactly the base GEMM's."""
    p = case(device, torch.float32, 12, 8, seed=3, no_adapter_fraction=0.5)
    tl32 = p.token_lora.to(torch.int32)
    with_lora = run_lora(p, p.x, p.w13, GemmLoRA(tl32, p.w13_lora_a, p.w13_lora_b), mul=False)
    base = run(p, p.x, p.w13, mul=False)
    none = (p.token_lora < 0).repeat_interleave(SHAPE.top_k)
    assert none.any() and (~none).any()
    # exact on a GPU; the interpreter's dots go through NumPy's BLAS, whose rounding may differ in the last
    # bit between two launches of different kernels: a LoRA term would differ by far more than that
    exact = dict(rtol=0, atol=0) if device == "cuda" else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(with_lora[none], base[none], **exact)
    assert not torch.allclose(with_lora[~none], base[~none])


def test_in_gemm_lora_reads_only_each_slots_rank(device):
    """Weights past a slot's actual rank are NaN: they must never be read."""
    p = case(device, torch.float32, 10, 16, seed=4, adapter_ranks=(3, 16, 8))
    ranks = torch.tensor(p.adapter_ranks, device=device, dtype=torch.int32)
    lora_a, lora_b = [a.clone() for a in p.w13_lora_a], [b.clone() for b in p.w13_lora_b]
    for slot, r in enumerate(p.adapter_ranks):
        for a, b in zip(lora_a, lora_b):
            a[slot, :, r:] = float("nan")
            b[slot, :, :, r:] = float("nan")
    out = run_lora(p, p.x, p.w13, GemmLoRA(p.token_lora.to(torch.int32), lora_a, lora_b, ranks), mul=False)
    assert_close(out, expected(p, p.x, p.w13, lora_a, lora_b, False, ranks), torch.float32)
