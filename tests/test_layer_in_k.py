"""LoRA in K (w2's alone, and both w13's and w2's): the layers' output as the reference computes it,
their kernels alone, their checks."""
import pytest
import torch

import moelora_lab as ml
from moelora_lab.layer import IN_K_MIN_PAIRS_PER_EXPERT, plan_layer
from moelora_lab.experiments.in_k import in_k_overlap_layer, w2_in_k_layer
from moelora_lab.layer.in_k import _shrink_tail, act_and_shrink as _act_and_shrink, in_k_layer
from moelora_lab.layer.in_k_pack import pack_in_k, pack_w13_in_k, pack_w2_in_k
from moelora_lab.layer.streams import Streams
from moelora_lab.base_moe import gemm_tiles, moe_gemm, tail_start
from utils import assert_close, poisoned, shrink_spec

SHAPE = ml.MoEShape(48, 40, 6, 2, "in-k-test")        # I = 40: not a multiple of the blocks


def problem(device, dtype=torch.float32, M=9, rank=8, seed=1, **kw):
    return ml.make_problem(SHAPE, ml.LoRAShape(3, rank), M, dtype=dtype, device=device, seed=seed, **kw)


def run(p, **kw):
    inputs = p.layer_inputs()
    w2_ext = pack_w2_in_k(inputs["w2"], inputs["w2_lora_b"])
    args = {n: inputs[n] for n in ("x", "topk_ids", "topk_weights", "token_lora", "w13", "w13_lora_a", "w13_lora_b",
                                   "w2_lora_a")}
    return w2_in_k_layer(**args, w2_ext=w2_ext, **kw)


def run_both(p, overlap=False, **kw):
    inputs = p.layer_inputs()
    exts = dict(w13_ext=pack_w13_in_k(inputs["w13"], inputs["w13_lora_b"]),
                w2_ext=pack_w2_in_k(inputs["w2"], inputs["w2_lora_b"]))
    args = {n: inputs[n] for n in ("x", "topk_ids", "topk_weights", "token_lora", "w13_lora_a", "w2_lora_a")}
    return (in_k_overlap_layer if overlap else in_k_layer)(**args, **exts, **kw)


def dtypes(device):
    return [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])


@pytest.mark.parametrize("rank, M, kw", [(8, 9, dict(no_adapter_fraction=0.3)), (5, 20, {}), (16, 1, {}),
                                         (8, 33, dict(no_adapter_fraction=1.0)), (48, 7, {})])
@pytest.mark.parametrize("layer", [run, run_both], ids=["w2_in_k", "in_k"])
def test_layer_matches_reference(device, rank, M, kw, layer):
    """Rank not a power of two, a single token, tokens without an adapter, no adapter at all."""
    for dtype in dtypes(device):
        p = problem(device, dtype, M=M, rank=rank, seed=rank + M, **kw)
        assert_close(layer(p), ml.moe_layer_reference(**p.layer_inputs()), dtype)


@pytest.mark.parametrize("rank, M, kw", [(8, 9, dict(no_adapter_fraction=0.3)), (5, 20, {}), (16, 1, {}),
                                         (8, 33, dict(no_adapter_fraction=1.0))])
def test_shrink_beside_its_gemm_matches_reference(device, rank, M, kw):
    """in_k_overlap_layer: each shrink and its GEMM as one launch of ticketed programs (its kernel in_k_overlap)."""
    for dtype in dtypes(device):
        p = problem(device, dtype, M=M, rank=rank, seed=rank + 3 * M, **kw)
        assert_close(run_both(p, overlap=True), ml.moe_layer_reference(**p.layer_inputs()), dtype)
    p = problem(device, rank=16, seed=14, adapter_ranks=(3, 16, 5), no_adapter_fraction=0.3)
    ranks = torch.tensor(p.adapter_ranks, device=device)
    assert_close(run_both(p, overlap=True, lora_ranks=ranks), ml.moe_layer_reference(**p.layer_inputs()),
                 torch.float32)


def test_one_launch_runs_every_shrink_program_before_any_gemm_tail(device):
    """The launch's counters after it: every program drew one ticket, every shrink program counted itself
    done; the GEMM's output has every row written (poisoned before)."""
    from moelora_lab.experiments.in_k import gemm_after_shrink
    p = problem(device, M=13, rank=8, seed=2, no_adapter_fraction=0.3)
    inputs = p.layer_inputs()
    E, I, H, k = SHAPE.num_experts, SHAPE.intermediate, SHAPE.hidden, SHAPE.top_k
    P, L = 13 * k, 3
    w13_ext = pack_w13_in_k(inputs["w13"], inputs["w13_lora_b"])
    plan = plan_layer(p.topk_ids, p.token_lora, E, L, 8, intermediate=I, schedule="sequential")
    t13 = poisoned((2, P, L * 8), torch.float32, device)
    out = poisoned((P, 2 * I), torch.float32, device)
    counters = torch.zeros(2, dtype=torch.int32, device=device)
    gemm_after_shrink(p.x, p.w13_lora_a, plan, p.token_lora.to(torch.int32), k, t13, I, 8, None, p.x, w13_ext, out,
                      x_cols=H, tail_at=tail_start(H), token_rows=True, one_read=True, counters=counters)
    tiles = gemm_tiles(P, E)
    n_gemm = plan.base_blocks.num_blocks * 2 * -(-I // tiles["BLOCK_N"])
    tickets, done = counters.tolist()
    assert tickets == done + n_gemm and done > 0
    want = moe_gemm(p.x, w13_ext, plan.base_blocks, poisoned((P, 2 * I), torch.float32, device), top_k=k,
                    tiles=tiles, x_tail=t13)
    assert not torch.isnan(out).any()
    assert_close(out, want, torch.float32)
    # a done counter that never reaches the shrink's count: every tile gives up after max_spins reads, writes NaN
    counters = torch.tensor([0, -1], dtype=torch.int32, device=device)
    gemm_after_shrink(p.x, p.w13_lora_a, plan, p.token_lora.to(torch.int32), k, t13, I, 8, None, p.x, w13_ext, out,
                      x_cols=H, tail_at=tail_start(H), token_rows=True, one_read=True, counters=counters, max_spins=3)
    assert torch.isnan(out).all()


@pytest.mark.parametrize("layer", [run, run_both], ids=["w2_in_k", "in_k"])
def test_actual_adapter_ranks_and_a_plan(device, layer):
    p = problem(device, rank=16, seed=13, adapter_ranks=(3, 16, 5), no_adapter_fraction=0.3)
    ranks = torch.tensor(p.adapter_ranks, device=device)
    plan = plan_layer(p.topk_ids, p.token_lora, SHAPE.num_experts, 3, 16, schedule="sequential")
    assert_close(layer(p, plan=plan, lora_ranks=ranks), ml.moe_layer_reference(**p.layer_inputs()), torch.float32)
    fused = plan_layer(p.topk_ids, p.token_lora, SHAPE.num_experts, 3, 16, schedule="fused")
    with pytest.raises(ValueError, match="plan: made for schedule='fused', whose GEMMs carry the LoRA"):
        layer(p, plan=fused)


@pytest.mark.parametrize("layer", [run, run_both, lambda p, **kw: run_both(p, overlap=True, **kw)],
                         ids=["w2_in_k", "in_k", "in_k_overlap"])
def test_weights_nothing_reads_stay_out_of_every_row(device, layer):
    """The packed K multiplies each row's zero LoRA columns (another slot's, past its slot's rank) by W's columns
    there: NaN in a slot no token uses, or past a slot's rank (weights of slots allocated but not loaded yet),
    must not reach any row, those of tokens without an adapter included."""
    p = problem(device, rank=16, seed=17, adapter_ranks=(3, 16, 0), no_adapter_fraction=0.3)
    ranks = torch.tensor(p.adapter_ranks, device=device)
    p.token_lora[p.token_lora == 1] = 0                       # slot 1 has no token
    want = ml.moe_layer_reference(**p.layer_inputs())
    for key in ("w13_lora_a", "w13_lora_b", "w2_lora_a", "w2_lora_b"):
        for w in getattr(p, key):
            w[1] = float("nan")
            for slot, r in enumerate(p.adapter_ranks):
                (w[slot, :, r:] if key.endswith("_a") else w[slot, :, :, r:]).fill_(float("nan"))
    got = layer(p, lora_ranks=ranks)
    assert_close(got, want, torch.float32)


def test_no_tokens(device):
    inputs = problem(device).layer_inputs()
    args = {n: inputs[n][:0] for n in ("x", "topk_ids", "topk_weights", "token_lora")}
    exts = dict(w13_ext=pack_w13_in_k(inputs["w13"], inputs["w13_lora_b"]),
                w2_ext=pack_w2_in_k(inputs["w2"], inputs["w2_lora_b"]))
    assert in_k_layer(**args, **exts, w13_lora_a=inputs["w13_lora_a"], w2_lora_a=inputs["w2_lora_a"]).shape == \
        (0, SHAPE.hidden)


def test_pack_places_every_slot_after_w2(device):
    p = problem(device)
    w2, b = p.w2, p.w2_lora_b[0]                                          # [E, H, I], [L, E, H, r]
    ext = pack_w2_in_k(w2, p.w2_lora_b)
    I, r = w2.shape[2], b.shape[3]
    assert ext.shape == (6, 48, 40 + 3 * 8) and ext.is_contiguous()
    assert torch.equal(ext[:, :, :I], w2)
    for slot in range(3):
        assert torch.equal(ext[:, :, I + slot * r:I + (slot + 1) * r], b[slot])


def test_pack_w13_pads_x_columns_then_places_both_slices(device):
    p = problem(device)
    w13, (bg, bu) = p.w13, p.w13_lora_b                                   # [E, 2I, H], [L, E, I, r] each
    ext = pack_w13_in_k(w13, p.w13_lora_b)
    H, I, at, r = SHAPE.hidden, SHAPE.intermediate, tail_start(SHAPE.hidden), 8
    assert at == 128 and ext.shape == (6, 2 * I, at + 3 * r) and ext.is_contiguous()
    assert torch.equal(ext[:, :, :H], w13) and not ext[:, :, H:at].any()
    for slot in range(3):
        cols = slice(at + slot * r, at + (slot + 1) * r)
        assert torch.equal(ext[:, :I, cols], bg[slot]) and torch.equal(ext[:, I:, cols], bu[slot])


def test_w13_gemm_reads_its_last_k_steps_from_the_tail(device):
    """out (poisoned first) = [x_token | T_s[pair]] @ w13_ext[e]^T: x's columns from the token's row,
    the tail's from the pair's row of its slice (gate columns from T_0, up columns from T_1)."""
    p = problem(device, M=11, seed=3)
    M, k = p.topk_ids.shape
    P, I, LR = M * k, SHAPE.intermediate, 3 * 8
    ext = pack_w13_in_k(p.w13, p.w13_lora_b)
    t = torch.randn(2, P, LR, device=device)
    plain = plan_layer(p.topk_ids, p.token_lora, SHAPE.num_experts, None, None)
    at, e = tail_start(SHAPE.hidden), p.topk_ids.reshape(-1)
    x_pad = torch.nn.functional.pad(p.x, (0, at - SHAPE.hidden)).repeat_interleave(k, 0)
    want = torch.empty(P, 2 * I, device=device)
    for s in range(2):
        rows = torch.cat([x_pad, t[s]], dim=1)                                          # [P, at + LR]
        want[:, s * I:(s + 1) * I] = torch.einsum("pk,pnk->pn", rows, ext[e, s * I:(s + 1) * I])
    for half in (False, True):      # with HALF_TAIL every block here (a few pairs per expert) runs a half tile
        out = poisoned((P, 2 * I), torch.float32, device)
        tiles = dict(gemm_tiles(P, SHAPE.num_experts), HALF_TAIL=half)
        moe_gemm(p.x, ext, plain.base_blocks, out, top_k=k, tiles=tiles, x_tail=t)
        assert_close(out, want, torch.float32)
    with pytest.raises(ValueError, match=r"w: expected \[E, N, 128 \+ 24\].*pack_w13_in_k"):
        moe_gemm(p.x, p.w13, plain.base_blocks, out, top_k=k, x_tail=t)
    with pytest.raises(ValueError, match=r"x_tail: expected a tensor \[S, 22, C\]"):
        moe_gemm(p.x, ext, plain.base_blocks, out, top_k=k, x_tail=t[:, :5])
    with pytest.raises(ValueError, match="x_tail: expected a contiguous tensor of x's dtype"):
        moe_gemm(p.x, ext, plain.base_blocks, out, top_k=k, x_tail=t.half())


@pytest.mark.parametrize("one_read", [False, True], ids=["per slice", "one read"])
def test_one_launch_writes_both_w13_tails_from_token_rows(device, one_read):
    """T1 [2, P, L*r] (poisoned first): each pair's gate and up shrink of the token's x in its slot's
    first r_l columns, zeros everywhere else; the same with one program per block for both slices."""
    p = problem(device, rank=8, seed=7, adapter_ranks=(8, 2, 5), no_adapter_fraction=0.3)
    M, k = p.topk_ids.shape
    L, r = 3, 8
    plan = plan_layer(p.topk_ids, p.token_lora, SHAPE.num_experts, L, r, schedule="sequential")
    tail = poisoned((2, M * k, L * r), torch.float32, device)
    ranks = torch.tensor(p.adapter_ranks, device=device, dtype=torch.int32)
    _shrink_tail(p.x, p.w13_lora_a, plan, p.token_lora.to(torch.int32), k, tail, SHAPE.intermediate, r, ranks,
                 token_rows=True, one_read=one_read)
    compact = shrink_spec(p, p.x, p.w13_lora_a, p.adapter_ranks).nan_to_num(0.0)          # [2, P, r]
    want = torch.zeros_like(tail)
    slot = p.token_lora.repeat_interleave(k)
    for pair in range(M * k):
        if slot[pair] >= 0:
            s = int(slot[pair])
            want[:, pair, s * r:(s + 1) * r] = compact[:, pair]
    assert_close(tail, want, torch.float32)


@pytest.mark.parametrize("rank, with_delta", [(8, True), (5, False)], ids=["w13 delta", "no delta"])
def test_activation_and_w2_shrink_write_all_of_h_ext(device, rank, with_delta):
    """h_ext (poisoned first) = [silu(gate + dg) * (up + du) | T2]: T2 in each pair's slot's first r_l
    columns, zeros everywhere else."""
    ranks_l = (3, rank, 5)
    p = problem(device, rank=rank, seed=11, adapter_ranks=ranks_l, no_adapter_fraction=0.3)
    M, k = p.topk_ids.shape
    P, I, L = M * k, SHAPE.intermediate, 3
    plan = plan_layer(p.topk_ids, p.token_lora, SHAPE.num_experts, L, rank, schedule="sequential")
    c1, delta = torch.randn(P, 2 * I, device=device), torch.randn(P, 2 * I, device=device)
    slot = p.token_lora.repeat_interleave(k)
    delta[slot < 0] = float("nan")                        # never read for pairs without an adapter
    h_ext = poisoned((P, I + L * rank), torch.float32, device)
    ranks = torch.tensor(ranks_l, device=device, dtype=torch.int32)
    _act_and_shrink(c1, delta if with_delta else None, h_ext, p.w2_lora_a[0], plan, p.token_lora.to(torch.int32),
                    Streams(False, torch.device(device)), k, SHAPE.hidden, I, rank, ranks)
    g = c1 + (torch.where((slot >= 0)[:, None], delta, 0.0) if with_delta else 0.0)
    h = torch.nn.functional.silu(g[:, :I]) * g[:, I:]
    want = torch.zeros(P, L * rank, device=device)
    expert = p.topk_ids.reshape(-1)
    for pair in range(P):
        if slot[pair] >= 0:
            s, rl = int(slot[pair]), ranks_l[int(slot[pair])]
            want[pair, s * rank:s * rank + rl] = p.w2_lora_a[0][s, expert[pair], :rl] @ h[pair]
    assert_close(h_ext[:, :I], h, torch.float32)
    assert_close(h_ext[:, I:], want, torch.float32)


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
    _shrink_tail(h_ext, p.w2_lora_a, plan, p.token_lora.to(torch.int32), k, h_ext[:, I:].unsqueeze(0), SHAPE.hidden,
                 r, ranks)
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
    with pytest.raises(ValueError, match=r"w2_ext: expected a contiguous \[E, N, 40 \+ L\*r\] = \[6, 48, 64\].*"
                                         "pack_w2_in_k"):
        w2_in_k_layer(**args, w2_ext=inputs["w2"])                       # the base weight, not packed
    with pytest.raises(TypeError, match="w2_lora_b: expected a list of one tensor"):
        pack_w2_in_k(inputs["w2"], inputs["w2_lora_b"][0])
    with pytest.raises(ValueError, match=r"w2_lora_b\[0\]: expected \[L, 6, 48, r\]"):
        pack_w2_in_k(inputs["w2"], [inputs["w13_lora_b"][0]])
    if device == "cpu":
        with pytest.raises(ValueError, match="dual: True needs CUDA streams"):
            run(p, dual=True)
    both = {n: inputs[n] for n in ("x", "topk_ids", "topk_weights", "token_lora", "w13_lora_a", "w2_lora_a")}
    w2_ext = pack_w2_in_k(inputs["w2"], inputs["w2_lora_b"])
    with pytest.raises(ValueError, match=r"w13_ext: expected a contiguous \[E, N, 128 \+ L\*r\] = \[6, 80, 152\]"
                                         ".*pack_w13_in_k"):
        in_k_layer(**both, w13_ext=inputs["w13"], w2_ext=w2_ext)
    with pytest.raises(TypeError, match=r"w13_lora_b: expected a list of two tensors \[L, E, I, r\]"):
        pack_w13_in_k(inputs["w13"], inputs["w13_lora_b"][:1])


def packed_inputs(p):
    """The layer's inputs with w13 / w2 replaced by the views of one pack, and the pack."""
    inputs = p.layer_inputs()
    pack = pack_in_k(inputs["w13"], inputs["w2"], inputs["w13_lora_b"], inputs["w2_lora_b"])
    return dict(inputs, w13=pack.w13, w2=pack.w2), pack


@pytest.mark.parametrize("schedule", ["in_k", "sequential", "fused", "epilogue", "auto"])
def test_every_schedule_runs_from_one_packed_copy(device, schedule):
    """pack_in_k: the views serve every schedule (rows further apart than H, B of every slot between them),
    and schedule='in_k' runs in_k_layer from the pack; rank not a power of two, tokens without an adapter."""
    for dtype in dtypes(device):
        p = problem(device, dtype, M=11, rank=5, seed=21, no_adapter_fraction=0.3)
        inputs, pack = packed_inputs(p)
        assert pack.w13.data_ptr() == pack.w13_ext.data_ptr() and pack.w13.stride(1) == pack.w13_ext.shape[2]
        assert_close(ml.moe_lora_layer(**inputs, schedule=schedule, in_k=pack),
                     ml.moe_layer_reference(**p.layer_inputs()), dtype)


def test_in_k_schedule_follows_the_pack_and_the_rule(device):
    from moelora_lab.layer import IN_K_MAX_COLUMNS, IN_K_MIN_PAIRS_PER_EXPERT, gpu_schedule, resolve_schedule
    E = SHAPE.num_experts
    many = IN_K_MIN_PAIRS_PER_EXPERT * E
    assert gpu_schedule(many, E, in_k_columns=IN_K_MAX_COLUMNS) == "in_k"
    assert gpu_schedule(many - 1, E, in_k_columns=IN_K_MAX_COLUMNS) == "dual_stream"        # too few pairs
    assert gpu_schedule(many, E, in_k_columns=IN_K_MAX_COLUMNS + 1) == "dual_stream"        # K widened too much
    assert gpu_schedule(many, E) == "dual_stream"                                           # no pack
    # auto picks only schedules that honour the call: in_k runs no delta join and no LoRA path of the op
    assert gpu_schedule(many, E, in_k_columns=16, join="vllm") == "dual_stream"
    assert gpu_schedule(many, E, in_k_columns=16, lora_path="one_shot") == "dual_stream"
    dev = torch.device(device)
    assert resolve_schedule("auto", dev, num_pairs=many, num_experts=E, in_k_columns=16) == (
        "in_k" if device == "cuda" else "sequential")
    assert resolve_schedule("in_k", dev, in_k_columns=16) == "in_k"
    with pytest.raises(ValueError, match="schedule='in_k' needs the layer packed for it: pass in_k=pack_in_k"):
        resolve_schedule("in_k", dev)


def test_auto_with_a_pack_honours_the_join_and_the_lora_path(device):
    # on a GPU this M has enough pairs per expert for in_k; with the vLLM join or an explicit LoRA path auto must
    # run a schedule that does what was asked (two streams), not pick in_k and then refuse the call
    E = SHAPE.num_experts
    M = IN_K_MIN_PAIRS_PER_EXPERT * E // SHAPE.top_k if device == "cuda" else 6
    p = problem(device, torch.float16, M=M, seed=4)
    inputs, pack = packed_inputs(p)
    want = ml.moe_layer_reference(**p.layer_inputs())
    for extra in (dict(join="vllm"), dict(lora_path="two_kernel")):
        assert_close(ml.moe_lora_layer(**inputs, schedule="auto", in_k=pack, **extra), want, torch.float16)
    for extra, name in ((dict(join="vllm"), "join"), (dict(lora_path="one_shot"), "lora_path")):
        with pytest.raises(ValueError, match=f"^{name}: .* has no meaning with schedule='in_k'"):
            ml.moe_lora_layer(**inputs, schedule="in_k", in_k=pack, **extra)


def test_a_stale_or_foreign_pack_is_refused(device):
    p = problem(device)
    inputs, pack = packed_inputs(p)
    with pytest.raises(ValueError, match="schedule='in_k' needs the layer packed"):
        ml.moe_lora_layer(**inputs, schedule="in_k")
    with pytest.raises(TypeError, match="in_k: expected the InKWeights of pack_in_k"):
        ml.moe_lora_layer(**inputs, in_k=pack.w13_ext)
    with pytest.raises(ValueError, match="w13, w2: not the views in_k holds; pass in_k.w13 and in_k.w2"):
        ml.moe_lora_layer(**p.layer_inputs(), in_k=pack)
    with pytest.raises(ValueError, match="join: 'vllm' has no meaning with schedule='in_k'"):
        ml.moe_lora_layer(**inputs, schedule="in_k", join="vllm", in_k=pack)
    copies = [b.clone() for b in inputs["w2_lora_b"]]
    with pytest.raises(ValueError, match="w13_lora_b, w2_lora_b: not the tensors in_k was packed from"):
        ml.moe_lora_layer(**dict(inputs, w2_lora_b=copies), in_k=pack)
    no_lora = {n: inputs[n] for n in ("x", "topk_ids", "topk_weights", "token_lora", "w13", "w2")}
    with pytest.raises(ValueError, match="in_k: packs the LoRA's B into the base weights, but the call has no LoRA"):
        ml.moe_lora_layer(**no_lora, in_k=pack)
    inputs["w13_lora_b"][1].mul_(2)                     # an adapter slot reloaded in place: the pack is stale
    with pytest.raises(ValueError, match="changed in place since pack_in_k packed them; pack again"):
        ml.moe_lora_layer(**inputs, schedule="in_k", in_k=pack)
    inputs, pack = packed_inputs(p)                      # packed again: runs, and sees the new B
    assert_close(ml.moe_lora_layer(**inputs, schedule="in_k", in_k=pack),
                 ml.moe_layer_reference(**p.layer_inputs()), torch.float32)
