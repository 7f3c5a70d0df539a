"""The LoRA op's backward (``op.grad``, ``op.grad_paths``): every path against the spec, the autograd Function,
gradcheck (CPU interpreter, or CUDA with --gpu; bf16 against fp32 autograd of the spec on a GPU only)."""
from __future__ import annotations

import pytest
import torch

import moelora_lab as ml
from moelora_lab.op.dispatch import KernelConfig
from moelora_lab.routing import block_list, naive_block_list
from moelora_lab.op.grad import GRAD_PATHS, lora_with_grad, moe_lora_backward, spec_forward
from moelora_lab.op.grad_paths import group_table
from moelora_lab.reference import LoRAGrads, effective_lora, moe_lora_backward_reference
from utils import assert_close, poisoned_allocations, strided

TRITON_GRAD_PATHS = [n for n, p in GRAD_PATHS.items() if p.triton]
NAN = float("nan")
NATIVE_BF16 = "bf16 runs natively on a GPU only; the interpreter upcasts it to fp32 (test_half_precision)"


def case(M=13, k=2, r=5, K=24, N=20, S=2, *, pair_rows=False, mul=False, dtype=torch.float32, seed=0,
         ranks=(5, 3, 0, 5, 5), device="cpu"):
    """Fresh random inputs with L = 5 slots: slot 1 cut to rank 3, slot 2 to rank 0, slot 3 disabled, slot 4
    used by no token; expert E-1 reached by no pair; a quarter of the tokens without an adapter. NaN fills
    every weight nothing may read (those slots, that expert, ranks past each slot's rank). Drawn on the CPU,
    then moved to ``device``: the device does not change the values."""
    g = torch.Generator().manual_seed(seed)
    L, E = 5, 4
    x = torch.randn(M * k if pair_rows else M, K, generator=g)
    topk_ids = torch.randint(0, E - 1, (M, k), generator=g, dtype=torch.int32)
    token_lora = torch.randint(0, 4, (M,), generator=g, dtype=torch.int32)
    token_lora[torch.rand(M, generator=g) < 0.25] = -1
    lora_ranks = torch.tensor(ranks, dtype=torch.int32)
    a = [torch.randn(L, E, r, K, generator=g) / K ** 0.5 for _ in range(S)]
    b = [torch.randn(L, E, N, r, generator=g) for _ in range(S)]
    for w, rank_dim in [(w, 2) for w in a] + [(w, 3) for w in b]:
        w[3:] = NAN                                          # disabled, unused
        w[:, E - 1] = NAN                                    # no pair reaches it
        for slot, rank in enumerate(ranks):
            w[slot].narrow(rank_dim - 1, rank, r - rank).fill_(NAN)
    floats = dict(x=x.to(dtype), lora_a=[w.to(dtype) for w in a], lora_b=[w.to(dtype) for w in b],
                  grad_out=torch.randn(M, k, S * N, generator=g).to(dtype))
    rest = dict(topk_ids=topk_ids, topk_weights=torch.rand(M, k, generator=g), token_lora=token_lora,
                lora_ranks=lora_ranks, enabled=torch.tensor([True, True, True, False, True]))
    return {n: [w.to(device) for w in v] if isinstance(v, list) else v.to(device)
            for n, v in (floats | rest).items()} | dict(mul_routed_weight=mul)


def spec(inp):
    f32 = {n: ([w.float() for w in v] if isinstance(v, list) else v.float() if n in ("x", "grad_out") else v)
           for n, v in inp.items()}
    return moe_lora_backward_reference(**f32)


def autograd_spec(inp) -> LoRAGrads:
    """torch.autograd of ``moe_lora_reference`` in float32 from ``inp``'s values (16-bit ones as they were
    rounded): disabled slots as no adapter, weights past each slot's rank and NaN nothing may read as zeros."""
    S, r = len(inp["lora_a"]), inp["lora_a"][0].shape[2]
    x = inp["x"].float().detach().requires_grad_()              # new leaves: the caller's tensors stay as they are
    w = inp["topk_weights"].float().detach().requires_grad_()
    a = [torch.nan_to_num(t.float(), nan=0.0).requires_grad_() for t in inp["lora_a"]]
    b = [torch.nan_to_num(t.float(), nan=0.0).requires_grad_() for t in inp["lora_b"]]
    keep = (torch.arange(r, device=x.device) < inp["lora_ranks"][:, None]).float()             # [L, r]
    out = ml.moe_lora_reference(x, inp["topk_ids"], w, effective_lora(inp["token_lora"], inp.get("enabled")),
                                [t * keep[:, None, :, None] for t in a], [t * keep[:, None, None, :] for t in b],
                                mul_routed_weight=inp["mul_routed_weight"])
    grads = torch.autograd.grad(out, [x, w, *a, *b], inp["grad_out"].float(), allow_unused=True)
    return LoRAGrads(grads[0], grads[1] if inp["mul_routed_weight"] else None, list(grads[2:2 + S]),
                     list(grads[2 + S:]))


def check(got, want, dtype, mul):
    assert_close(got.x, want.x, dtype)
    if mul:
        assert_close(got.topk_weights, want.topk_weights, dtype)
    else:
        assert got.topk_weights is None
    for g, w in zip(got.lora_a + got.lora_b, want.lora_a + want.lora_b):
        assert g.shape == w.shape and g.dtype == torch.float32
        assert_close(g, w, dtype)


def small(device, **kw):
    """Tiles smaller than K = 24 and N = 20, blocks of 16 pairs (one warp and one stage on the interpreter)."""
    base = dict(block_m=16, block_n=16, block_k=16, block_r=16)
    if device == "cpu":
        base |= dict(num_warps=1, num_stages=1)
    return KernelConfig(**(base | kw))


CASES = {   # name: (inputs, tiles: keywords of small(), or None for the default tiles)
    "w13_token_rows": (dict(), {}),
    "w2_pair_rows_weighted": (dict(S=1, pair_rows=True, mul=True, seed=1), {}),
    "three_slices_two_rank_tiles": (dict(S=3, mul=True, r=20, ranks=(20, 17, 0, 20, 20), seed=2),
                                    dict(block_n=32, block_k=32)),
    "k1_default_tiles": (dict(M=9, k=1, mul=True, seed=3), None),
}


def case_and_blocks(name, device, dtype=torch.float32):
    """(inputs, blocks or None, config or None) of CASES[name] on ``device``."""
    kw, tiles = CASES[name]
    inp = case(**kw, dtype=dtype, device=device)
    if tiles is None:
        return inp, None, None
    return inp, block_list(inp["topk_ids"], inp["token_lora"], 4, 5, 16), small(device, **tiles)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("path", list(GRAD_PATHS))
def test_every_path_against_the_spec(device, path, name):
    inp, blocks, cfg = case_and_blocks(name, device)
    with poisoned_allocations():               # dA, dB and T, dT are allocated uninitialised: NaN if unwritten
        got = moe_lora_backward(**inp, path=path, blocks=blocks, config=cfg)
    check(got, spec(inp), torch.float32, inp["mul_routed_weight"])
    has = (inp["token_lora"] >= 0) & inp["enabled"][inp["token_lora"].clamp(min=0).long()]
    rows = has if inp["x"].shape[0] == has.numel() else has.repeat_interleave(inp["topk_ids"].shape[1])
    rank1 = int(inp["lora_ranks"][1])
    assert torch.all(got.x[~rows] == 0) and not got.lora_a[0][1, :, rank1:].any() and not got.lora_b[0][2].any()


@pytest.mark.parametrize("path", TRITON_GRAD_PATHS)
def test_bfloat16_against_float32_autograd_of_the_spec(device, path):
    """On a GPU every case in bf16 (NaN where nothing may read) against fp32 autograd of the forward spec."""
    if device != "cuda":
        pytest.skip(NATIVE_BF16)
    for name in CASES:
        inp, blocks, cfg = case_and_blocks(name, device, torch.bfloat16)
        with poisoned_allocations():
            got = moe_lora_backward(**inp, path=path, blocks=blocks, config=cfg)
        check(got, autograd_spec(inp), torch.bfloat16, inp["mul_routed_weight"])


def test_bfloat16_at_a_real_shape(device):
    """qwen3-30b-a3b's layer (H 2048, I 768, 128 experts, top-8), 64 tokens, two adapters of rank 16 (one cut
    to 9): w13's op (token rows, two slices) and w2's (pair rows, weighted), every Triton path, default tiles."""
    if device != "cuda":
        pytest.skip(NATIVE_BF16 + "; this shape is too large for it")
    p = ml.make_problem("qwen3-30b-a3b", ml.LoRAShape(2, 16), 64, dtype=torch.bfloat16, device=device, seed=13,
                        with_base=False, adapter_ranks=(16, 9), no_adapter_fraction=0.25)
    g = torch.Generator().manual_seed(14)
    (M, k), H, I = p.topk_ids.shape, p.shape.hidden, p.shape.intermediate

    def bf16(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=torch.bfloat16)
    for mul, x, a, b, n_out in ((False, p.x, p.w13_lora_a, p.w13_lora_b, 2 * I),
                                (True, bf16(M * k, I), p.w2_lora_a, p.w2_lora_b, H)):
        inp = dict(x=x, topk_ids=p.topk_ids, topk_weights=p.topk_weights, token_lora=p.token_lora, lora_a=list(a),
                   lora_b=list(b), grad_out=bf16(M, k, n_out), mul_routed_weight=mul,
                   lora_ranks=torch.tensor([16, 9], dtype=torch.int32, device=device))
        want = autograd_spec(inp)
        for path in TRITON_GRAD_PATHS:
            check(moe_lora_backward(**inp, path=path), want, torch.bfloat16, mul)


@pytest.mark.parametrize("how, path", list(zip(["gapped", "transposed", "padded"], TRITON_GRAD_PATHS)))
def test_strided_views(device, how, path):
    """x, A, B and the gradient as views of other layouts; B packed N-fastest gives dB in B's shape."""
    inp = case(seed=4 + len(how), mul=True, device=device)
    views = dict(inp, x=strided(inp["x"], how), grad_out=strided(inp["grad_out"], how),
                 lora_a=[strided(w, how) for w in inp["lora_a"]],
                 lora_b=ml.pack_lora_b(inp["lora_b"]) if how == "transposed" else [strided(w, how) for w in inp["lora_b"]])
    check(moe_lora_backward(**views, path=path), spec(inp), torch.float32, True)


@pytest.mark.parametrize("path", TRITON_GRAD_PATHS[:2])
def test_two_runs_are_bit_identical(device, path):
    """Both (adapter, expert) groups hold 20 pairs, two blocks of 16: the sums over them have an order."""
    inp = case(M=20, seed=5, mul=True, device=device)
    inp["topk_ids"][:] = torch.tensor([0, 1], dtype=torch.int32, device=device)
    inp["token_lora"].zero_()
    blocks = block_list(inp["topk_ids"], inp["token_lora"], 4, 5, 16)
    assert blocks.block_lora.tolist()[:5] == [0, 0, 0, 0, -1]
    one, two = (moe_lora_backward(**inp, path=path, blocks=blocks) for _ in range(2))
    for g1, g2 in zip([one.x, one.topk_weights] + one.lora_a + one.lora_b,
                      [two.x, two.topk_weights] + two.lora_a + two.lora_b):
        assert torch.equal(g1, g2)
    check(one, spec(inp), torch.float32, True)


@pytest.mark.parametrize("dtype, path", [(torch.float16, "two_kernel"), (torch.bfloat16, "one_shot")])
def test_half_precision(device, dtype, path):
    inp = case(dtype=dtype, seed=6, mul=True, pair_rows=True, device=device)
    check(moe_lora_backward(**inp, path=path), spec(inp), dtype, True)


def test_unsorted_block_list_and_group_table(device):
    """The naive list (one pair per block, in pair order) puts a group's blocks apart: the table gathers them."""
    inp = case(M=5, seed=7, device=device)
    blocks = naive_block_list(inp["topk_ids"], inp["token_lora"], 4, 5, 16)
    groups, order = group_table(blocks, 4, inp["lora_ranks"])
    keys = (blocks.block_lora.long() * 4 + blocks.block_expert.long())[order.long()]
    used = int((blocks.block_lora >= 0).sum())
    assert torch.all(keys[:used].diff() >= 0) and groups[-1, 3] == used and groups[:, 1].tolist()[::4] == [5, 3, 0, 5, 5]
    for path in TRITON_GRAD_PATHS[:2]:
        check(moe_lora_backward(**inp, path=path, blocks=blocks), spec(inp), torch.float32, False)


def test_only_the_gradients_asked_for(device):
    inp = case(seed=8, mul=True, device=device)
    got = moe_lora_backward(**inp, path="one_shot", needs=["x"])
    assert got.topk_weights is None and got.lora_a is None and got.lora_b is None
    assert_close(got.x, spec(inp).x, torch.float32)
    got = moe_lora_backward(**inp, path="two_kernel", needs=["lora_b", "topk_weights"])
    assert got.x is None and got.lora_a is None
    assert_close(got.lora_b[1], spec(inp).lora_b[1], torch.float32)


@pytest.mark.parametrize("path", list(GRAD_PATHS))
@pytest.mark.parametrize("pair_rows", [False, True])
def test_dx_rows_receive_each_pairs_gradient(path, pair_rows, device):
    """dx_rows: x's gradient added into the caller's pair rows (not summed over k); the rows' sum over k
    is the gradient, the other gradients are unchanged, and what the rows held stays added."""
    inp = case(seed=9, mul=True, pair_rows=pair_rows, device=device)
    M, k = inp["topk_ids"].shape
    held = torch.randn(M * k, inp["x"].shape[1], device=device)
    rows = held.clone()
    got = moe_lora_backward(**inp, path=path, dx_rows=rows)
    want = spec(inp)
    assert got.x is rows
    summed = (rows - held) if pair_rows else (rows - held).view(M, k, -1).sum(1)
    assert_close(summed, want.x, torch.float32)
    assert_close(got.lora_a[0], want.lora_a[0], torch.float32)
    with pytest.raises(ValueError, match="dx_rows: given, but needs leaves out 'x'"):
        moe_lora_backward(**inp, path=path, dx_rows=rows, needs=["lora_a"])
    with pytest.raises(TypeError, match="dx_rows"):
        moe_lora_backward(**inp, path=path, dx_rows=rows.half())


def test_no_tokens_and_rank_zero(device):
    for inp in (case(M=0, seed=9, device=device), case(r=0, ranks=(0,) * 5, seed=9, device=device)):
        for path in GRAD_PATHS:
            got = moe_lora_backward(**inp, path=path)
            assert got.x.shape == inp["x"].shape and not got.x.any() and not got.lora_b[1].any()


def test_errors_name_the_argument(device):
    inp = case(seed=10, device=device)
    with pytest.raises(ValueError, match="^path: 'three_kernel' is not one of"):
        moe_lora_backward(**inp, path="three_kernel")
    with pytest.raises(ValueError, match=r"^needs: \['dy'\] not among"):
        moe_lora_backward(**inp, needs=["x", "dy"])
    with pytest.raises(TypeError, match=r"^lora_a\[0\]: dtype torch.float64; path 'one_shot' takes x, A and B in one"):
        moe_lora_backward(**dict(inp, lora_a=[w.double() for w in inp["lora_a"]],
                                 lora_b=[w.double() for w in inp["lora_b"]]), path="one_shot")
    with pytest.raises(ValueError, match=r"^grad_out: expected shape"):
        moe_lora_backward(**dict(inp, grad_out=inp["grad_out"][:, :1]))


def test_float64_takes_the_spec(device):
    """'auto' gives float64 inputs to the spec on both devices; on a GPU a named Triton path refuses them (the
    interpreter runs them in float64: the gradient checks below)."""
    inp = {n: [w.double() for w in v] if n in ("lora_a", "lora_b") else v.double() if n in ("x", "grad_out") else v
           for n, v in case(seed=13, mul=True, device=device).items()}
    got, want = moe_lora_backward(**inp), moe_lora_backward_reference(**inp)
    assert got.x.dtype == torch.float64
    for g, w in zip([got.x, got.topk_weights] + got.lora_a + got.lora_b,
                    [want.x, want.topk_weights] + want.lora_a + want.lora_b):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)     # CUDA's index_add_ adds in any order
    if device == "cuda":
        for path in TRITON_GRAD_PATHS:
            with pytest.raises(TypeError, match=rf"^x: dtype torch.float64; path '{path}' takes x, A and B in one of "
                                                r"torch.float32, torch.float16, torch.bfloat16; use path='reference'"):
                moe_lora_backward(**inp, path=path)


def _tiny(seed, pair_rows=True, device="cpu"):
    """float64 inputs small enough for finite differences (no NaN: gradcheck perturbs every element)."""
    inp = case(M=3, k=2, r=3, K=4, N=3, S=2, pair_rows=pair_rows, mul=True, seed=seed, ranks=(3, 2, 0, 3, 3),
               device=device)
    inp["enabled"][:] = True
    inp["token_lora"] = torch.tensor([0, 1, -1], dtype=torch.int32, device=device)
    for n in ("x", "topk_weights", "grad_out"):
        inp[n] = inp[n].double()
    for n in ("lora_a", "lora_b"):
        inp[n] = [torch.nan_to_num(w.double(), nan=0.5).requires_grad_() for w in inp[n]]
    inp["x"].requires_grad_()
    inp["topk_weights"].requires_grad_()
    return inp


@pytest.mark.parametrize("path", list(GRAD_PATHS))
def test_gradcheck_float64(device, path):
    """The Triton paths take float64 on the interpreter: gradcheck them too (fast mode: one projection)."""
    if device == "cuda" and GRAD_PATHS[path].triton:
        pytest.skip("on a GPU the Triton paths refuse float64 (test_float64_takes_the_spec); the interpreter runs them")
    inp = _tiny(11, pair_rows=path != "one_shot", device=device)
    rest = {n: inp[n] for n in ("topk_ids", "token_lora", "lora_ranks", "enabled", "mul_routed_weight")}

    def f(x, w, a0, a1, b0, b1):
        return lora_with_grad(spec_forward, x, rest["topk_ids"], w, rest["token_lora"], [a0, a1], [b0, b1],
                              grad_path=path, **{n: rest[n] for n in ("mul_routed_weight", "lora_ranks", "enabled")})
    args = (inp["x"], inp["topk_weights"], *inp["lora_a"], *inp["lora_b"])
    assert torch.autograd.gradcheck(f, args, fast_mode=GRAD_PATHS[path].triton, atol=1e-7, rtol=1e-6)


def test_moe_lora_backward_through_autograd(device):
    """moe_lora with inputs that require grad records itself; .backward() fills .grad in each input's dtype,
    B packed N-fastest gets a gradient in its shape, and inputs without requires_grad get none."""
    inp = case(seed=12, mul=True, pair_rows=True, S=1, device=device)
    want = spec(inp)
    grad_out = inp.pop("grad_out")
    x = inp["x"].clone().requires_grad_()
    w = inp["topk_weights"].clone().requires_grad_()
    a = [t.clone().requires_grad_() for t in inp["lora_a"]]
    b = ml.pack_lora_b([t.clone() for t in inp["lora_b"]])
    out = ml.moe_lora(**dict(inp, x=x, topk_weights=w, lora_a=a, lora_b=b))
    assert out.requires_grad
    out.backward(grad_out)
    assert b[0].grad is None and x.grad.dtype == x.dtype
    for got, ref in ((x.grad, want.x), (w.grad, want.topk_weights), (a[0].grad, want.lora_a[0])):
        assert_close(got, ref, torch.float32)
    with torch.no_grad():
        assert torch.equal(out, ml.moe_lora(**dict(inp, lora_b=b)))
    b2 = [t.clone().requires_grad_() for t in b]
    ml.moe_lora(**dict(inp, lora_b=b2), path="reference").backward(grad_out)
    assert b2[0].grad.shape == b[0].shape
    assert_close(b2[0].grad, want.lora_b[0], torch.float32)
    # output= and add_inputs=False under autograd: the delta lands in output by a recorded add or copy
    base = torch.randn(grad_out.shape, device=grad_out.device)
    for add in (True, False):
        x3 = inp["x"].clone().requires_grad_()
        out = ml.moe_lora(**dict(inp, x=x3, lora_b=b), output=base.clone(), add_inputs=add)
        with torch.no_grad():
            plain = ml.moe_lora(**dict(inp, lora_b=b), output=base.clone(), add_inputs=add)
        assert_close(out, plain, torch.float32)
        out.backward(grad_out)
        owned = (inp["token_lora"] >= 0) & inp["enabled"][inp["token_lora"].clamp(min=0).long()]
        assert_close(x3.grad, want.x, torch.float32)            # only owned rows carry a delta: the same grad
        assert torch.equal(out[~owned], base[~owned])            # rows of tokens without an adapter untouched
    with pytest.raises(TypeError, match="add_inputs"):
        ml.moe_lora(**dict(inp, x=x), add_inputs=None)


def test_poisoned_allocations_reach_the_device(device):
    """The NaN checks above rest on this helper: on the test's device, what torch.empty, torch.empty_like and
    Tensor.new_empty give inside the block is poisoned (NaN, the sentinel -7, False), and nothing after it."""
    saved = torch.empty, torch.empty_like, torch.Tensor.new_empty
    with poisoned_allocations():
        floats = torch.empty(5, 3, device=device)
        ints = torch.empty(4, dtype=torch.int32, device=device)
        flags = torch.empty_like(ints, dtype=torch.bool)
        halves = floats.new_empty(6, dtype=torch.bfloat16)
        none = torch.empty(0, device=device)
    assert all(t.device.type == torch.device(device).type for t in (floats, ints, flags, halves, none))
    assert torch.isnan(floats).all() and torch.isnan(halves.float()).all() and none.numel() == 0
    assert (ints == -7).all() and not flags.any()
    assert (torch.empty, torch.empty_like, torch.Tensor.new_empty) == saved
