"""Every Triton path of moe_lora against the fp32 reference (CPU interpreter, or CUDA with --gpu)."""
import pytest
import torch

import moelora_lab as ml
from moelora_lab import rules
from moelora_lab.op.dispatch import KernelConfig
from moelora_lab.op.face import moe_lora
from moelora_lab.routing import naive_block_list
from moelora_lab.routing import block_list
from utils import assert_close, lora_case, poisoned

KERNEL_PATHS = ["one_shot", "two_kernel", "small_batch"]


def small_tiles(device, **kw):
    """Tiles smaller than the problem, so masks and loops are exercised (K=48, N=40 not multiples)."""
    base = dict(block_m=16, block_n=32, block_k=32)
    if device == "cpu":
        base |= dict(num_warps=1, num_stages=1)
    return KernelConfig(**(base | kw))


def dtypes(device):
    return [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])


def w2_args(p, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    M, k = p.topk_ids.shape
    h = torch.randn(M * k, p.w2_lora_a[0].shape[-1], generator=g).to(device=device, dtype=dtype)
    return (h, p.topk_ids, p.topk_weights, p.token_lora, p.w2_lora_a, p.w2_lora_b)


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("slices", [2, 1])
@pytest.mark.parametrize("add_inputs", [False, True])
def test_paths_against_reference(device, path, slices, add_inputs):
    for dtype in dtypes(device):
        p = lora_case(13, dtype=dtype, device=device, seed=slices * 10 + add_inputs, no_adapter_fraction=0.25)
        if slices == 2:   # w13: token rows, no routing weight
            args, mul = tuple(p.w13_lora_inputs().values()), False
        else:             # w2: pair rows, routing weight applied
            args, mul = w2_args(p, device, dtype), True
        ref = ml.moe_lora_reference(*args, mul_routed_weight=mul)
        M, k, SN = ref.shape
        has = (p.token_lora >= 0).view(M, 1, 1)
        if add_inputs:
            out = torch.randn(M, k, SN).to(device=device, dtype=dtype)
            expect = out.float() + ref
        else:   # rows of pairs with an adapter must be written; the others stay as they were (NaN)
            out = poisoned((M, k, SN), dtype, device)
            expect = ref
        res = moe_lora(*args, path=path, mul_routed_weight=mul, output=out, add_inputs=add_inputs,
                       config=small_tiles(device))
        assert res is out and res.dtype == dtype
        assert_close(out.float()[has.expand_as(out)], expect[has.expand_as(out)], dtype)
        if not add_inputs:
            assert torch.isnan(out[(~has).expand_as(out)].float()).all()
        else:
            assert_close(out.float()[(~has).expand_as(out)], expect[(~has).expand_as(out)], dtype)


RANKS = [4, 8, 16, 48, 64, 128, 192, 256, 512]


@pytest.mark.parametrize("rank", RANKS)
def test_any_rank_one_shot(device, rank):
    """Ranks past the register tile are tiled inside the fused kernel (CPU: tiles of 64 to stay fast)."""
    p = lora_case(6, rank=rank, hidden=32, inter=24, seed=rank, device=device)
    cfg = None if device == "cuda" else KernelConfig(block_m=16, block_n=32, block_k=32, max_block_r=64)
    ref = ml.moe_lora_reference(**p.w13_lora_inputs())
    out = moe_lora(**p.w13_lora_inputs(), path="one_shot", output=poisoned(ref.shape, p.x.dtype, device),
                   add_inputs=False, config=cfg)
    assert_close(out, ref, p.x.dtype)


@pytest.mark.parametrize("path", ["two_kernel", "small_batch", "auto"])
@pytest.mark.parametrize("rank", [4, 48, 192, 512])
def test_any_rank_other_paths(device, path, rank):
    p = lora_case(5, rank=rank, hidden=32, inter=24, seed=rank + 1, device=device)
    cfg = None if device == "cuda" or path == "auto" else KernelConfig(block_m=16, block_n=32, block_k=32,
                                                                         max_block_r=128)
    args = w2_args(p, device, p.x.dtype, seed=rank)
    ref = ml.moe_lora_reference(*args, mul_routed_weight=True)
    out = moe_lora(*args, path=path, mul_routed_weight=True, output=poisoned(ref.shape, p.x.dtype, device),
                   add_inputs=False, config=cfg)
    assert_close(out, ref, p.x.dtype)


def test_rank_tiles_are_chosen_wide():
    cfg = KernelConfig()
    assert cfg.rank_tiling(4) == (16, 1) and cfg.rank_tiling(48) == (64, 1) and cfg.rank_tiling(128) == (128, 1)
    assert cfg.rank_tiling(192) == (128, 2) and cfg.rank_tiling(256) == (128, 2) and cfg.rank_tiling(512) == (128, 4)
    assert KernelConfig(block_r=32).rank_tiling(100) == (32, 4)


@pytest.mark.parametrize("path", KERNEL_PATHS + ["reference"])
def test_edge_cases(device, path):
    cfg = None if path == "reference" else small_tiles(device)
    # M = 1, every expert but the routed ones empty
    p = lora_case(1, device=device, seed=3)
    ref = ml.moe_lora_reference(**p.w13_lora_inputs())
    out = moe_lora(**p.w13_lora_inputs(), path=path, config=cfg)
    assert_close(out, ref, torch.float32)
    # all tokens routed to the same two experts: 6 of 8 experts empty, one large group
    p = lora_case(20, device=device, seed=4, adapter_popularity="identical")
    p.topk_ids[:] = torch.tensor([3, 5], dtype=torch.int32, device=device)
    ref = ml.moe_lora_reference(**p.w13_lora_inputs())
    assert_close(moe_lora(**p.w13_lora_inputs(), path=path, config=cfg), ref, torch.float32)
    # no token has an adapter: the output is untouched
    p = lora_case(7, device=device, seed=5, no_adapter_fraction=1.0)
    init = torch.randn(7, 2, 80, device=device)
    out = moe_lora(**p.w13_lora_inputs(), path=path, output=init.clone(), config=cfg)
    assert torch.equal(out, init)


@pytest.mark.parametrize("path", KERNEL_PATHS + ["reference"])
def test_disabled_slots_act_as_no_adapter(device, path):
    p = lora_case(12, device=device, seed=6, loras=3)
    enabled = torch.tensor([True, False, True], device=device)
    masked = torch.where(p.token_lora == 1, -1, p.token_lora)
    ref = ml.moe_lora_reference(p.x, p.topk_ids, p.topk_weights, masked, p.w13_lora_a, p.w13_lora_b)
    cfg = None if path == "reference" else small_tiles(device)
    out = moe_lora(**p.w13_lora_inputs(), path=path, enabled=enabled, config=cfg,
                   output=poisoned(ref.shape, torch.float32, device), add_inputs=False)
    rows = (masked >= 0).view(-1, 1, 1).expand_as(out)
    assert (p.token_lora == 1).any() and torch.isnan(out[~rows]).all()
    assert_close(out[rows], ref[rows], torch.float32)


def test_shared_alignment_and_naive_blocks(device):
    """One BlockList serves w13 and w2; the naive assignment is just a BlockList of one pair per block."""
    p = lora_case(9, device=device, seed=7)
    E, L = 8, 3
    blocks = block_list(p.topk_ids, p.token_lora, E, L, 16)
    cfg = small_tiles(device)
    ref13 = ml.moe_lora_reference(**p.w13_lora_inputs())
    assert_close(moe_lora(**p.w13_lora_inputs(), path="one_shot", blocks=blocks, config=cfg), ref13, torch.float32)
    args = w2_args(p, device, torch.float32)
    ref2 = ml.moe_lora_reference(*args, mul_routed_weight=True)
    for al in (blocks, naive_block_list(p.topk_ids, p.token_lora, E, L, 16)):
        for path in ("one_shot", "two_kernel"):
            out = moe_lora(*args, path=path, blocks=al, mul_routed_weight=True, config=cfg)
            assert_close(out, ref2, torch.float32)


def test_auto_uses_the_documented_rule(device):
    from moelora_lab.op.dispatch import choose_path
    e = dict(num_experts=128, num_loras=4)
    # up to r 64 (one rank tile of at most 64): one-shot at every size and width
    for pairs in (1, 8, 64, 512, 4096, 16384, 65536):
        for n_out in (None, 768, 2048):
            assert choose_path(num_pairs=pairs, rank=16, n_out=n_out, **e) == "one_shot"
            assert choose_path(num_pairs=pairs, rank=64, n_out=n_out, **e) == "one_shot"
    # one rank tile of 128 (the widest tile of the GPU configs): two kernels from 9 to 512 pairs
    configs = rules.CONFIGS
    assert configs["decode"].max_block_r == configs["prefill"].max_block_r == rules.ONE_TILE_MAX_RANK
    assert choose_path(num_pairs=8, rank=128, **e) == "one_shot"
    assert choose_path(num_pairs=9, rank=128, **e) == "two_kernel"
    assert choose_path(num_pairs=512, rank=96, n_out=2048, **e) == "two_kernel"
    assert choose_path(num_pairs=513, rank=128, **e) == "one_shot"
    # ... and on outputs of at least 2048 per slice from 2048 to 4096 pairs too
    for n_out, runs in ((2048, "two_kernel"), (1408, "one_shot"), (None, "one_shot")):
        assert choose_path(num_pairs=2048, rank=128, n_out=n_out, **e) == runs
        assert choose_path(num_pairs=4096, rank=100, n_out=n_out, **e) == runs
    assert choose_path(num_pairs=2047, rank=128, n_out=2048, **e) == "one_shot"
    assert choose_path(num_pairs=4097, rank=128, n_out=2048, **e) == "one_shot"
    # past r 128: two kernels up to 4096 pairs, up to 12288 for outputs of at least 2048 per slice
    assert choose_path(num_pairs=1, rank=256, **e) == "two_kernel"
    assert choose_path(num_pairs=4096, rank=256, n_out=1408, **e) == "two_kernel"
    assert choose_path(num_pairs=4097, rank=256, n_out=1408, **e) == "one_shot"
    assert choose_path(num_pairs=4097, rank=256, **e) == "one_shot"                  # N unknown
    assert choose_path(num_pairs=12288, rank=256, n_out=2048, **e) == "two_kernel"
    assert choose_path(num_pairs=12289, rank=256, n_out=2048, **e) == "one_shot"
    p = lora_case(40, device=device, seed=8)
    ref = ml.moe_lora_reference(**p.w13_lora_inputs())
    assert_close(moe_lora(**p.w13_lora_inputs()), ref, torch.float32)


def _args(device="cpu"):
    p = lora_case(4, device=device)
    return p, dict(p.w13_lora_inputs())


@pytest.mark.parametrize("change, exc, match", [
    (dict(path="fast"), ValueError, "path: 'fast' is not one of 'reference', 'two_kernel', 'one_shot'"),
    (dict(output=torch.zeros(4, 2, 79)), ValueError, "output: expected shape \\(4, 2, 80\\)"),
    (dict(output=torch.zeros(4, 2, 80, dtype=torch.float16)), TypeError, "output: dtype torch.float16"),
    (dict(output=torch.zeros(4, 80, 2).transpose(1, 2)), ValueError, "output: must have contiguous"),
    (dict(config=dict(block_m=16)), TypeError, "config: expected a KernelConfig"),
    (dict(blocks=(1, 2, 3)), TypeError, "blocks: expected a BlockList"),
    (dict(enabled=torch.ones(2, dtype=torch.bool)), ValueError, "enabled: expected shape \\(3,\\)"),
])
def test_validation(change, exc, match):
    _, kw = _args()
    with pytest.raises(exc, match=match):
        moe_lora(**(kw | change))


def test_validation_weights_and_blocks():
    p, kw = _args()
    with pytest.raises(TypeError, match="lora_a\\[0\\]: dtype torch.float16 must equal x's dtype"):
        moe_lora(**(kw | dict(lora_a=[w.half() for w in p.w13_lora_a], lora_b=[w.half() for w in p.w13_lora_b])))
    bad = block_list(p.topk_ids, p.token_lora, 8, 3, 8)
    with pytest.raises(ValueError, match="blocks: block size 8 is not a power of two >= 16"):
        moe_lora(**kw, blocks=bad, path="one_shot")
    good = block_list(p.topk_ids, p.token_lora, 8, 3, 16)
    with pytest.raises(ValueError, match="config.block_m=32 differs from the blocks' block size 16"):
        moe_lora(**kw, blocks=good, path="one_shot", config=KernelConfig(block_m=32))
    with pytest.raises(ValueError, match="KernelConfig.block_n: must be a power of two >= 16, got 48"):
        KernelConfig(block_n=48)


@pytest.mark.parametrize("path", KERNEL_PATHS + ["reference"])
@pytest.mark.parametrize("slices", [2, 1])
def test_packed_lora_b_gives_the_same_delta(device, path, slices):
    """pack_lora_b changes only B's memory order (N fastest): every path reads it through its strides."""
    p = lora_case(13, dtype=torch.float32, device=device, seed=7, no_adapter_fraction=0.25)
    args, mul = (tuple(p.w13_lora_inputs().values()), False) if slices == 2 else (w2_args(p, device, torch.float32), True)
    ref = ml.moe_lora_reference(*args, mul_routed_weight=mul)
    packed = ml.pack_lora_b(list(args[5]))
    assert all(b.stride(2) == 1 and torch.equal(b, b0) for b, b0 in zip(packed, args[5]))
    M, k, SN = ref.shape
    out = poisoned((M, k, SN), torch.float32, device)
    moe_lora(*args[:5], packed, path=path, mul_routed_weight=mul, output=out, add_inputs=False,
             config=small_tiles(device))
    has = (p.token_lora >= 0).view(M, 1, 1).expand_as(out)
    assert_close(out[has], ref[has], torch.float32)
    assert torch.isnan(out[~has]).all()


def test_mixed_slice_layouts_are_rejected():
    p, kw = _args()
    mixed = [p.w13_lora_b[0], ml.pack_lora_b(p.w13_lora_b[1])]
    with pytest.raises(ValueError, match="lora_b: the slices have different memory layouts"):
        moe_lora(**(kw | dict(lora_b=mixed)))
    with pytest.raises(ValueError, match="lora_b: expected a 4-D tensor"):
        ml.pack_lora_b(p.w13_lora_b[0][0])


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_bf16_on_the_interpreter_is_computed_in_fp32():
    p = lora_case(5, dtype=torch.bfloat16)
    ref = ml.moe_lora_reference(**p.w13_lora_inputs())
    out = moe_lora(**p.w13_lora_inputs(), path="one_shot", config=small_tiles("cpu"))
    assert out.dtype == torch.bfloat16
    assert_close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("path", KERNEL_PATHS + ["reference"])
def test_actual_adapter_ranks_skip_the_padding(device, path):
    """With lora_ranks, weights past each slot's rank are never read: fill them with NaN to prove it."""
    ranks = (4, 40, 0)
    p = lora_case(11, rank=48, device=device, seed=12, adapter_ranks=ranks)      # zero-padded: the spec
    args = tuple(p.w13_lora_inputs().values())
    ref = ml.moe_lora_reference(*args)
    poison_a = [w.clone() for w in p.w13_lora_a]
    poison_b = [w.clone() for w in p.w13_lora_b]
    for slot, r in enumerate(ranks):
        for w in poison_a:
            w[slot, :, r:] = float("nan")
        for w in poison_b:
            w[slot, :, :, r:] = float("nan")
    cfg = None if path == "reference" else small_tiles(device, max_block_r=16)       # several rank tiles
    out = moe_lora(p.x, p.topk_ids, p.topk_weights, p.token_lora, poison_a, poison_b, path=path, config=cfg,
                   lora_ranks=torch.tensor(ranks, device=device), add_inputs=False,
                   output=poisoned(ref.shape, p.x.dtype, device))
    rows = (p.token_lora >= 0).view(-1, 1, 1).expand_as(out)
    assert (p.token_lora == 2).any()                    # a rank-0 slot is used: its rows must be written (zeros)
    assert_close(out[rows], ref[rows], p.x.dtype)
    with pytest.raises(ValueError, match="lora_ranks: value 49 is out of range; accepted values are 0 .. 48"):
        moe_lora(*args, lora_ranks=torch.tensor([4, 49, 0], device=device))


def test_gpu_tile_rule_for_narrow_ranks():
    """dispatch.gpu_config (the GPU rule, testable without a GPU): 2 warps and BLOCK_K 128 for the
    one-shot kernel with a 16-wide rank tile only; a 16-pair program expands at most 1024 columns."""
    from moelora_lab.op.dispatch import gpu_config
    for rank, warps in ((8, 2), (16, 2), (32, 4), (64, 4), (None, 4)):
        assert gpu_config("one_shot", 4096, 512, 2048, 1, 132, rank=rank).num_warps == warps, rank
    # the two-kernel path: 2 warps for blocks of <= 32 pairs with rank tiles <= 64 wide, else 4
    for pairs, rank, warps in ((4096, 16, 2), (4096, 64, 2), (4096, 128, 4), (4096, None, 4), (65536, 16, 4)):
        assert gpu_config("two_kernel", pairs, 512, 2048, 1, 132, rank=rank).num_warps == warps, (pairs, rank)
    for n_out in (768, 2048, 5000):
        cfg = gpu_config("one_shot", 4096, 512, n_out, 1, 132, rank=16)
        assert cfg.block_m == 16 and cfg.n_chunks >= -(-n_out // rules.MAX_EXPAND_COLUMNS)
    # a wider rank tile re-reads more of A per chunk: chunks for ~2 programs per SM, no column cap
    for rank, chunks in ((16, 2), (32, 1), (64, 1), (128, 1)):
        assert gpu_config("one_shot", 4096, 512, 2048, 1, 132, rank=rank).n_chunks == chunks, rank
    assert gpu_config("one_shot", 64, 64, 2048, 1, 132, rank=64).n_chunks == 4       # 66 blocks: 264 / 66
    assert gpu_config("one_shot", 64, 64, 2048, 1, 132, rank=16).n_chunks == 8       # 528 / 66
    prefill = gpu_config("one_shot", 16384, 512, 2048, 1, 132, rank=16)
    assert (prefill.block_m, prefill.block_k, prefill.n_chunks) == (32, 128, 1)
