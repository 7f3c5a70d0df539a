"""moelora_lab.quant.gemm: the FP8 grouped GEMM (w8a8, block scales) on the base GEMM's routing plan, and the
activation quantization kernel.

The GEMM's reference is a float64 matmul of the dequantized operands. Both sides see the same values (a product
of two e4m3 numbers is exact in fp32), so they differ only by the fp32 accumulation: at most ACC_TOL times the
sum of the products' magnitudes (|x| @ |w|^T), plus the rounding to the output dtype. A scale read from the wrong
group, block or expert moves a result by a sizeable fraction of that sum: the operands' magnitudes change every
16 columns over 2^-4 .. 2^4, so neighbouring scales are far apart. On a GPU the tensor cores' FP8 dot keeps
fewer bits than fp32 inside one K step, hence the looser ACC_TOL there.
"""
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from moelora_lab import INTERPRET
from moelora_lab.kernels.base_moe_fp8 import e4m3_bits, quantize_rows_kernel
from moelora_lab.quant import (FP8_DTYPE, FP8Weight, fp8_block_k, fp8_gemm_tiles, moe_gemm_fp8, quantize_activation,
                               quantize_rows, quantize_weight)
from moelora_lab.routing.device import make_blocks
from utils import STRIDED_KINDS, strided

ACC_TOL = {"cpu": 1e-5, "cuda": 1e-3}
E, TOP_K, M, K, N = 6, 2, 13, 200, 136      # K and N multiples of no tile nor scale block
UNUSED = [1, 4]                             # experts no pair routes to: their bytes and scales are NaN
SKIPPED = [2, 7, 12]                        # tokens whose pairs no block holds: their rows must stay NaN
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def spread(shape, seed, low=-4, high=4):
    """Normal values times a power of two from 2^low to 2^high that changes every 16 columns (and per row)."""
    g = torch.Generator().manual_seed(seed)
    *lead, cols = shape
    mag = torch.exp2(torch.randint(low, high + 1, (*lead, -(-cols // 16)), generator=g).float())
    return torch.randn(*shape, generator=g) * mag.repeat_interleave(16, -1)[..., :cols]


def fp8_weight(block_size, device, K=K, seed=1):
    w = quantize_weight(spread((E, N, K), seed, -6, 2), block_size)
    data, scale = w.data.clone(), w.scale.clone()
    data.view(torch.uint8)[UNUSED] = 0x7F                    # e4m3's NaN
    scale[UNUSED] = float("nan")
    return FP8Weight(data.to(device), scale.to(device), w.block_size)


def routing(device, seed=2):
    """topk_ids [M, k] over the used experts, distinct per token; token_lora [M]: -1 for SKIPPED tokens."""
    g = torch.Generator().manual_seed(seed)
    used = torch.tensor([e for e in range(E) if e not in UNUSED])
    ids = torch.stack([used[torch.randperm(len(used), generator=g)[:TOP_K]] for _ in range(M)]).int()
    lora = torch.zeros(M, dtype=torch.int32)
    lora[SKIPPED] = -1
    return ids.to(device), lora.to(device)


def dequantized(w: FP8Weight) -> torch.Tensor:
    """[E, N, K] float64, each element times its block's scale (the test's own index arithmetic)."""
    BN, BK = w.block_size
    n, k = torch.arange(N) // BN, torch.arange(w.shape[2]) // BK
    return w.data.cpu().double() * w.scale.cpu().double()[:, n[:, None], k[None, :]]


def reference(xq, x_scale, w, ids, token_rows, group_size, weights=None):
    """(out, bound) [P, N] float64: each pair's x row times its expert's W^T, and the same in magnitudes."""
    xd = xq.cpu().double() * x_scale.cpu().double()[:, torch.arange(xq.shape[1]) // group_size]
    rows = xd.repeat_interleave(TOP_K, 0) if token_rows else xd
    wd = dequantized(w)[ids.cpu().reshape(-1).long()]
    out, bound = torch.einsum("pk,pnk->pn", rows, wd), torch.einsum("pk,pnk->pn", rows.abs(), wd.abs())
    if weights is not None:
        w64 = weights.cpu().double().reshape(-1, 1)
        out, bound = out * w64, bound * w64.abs()
    return out, bound


def run(device, *, block_size=(48, 64), group_size=64, config=None, token_rows=True, out_dtype=torch.float32,
        mul=False, layout=None, K=K):
    """The GEMM over the routing into a NaN out (a view of a wider NaN buffer with one extra row), checked
    against the reference: rows of SKIPPED tokens and everything outside out still NaN."""
    ids, lora = routing(device)
    P = M * TOP_K
    x = spread((M if token_rows else P, K), seed=3).to(device)
    xq, x_scale = quantize_rows(x, group_size)
    w = fp8_weight(block_size, device, K)
    weights = torch.rand(M, TOP_K, generator=torch.Generator().manual_seed(4)).to(device) if mul else None
    want, bound = reference(xq, x_scale, w, ids, token_rows, group_size, weights)
    if layout is not None:
        xq, x_scale = strided(xq, layout), strided(x_scale, layout)
        w = FP8Weight(strided(w.data, layout), strided(w.scale, layout), w.block_size)
        weights = strided(weights, layout) if mul else None
    block_m = dict(fp8_gemm_tiles(P, E, K, group_size, w.block_size[1]), **(config or {}))["BLOCK_M"]
    blocks = make_blocks(ids, lora, E, 1, block_m)
    buf = torch.full((P + 1, N + 3), float("nan"), dtype=out_dtype, device=device)
    out = moe_gemm_fp8(xq, x_scale, w, blocks, buf[:P, :N], top_k=TOP_K, token_rows=token_rows, topk_weights=weights,
                       mul_routed_weight=mul, config=config, group_size=group_size)
    assert out.data_ptr() == buf.data_ptr()
    buf = buf.cpu().double()
    assert buf[P].isnan().all() and buf[:, N:].isnan().all(), "written outside out (a sentinel row or past N)"
    written = torch.ones(P, dtype=torch.bool)
    written[[t * TOP_K + j for t in SKIPPED for j in range(TOP_K)]] = False
    got = buf[:P, :N]
    assert got[~written].isnan().all(), "a row no block holds was written"
    assert not got[written].isnan().any(), f"{int(got[written].isnan().sum())} elements of held rows not written"
    fin = torch.finfo(out_dtype)
    err = (got - want).abs()[written]
    tol = ACC_TOL[torch.device(device).type] * bound[written] + fin.eps * want.abs()[written] + fin.tiny
    assert (err <= tol).all(), f"error {float((err / tol).max()):.3g} x the tolerance"


CASES = {  # block_size, group_size, config, K
    "blocks 48x64, groups 64, 32-column tiles": ((48, 64), 64, dict(BLOCK_N=32), K),
    "checkpoint 128x128, groups 128, rule tiles": ((128, 128), 128, None, K),
    "per tensor, one scale per row, BLOCK_K 32": (None, 256, dict(BLOCK_K=32), K),
    "blocks 48x64, groups 32, half tiles": ((48, 64), 32, dict(BLOCK_M=16, HALF_TAIL=True), K),
    "blocks 96x128, groups 128, W by TMA": ((96, 128), 128, dict(W_TMA=True, BLOCK_N=64), 208),  # 16-byte rows
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("token_rows", [True, False])
def test_gemm_matches_the_dequantized_matmul(device, case, token_rows):
    block_size, group_size, config, cols = CASES[case]
    if config and config.get("W_TMA") and device == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("W_TMA needs compute capability 9.0")
    run(device, block_size=block_size, group_size=group_size, config=config, token_rows=token_rows,
        mul=not token_rows, K=cols)


@pytest.mark.parametrize("out_dtype", FLOATS, ids=str)
@pytest.mark.parametrize("mul", [False, True])
def test_output_dtypes_and_routed_weights(device, out_dtype, mul):
    run(device, out_dtype=out_dtype, mul=mul)


@pytest.mark.parametrize("layout", STRIDED_KINDS)
def test_strided_operands(device, layout):
    """xq, x_scale, W's bytes and scales, topk_weights as strided views (gaps poisoned); out is one always."""
    run(device, layout=layout, mul=True, token_rows=False)


def _inputs(device):
    ids, lora = routing(device)
    xq, x_scale = quantize_rows(spread((M, K), seed=3).to(device), 64)
    w = fp8_weight((48, 64), device)
    blocks = make_blocks(ids, lora, E, 1, fp8_gemm_tiles(M * TOP_K, E, K, 64, 64)["BLOCK_M"])
    out = torch.empty(M * TOP_K, N, device=device)
    return dict(xq=xq, x_scale=x_scale, w=w, blocks=blocks, out=out, top_k=TOP_K, group_size=64,
                topk_weights=torch.rand(M, TOP_K, device=device), mul_routed_weight=True)


ERRORS = [
    (lambda a: dict(w=a["w"].data), TypeError, r"^w: expected an FP8Weight \(quant.quantize_weight"),
    (lambda a: dict(blocks=a["blocks"].tensors), TypeError, r"^blocks: expected a BlockList"),
    (lambda a: dict(xq=a["xq"].float()), TypeError, r"^xq: dtype torch.float32 is not supported; use one of "
                                                     r"float8_e4m3fn"),
    (lambda a: dict(xq=a["xq"][:-1]), ValueError, r"^xq: expected shape \(13, 200\) \[M, K\] token rows"),
    (lambda a: dict(token_rows=False), ValueError, r"^xq: expected shape \(26, 200\) \[P, K\] pair rows"),
    (lambda a: dict(x_scale=a["x_scale"].half()), TypeError, r"^x_scale: dtype torch.float16 is not supported"),
    (lambda a: dict(x_scale=a["x_scale"][:, :-1]), ValueError, r"^x_scale: expected shape \(13, 4\) \[rows of xq, "
                                                               r"ceil\(K / 64\)\] \(quantize_rows\(x, group_size=64"),
    (lambda a: dict(group_size=128), ValueError, r"^x_scale: expected shape \(13, 2\)"),
    (lambda a: dict(x_scale=a["x_scale"].to("meta")), ValueError, r"^x_scale: is on meta but xq is on"),
    (lambda a: dict(out=a["out"].to(torch.int32)), TypeError, r"^out: dtype torch.int32 is not supported"),
    (lambda a: dict(out=a["out"][:, :-1]), ValueError, r"^out: expected shape \('\*', 136\) \[P, N\]"),
    (lambda a: dict(out=a["out"][:-1]), ValueError, r"^out: 25 rows is not a whole number of tokens of top_k = 2"),
    (lambda a: dict(top_k=0), ValueError, r"^top_k: must be >= 1, got 0"),
    (lambda a: dict(top_k=2.0), TypeError, r"^top_k: expected an int"),
    (lambda a: dict(token_rows="False"), TypeError, r"^token_rows: expected True or False"),
    (lambda a: dict(mul_routed_weight=1), TypeError, r"^mul_routed_weight: expected True or False"),
    (lambda a: dict(group_size=0), ValueError, r"^group_size: must be >= 1, got 0"),
    (lambda a: dict(topk_weights=None), ValueError, r"^topk_weights: mul_routed_weight=True needs the routing "
                                                    r"weights"),
    (lambda a: dict(topk_weights=a["topk_weights"].half()), TypeError, r"^topk_weights: dtype torch.float16"),
    (lambda a: dict(topk_weights=a["topk_weights"][:-1]), ValueError, r"^topk_weights: expected 26 weights"),
    (lambda a: dict(blocks=make_blocks(routing(a["xq"].device)[0][:-1], None, E, 1, 32)), ValueError,
     r"^blocks: built for 12 tokens x top-2 over 6 experts, but out has 26 pair rows"),
    (lambda a: dict(config=dict(BLOCK_M=2 * a["blocks"].block_size)), ValueError,
     r"^blocks: block size (\d+) != BLOCK_M \d+; build them with block_list"),
    (lambda a: dict(x_scale=quantize_rows(torch.randn(M, K, device=a["xq"].device), 48)[1], group_size=48), ValueError,
     r"^group_size: an activation group of 48 columns \(< K = 200\) cannot hold whole K steps: .* power of two >= "
     r"32 columns; quantize x with group_size a multiple of 32 \(default 128\), or group_size >= K"),
    (lambda a: dict(w=quantize_weight(torch.randn(E, N, K, device=a["xq"].device), (128, 80))), ValueError,
     r"^w: a weight scale block \(block_size\[1\]\) of 80 columns .* BK a multiple of 32 such as \(128, 128\) "
     r"\(BN any\), or block_size=None for one scale per expert"),
    (lambda a: dict(config=dict(BLOCK_K=128)), ValueError, r"^config: BLOCK_K = 128 must be a power of two >= 32 "
                                                           r"dividing the activation group \(64\) .*; 64 fits"),
    (lambda a: dict(config=dict(BLOCK_K=16)), ValueError, r"^config: BLOCK_K = 16 must be a power of two >= 32"),
    (lambda a: dict(config=dict(BLOCK_K=48)), ValueError, r"^config: BLOCK_K = 48 must be a power of two"),
    (lambda a: dict(config=dict(BLOCK_KK=32)), ValueError, r"^config: expected a dict of tile values among .*, "
                                                           r"got \['BLOCK_KK'\]"),
    (lambda a: dict(config=dict(W_TMA="yes")), ValueError, r"^config: W_TMA must be True, False or 'auto'"),
    (lambda a: dict(config=dict(HALF_TAIL="yes")), ValueError, r"^config: HALF_TAIL must be True or False"),
]


@pytest.mark.parametrize("change, exc, match", ERRORS,
                         ids=[f"{i}-{e[2][1:].split(':')[0]}" for i, e in enumerate(ERRORS)])
def test_gemm_errors_name_the_argument(device, change, exc, match):
    inputs = _inputs(device)
    with pytest.raises(exc, match=match):
        moe_gemm_fp8(**(inputs | change(inputs)))


def test_block_k_rule():
    assert fp8_block_k(200, 128, 128) == 128 and fp8_block_k(200, 64, 128) == 64
    assert fp8_block_k(200, 96, 128) == 32 and fp8_block_k(200, 128, 160) == 32
    assert fp8_block_k(40, 128, 128) == 64 and fp8_block_k(200, 256, 200) == 128   # periods >= K: no constraint
    assert fp8_block_k(16, 16, 16) == 32     # one K step of 32 covers K = 16: a single group and block
    with pytest.raises(ValueError, match=r"^group_size: an activation group of 16 columns \(< K = 20\)"):
        fp8_block_k(20, 16, 16)              # a step of 32 would straddle two groups
    assert fp8_gemm_tiles(26, E, K, 64, 64)["BLOCK_K"] == 64


# ---- the activation quantization kernel -------------------------------------------------------

def special_rows(K: int, G: int) -> torch.Tensor:
    """Three rows: zero groups around one that is not; -0.0 throughout; groups that open with 448 (scale 1) and go
    on with midpoints of neighbouring e4m3 values (ties: to even) and the floats just above (a carry into the
    exponent) and below them, in turn."""
    pos = torch.arange(0, 127, dtype=torch.uint8).view(FP8_DTYPE).float()
    mids = (pos[:-1] + pos[1:]) / 2
    up, down = torch.nextafter(mids, torch.tensor(1e9)), torch.nextafter(mids, torch.tensor(0.0))
    vals = torch.cat([mids, -mids, up, -up, down])
    rows = torch.zeros(3, K)
    rows[1].fill_(-0.0)
    for start in range(0, K, G):
        width = min(G, K - start)
        rows[2, start] = 448.0
        rows[2, start + 1:start + width] = vals[torch.arange(start, start + width - 1) % len(vals)]
    rows[0, G:2 * G] = spread((1, K), 5)[0, G:2 * G]
    return rows


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("rows, cols, group", [(37, 300, 128), (5, 200, 48), (3, 100, 128), (4, 20, 1)])
def test_quantize_rows_equals_quantize_activation(device, dtype, rows, cols, group):
    """Bit for bit: the bytes of xq and the scales, for K not a multiple of G, G not a power of two, G > K."""
    x = torch.cat([spread((rows, cols), seed=6, low=-12, high=12), special_rows(cols, group)]).to(dtype).to(device)
    xq, scale = quantize_rows(x, group)
    want_q, want_scale = quantize_activation(x, group)
    assert xq.dtype == FP8_DTYPE and xq.shape == x.shape and scale.shape == want_scale.shape
    assert torch.equal(scale, want_scale)
    assert torch.equal(xq.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("layout", STRIDED_KINDS)
def test_quantize_rows_of_a_strided_x(device, layout):
    x = spread((9, 200), seed=7).to(device)
    xq, scale = quantize_rows(strided(x, layout), 64)
    want_q, want_scale = quantize_activation(x, 64)
    assert torch.equal(scale, want_scale) and torch.equal(xq.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("call, exc, match", [
    (lambda: quantize_rows(torch.randn(2, 3, 4)), ValueError, r"^x: expected a 2-D tensor \[M, K\]"),
    (lambda: quantize_rows(torch.ones(2, 4, dtype=torch.int32)), TypeError, r"^x: dtype torch.int32"),
    (lambda: quantize_rows(torch.randn(2, 4), 0), ValueError, r"^group_size: must be >= 1"),
    (lambda: quantize_rows(torch.randn(2, 4), 2.0), TypeError, r"^group_size: expected an int"),
], ids=["3-D x", "int x", "group_size 0", "group_size float"])
def test_quantize_rows_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_quantize_rows_of_nothing():
    xq, scale = quantize_rows(torch.zeros(0, 300))
    assert xq.shape == (0, 300) and scale.shape == (0, 3) and xq.dtype == FP8_DTYPE


@triton.jit
def _encode_kernel(v_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, e4m3_bits(tl.load(v_ptr + offs, mask=offs < n, other=0.0)), mask=offs < n)


def test_e4m3_bits_round_like_torch(device):
    """The integer encoding against torch's cast: every finite e4m3 value, every midpoint and its neighbours
    (ties to even, carries into the exponent, the subnormals), random values over the whole range."""
    g = torch.Generator().manual_seed(8)
    vals = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    vals = vals[~vals.isnan()].sort().values
    mids = (vals[:-1] + vals[1:]) / 2
    v = torch.cat([vals, mids, torch.nextafter(mids, torch.tensor(1e9)), torch.nextafter(mids, torch.tensor(-1e9)),
                   torch.rand(4096, generator=g) * 896 - 448,
                   torch.randn(4096, generator=g) * torch.exp2(torch.randint(-20, -4, (4096,), generator=g).float()),
                   torch.tensor([-0.0, 2.0**-10, -(2.0**-10), 1e-30])]).to(device)
    out = torch.empty(v.numel(), dtype=torch.uint8, device=device)
    _encode_kernel[(triton.cdiv(v.numel(), 1024),)](v, out, v.numel(), BLOCK=1024)
    want = v.to(FP8_DTYPE).view(torch.uint8)
    bad = out != want
    assert not bad.any(), f"{int(bad.sum())} values, e.g. {v[bad][:4].tolist()}: {out[bad][:4].tolist()} != " \
                          f"{want[bad][:4].tolist()}"


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's own FP8 cast")
def test_the_interpreters_fp8_cast_misrounds():
    """Why quantize_rows encodes the bytes itself under the interpreter (EMULATE_FP8): its cast rounds ties away
    from zero and drops a carry into the exponent (31.9 becomes 16). Should this fail, a newer triton casts
    right and EMULATE_FP8 may go."""
    x = torch.tensor([[448.0, 31.9, 17.0, 3 * 2.0**-10]])
    q, scale = torch.empty(1, 4, dtype=FP8_DTYPE), torch.empty(1, 1)
    quantize_rows_kernel[(1,)](x, q, scale, 1, 4, 4, 4, 1, 4, 1, 1, 1, BLOCK_ROWS=1, BLOCK_G=4, EMULATE_FP8=False)
    assert not torch.equal(q.view(torch.uint8), quantize_activation(x, 4)[0].view(torch.uint8))


@pytest.mark.gpu
def test_quantize_rows_on_a_gpu_matches_the_spec_on_both_devices():
    """The native FP8 cast and IEEE divisions on the GPU give the bytes and scales of the spec, which is the same
    on the GPU and the CPU (its scale division is not a multiplication by 1/448 there)."""
    x = spread((64, 384), seed=9, low=-12, high=12).cuda()
    xq, scale = quantize_rows(x)
    for ref in (x, x.cpu()):
        want_q, want_scale = quantize_activation(ref)
        assert torch.equal(scale.cpu(), want_scale.cpu())
        assert torch.equal(xq.view(torch.uint8).cpu(), want_q.view(torch.uint8).cpu())



HOPPER = """
import sys
sys.path.insert(0, sys.argv[1])
from hopper_compile import SHARED_PER_BLOCK, build, resources   # first: it builds kernels for the compiler
from moelora_lab.base_moe import half_tail
from moelora_lab.kernels.base_moe_fp8 import moe_gemm_fp8_kernel, quantize_rows_kernel
from moelora_lab.quant import fp8_gemm_tiles

gemm = dict(xq_ptr="*fp8e4nv", x_scale_ptr="*fp32", w_ptr="*fp8e4nv", w_desc="*fp8e4nv", w_scale_ptr="*fp32",
            out_ptr="*bf16", topk_weights_ptr="*fp32", sorted_pairs_ptr="*i32", block_expert_ptr="*i32")
for pairs in (8, 192, 640, 1600):          # 1, 24, 80, 200 pairs per expert of 8: each tile of the GPU rule
    t = fp8_gemm_tiles(pairs, 8, 4096)
    warps, stages, _ = t.pop("num_warps"), t.pop("num_stages"), t.pop("W_TMA")
    for tma in (False, True):
        desc = dict(w_desc=f"tensordesc<fp8e4nv[{t['BLOCK_N']}, {t['BLOCK_K']}]>") if tma else {}
        c = build(moe_gemm_fp8_kernel, dict(gemm, **desc), dict(t, TOKEN_ROWS=True, MUL_ROUTED_WEIGHT=True,
                  EVEN_K=True, W_TMA=tma, HALF_TAIL=half_tail(t["BLOCK_M"])), warps, stages)
        res = resources(c)
        assert res["stack"] == 0 and c.metadata.shared <= SHARED_PER_BLOCK, (t, tma, res, c.metadata.shared)
        assert "e4m3" in c.asm["ptx"], "the dot does not multiply e4m3 on tensor cores"
        print("ok gemm", pairs, tma, res)
for emulate in (False, True):
    c = build(quantize_rows_kernel, dict(x_ptr="*bf16", xq_ptr="*u8" if emulate else "*fp8e4nv", scale_ptr="*fp32"),
              dict(BLOCK_ROWS=16, BLOCK_G=128, EMULATE_FP8=emulate))
    ptx = c.asm["ptx"]
    assert "div.rn.f32" in ptx and "div.full" not in ptx, "a division is not IEEE"
    assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) != emulate, "the cast is not the native round-to-nearest-even"
    print("ok quantize", emulate)
"""
PTXAS = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton build ships no ptxas")
def test_fp8_kernels_compile_for_hopper():
    """Both kernels built for sm_90 by Triton's own ptxas, no GPU needed: every tile of the rule (W by pointer and
    by TMA) multiplies e4m3 on tensor cores without spilling and fits shared memory; the quantization divides
    with IEEE rounding and casts natively (cvt.rn.satfinite), or not at all with EMULATE_FP8."""
    here = pathlib.Path(__file__).parent
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MOELORA_INTERPRET")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(here.parent), env.get("PYTHONPATH")]))
    res = subprocess.run([sys.executable, "-c", HOPPER, str(here)], capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert res.stdout.count("ok ") == 10, res.stdout
