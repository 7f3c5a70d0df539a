"""Exercises of notebook 10 (a quantized base: the LoRA on FP8 experts).

Shape legend: N out, K in, BN x BK a weight scale block, SN = N / BN, SK = K / BK; G an activation group;
H hidden, I expert intermediate, k top-k.
Every truth comes from the lab: ``quant.quantize_weight`` (the format's spec), ``quant.fp8_codes`` (what a
kernel reads when it takes the FP8 codes for the activation) and ``profile.traffic.layer_traffic`` (the byte
model on an FP8 base).
"""
from __future__ import annotations

import torch

from .core import Result, Exercise, compare, predict_result, register, with_known_misses

NB = "10_quantized_base"

# ---- 10.block_scale: quantize one weight, one scale per block ---------------------------------------------

BLOCK_CASES = (dict(N=8, K=12, block=(4, 4)), dict(N=6, K=6, block=(6, 6)), dict(N=16, K=8, block=(4, 8)))


def _grade_block(fn) -> Result:
    from ..quant.format import FP8_DTYPE, quantize_weight
    if not callable(fn):
        return Result(False, f"10.block_scale: expected a function, got {type(fn).__name__}")
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31 - 1, ())))
    for i, c in enumerate(BLOCK_CASES):
        N, K, (BN, BK) = c["N"], c["K"], c["block"]
        # blocks of very different magnitudes: one scale for the whole weight would flush the small ones
        w = torch.randn(N, K, generator=gen) * torch.logspace(-3, 1, N // BN).repeat_interleave(BN)[:, None]
        want = quantize_weight(w[None], (BN, BK))
        out = fn(w.clone(), (BN, BK))
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            return Result(False, f"10.block_scale: return two tensors (data, scale), got {type(out).__name__}")
        data, scale = out
        what = f"case {i + 1} (w [{N}, {K}], blocks {BN} x {BK})"
        if not isinstance(data, torch.Tensor) or data.dtype != FP8_DTYPE:
            return Result(False, f"10.block_scale: {what}: data must be a float8_e4m3fn tensor "
                                 f"(.to(torch.float8_e4m3fn)), got {getattr(data, 'dtype', type(data).__name__)}")
        if isinstance(scale, torch.Tensor) and scale.shape == want.scale[0].shape:
            if torch.allclose(scale.float(), 1 / want.scale[0], rtol=1e-5):
                return Result(False, f"10.block_scale: {what}: scale is inverted", nudges=(
                    "the scale multiplies the data back (w ≈ data · scale): it is the block's largest magnitude "
                    "over 448, not 448 over it",))
            one = torch.full_like(scale.float(), float(want.scale.max()))       # the whole weight's scale
            if want.scale.numel() > 1 and torch.allclose(scale.float(), one, rtol=1e-5):
                return Result(False, f"10.block_scale: {what}: every block got the whole weight's scale", nudges=(
                    "each (BN, BK) block takes its own largest magnitude: amax over that block alone",))
        wrong = compare("10.block_scale", scale, want.scale[0], what=f"{what}: scale [SN, SK]",
                        rtol=1e-6, atol=0.0, row_name="block row")
        if wrong:
            return wrong
        wrong = compare("10.block_scale", data.float(), want.data[0].float(), what=f"{what}: data [N, K]",
                        row_name="row")
        if wrong:
            return Result(False, wrong.message, wrong.details, nudges=(
                "divide each element by its own block's scale, then .to(torch.float8_e4m3fn)",))
    return Result(True, f"10.block_scale: equals quant.quantize_weight on {len(BLOCK_CASES)} fresh weights whose "
                        "blocks differ a thousandfold in size")


BLOCK_STUB = '''\
import torch


def quantize_blocks(w, block):
    """w [N, K] float32 in FP8 e4m3 with one float32 scale per (BN, BK) block; N and K are multiples of the block.

    Each scale maps its block's largest magnitude onto 448 (the largest e4m3 value), so w ≈ data · scale.
    Returns (data [N, K] torch.float8_e4m3fn, scale [N // BN, K // BK] float32).
    """
    BN, BK = block
    raise NotImplementedError
'''

# ---- 10.code_factor: the LoRA fed the FP8 codes, its scales dropped -------------------------------------

CODES = dict(group=128, amax=3.5)       # one token's activation group and its largest magnitude


def code_factor_truth() -> float:
    """What the codes of a group whose largest magnitude is CODES['amax'] are, as a multiple of the group
    (``quant.fp8_codes`` on a random row of one group, its largest element set to the amax)."""
    from ..quant.reference import fp8_codes
    x = torch.rand(1, CODES["group"], generator=torch.Generator().manual_seed(3)) * 2 - 1
    x[0, 7] = CODES["amax"]
    return float(fp8_codes(x, CODES["group"])[0, 7] / x[0, 7])


def _grade_code_factor(guess) -> Result:
    truth, a = code_factor_truth(), CODES["amax"]
    explain = (f"the group's scale is its largest magnitude over 448: {a} / 448; the codes are x divided by it, so "
               f"the shrink, linear in x, gives T times 448 / {a} = {truth:.4g}")
    res = predict_result("10.code_factor", guess, truth, rel=0.02, explain=explain)
    return with_known_misses(res, guess, {
        1 / truth: "the codes are x divided by the scale, and the scale is small (the group's largest "
                   "magnitude over 448): they are larger than x",
        448.0: "the scale maps the group's largest magnitude onto 448, and that magnitude here is not 1",
        1.0: "the codes are not the activation: they live on the FP8 grid, up to ±448"}, rel=0.02)


CODE_FACTOR_STUB = '''\
# One token's activation, one group of 128 columns, whose largest magnitude is 3.5. A kernel feeds the LoRA
# shrink the FP8 codes of that group (the quantized activation without its scale) instead of the activation.
# The shrink is linear in its input: this token's rank intermediate T comes out as the right T times what?
code_factor_guess = None
'''

# ---- 10.weight_bytes: the base weights one decode token reads -------------------------------------------

WEIGHTS = dict(shape="qwen3-30b-a3b", block=(128, 128))


def weight_bytes_truth() -> tuple[float, dict]:
    """(bytes of the FP8 base weights with their block scales one token reads, the quantities behind it):
    ``layer_traffic(base="fp8")``'s floor at M = 1, where the token's k experts are the touched ones."""
    from ..config import MoEShape
    from ..profile.traffic import Workload, layer_traffic
    s = MoEShape.from_name(WEIGHTS["shape"])
    wl = Workload(num_tokens=1, top_k=s.top_k, tokens_with_adapter=0, pairs_with_adapter=0,
                  touched_adapter_experts=0, touched_experts=s.top_k)
    floor = layer_traffic(s, 16, wl, base="fp8", with_lora=False, fp8_block=WEIGHTS["block"])["floor"]
    return float(floor.part("base_weights")), dict(H=s.hidden, I=s.intermediate, k=s.top_k, E=s.num_experts)


def _grade_weight_bytes(guess) -> Result:
    truth, q = weight_bytes_truth()
    H, I, k, E = q["H"], q["I"], q["k"], q["E"]
    BN, BK = WEIGHTS["block"]
    elems = 3 * I * H
    scales = (2 * I // BN) * (H // BK) + (H // BN) * (I // BK)
    explain = (f"each of the token's {k} experts holds w13 [2I, H] = [{2 * I}, {H}] and w2 [H, I] = [{H}, {I}]: "
               f"{elems:,} one-byte elements and {scales} four-byte block scales; {k} · ({elems:,} + 4 · {scales}) "
               f"= {truth:,.0f} bytes (the scales are {4 * scales / elems:.3%} of it)")
    res = predict_result("10.weight_bytes", guess, truth, rel=0.03, unit=" B", explain=explain)
    return with_known_misses(res, guess, {
        2 * k * elems: "that is the bf16 base: an FP8 element is one byte",
        k * 2 * I * H: "that is two I·H matrices per expert: w13 [2I, H] holds gate and up, and w2 [H, I] is "
                       "read too",
        E * elems: "a token reads only its k experts' weights, not all E",
        elems: "the token is routed to k experts, each with its own weights"}, rel=0.03)


WEIGHT_BYTES_STUB = '''\
# qwen3-30b-a3b: H = 2048 hidden, I = 768 expert intermediate, 128 experts, top_k = 8. Its FP8 base: w13
# [2I, H] and w2 [H, I] per expert, one byte per element, one float32 scale per 128 x 128 block.
# How many bytes of base weights (scales included) does one decode token (M = 1) read? Write a number, then check.
weight_bytes_guess = None
'''

register(
    Exercise("10.block_scale", NB, "code", "quantize one weight, one scale per block",
             "quantize_blocks", BLOCK_STUB, _grade_block,
             hint="View w as [N // BN, BN, K // BK, BK]; the largest magnitude over dims 1 and 3 gives amax "
                  "[SN, SK]; scale = amax / 448; divide each block by its scale (broadcast [SN, 1, SK, 1]), clamp "
                  "to ±448 and cast with .to(torch.float8_e4m3fn); reshape the data back to [N, K]."),
    Exercise("10.code_factor", NB, "predict", "the LoRA fed the FP8 codes, their scales dropped",
             "code_factor_guess", CODE_FACTOR_STUB, _grade_code_factor,
             hint="The group's scale maps its largest magnitude, 3.5, onto 448, so scale = 3.5 / 448. The codes "
                  "are x / scale."),
    Exercise("10.weight_bytes", NB, "predict", "the base weights one decode token reads",
             "weight_bytes_guess", WEIGHT_BYTES_STUB, _grade_weight_bytes,
             hint="One token reads its k experts' w13 and w2: 3·I·H elements each, one byte apiece in FP8, plus "
                  "a four-byte scale per 128 x 128 block (count the blocks: (2I/128)·(H/128) + (H/128)·(I/128))."),
)
