"""Exercises of notebook 05 (where the LoRA goes: the folded join, the deltas' bytes, the schedule that wins).

Shape legend: M tokens, k top-k, P = M*k pairs (p = t*k + j), L adapters, r rank, H hidden, I expert
intermediate; token_lora [M] int32, -1 = no adapter; bf16 = 2 bytes, fp32 = 4.
"""
from __future__ import annotations

import torch

from ..layer.table import AUTO_CPU, AUTO_GPU, AUTO_LARGE, schedule_names
from .core import Exercise, NotDone, Result, compare, out_of_bounds_result, predict_result, register
from .memory import count_memory, excess

PRESET = "qwen3-30b-a3b"


def _fold_inputs(token_lora, k: int, I: int, seed: int):
    """c1 [P, 2I] and delta [P, 2I] fp32; the delta rows of tokens without an adapter are NaN (never written)."""
    g = torch.Generator().manual_seed(seed)
    token_lora = torch.tensor(token_lora, dtype=torch.int32)
    P = token_lora.numel() * k
    c1 = torch.randn(P, 2 * I, generator=g)
    delta = torch.randn(P, 2 * I, generator=g)
    delta[(token_lora < 0).repeat_interleave(k)] = float("nan")
    return c1, delta, token_lora


def _fold_truth(c1, delta, token_lora, k: int):
    """h [P, I] from the library's activation kernel (the folded join), on copies of the inputs."""
    from ..base_moe import silu_and_mul
    h = torch.full((c1.shape[0], c1.shape[1] // 2), float("nan"))
    return silu_and_mul(c1.clone(), h, top_k=k, delta=delta.clone(), token_lora=token_lora)


def _rows_of(rows, token_lora, k: int) -> str:
    """'rows [2, 3] (tokens without an adapter), rows [0] (with one)' for the wrong rows."""
    none = [r for r in rows if token_lora[r // k] < 0]
    some = [r for r in rows if token_lora[r // k] >= 0]
    parts = ([f"rows {none} belong to tokens without an adapter"] if none else []) + \
            ([f"rows {some} to tokens with one"] if some else [])
    return "; ".join(parts)


def _same_bits(a, b) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


# ---- 05.delta_bytes: predict the deltas' round trip -------------------------------------------------

DELTA = dict(M=2048, rank=16)


def _grade_delta_bytes(guess) -> Result:
    from ..config import MoEShape
    from ..plots.design import join_traffic
    from ..plots.traffic import sweep_workload
    from ..profile.traffic import layer_traffic
    qwen, d = MoEShape.from_name(PRESET), DELTA
    st = layer_traffic(qwen, d["rank"], sweep_workload(qwen, d["M"]))
    parts = {"lora_w13 writes d13": st["lora_w13"].part("out_write"), "act reads d13": st["act"].part("d13"),
             "lora_w2 writes d2": st["lora_w2"].part("out_write"), "sum reads d2": st["sum"].part("d2")}
    vllm = join_traffic(qwen, d["M"], "vllm").bytes - join_traffic(qwen, d["M"], "fold").bytes
    res = predict_result("05.delta_bytes", guess, sum(parts.values()), rel=0.10, unit=" B",
                         explain="layer_traffic: " + ", ".join(f"{k} {v:,} B" for k, v in parts.items()))
    return Result(res.passed, res.message, res.details + (
        f"= 2 x P x (2I + H) x b with P = M*k = {d['M'] * qwen.top_k} pairs; vLLM's join (zero-fill, add passes) "
        f"would move {vllm:,} B more",))


DELTA_STUB = '''\
# qwen3-30b-a3b (H = 2048, I = 768, top-k 8), M = 2048 tokens, every token with an adapter, rank 16, bf16.
# With the folded join, how many bytes do the two LoRA deltas move through HBM in one layer: d13 [P, 2I] and
# d2 [P, H], each written once by its LoRA op and read once by the activation / the top-k sum?
# Write your number, then run the check.
delta_bytes_guess = None
'''


# ---- 05.fold_join: the folded join in PyTorch -------------------------------------------------------

FOLD_CASES = (([0, -1, 2, -1, 1, 0], 2, 40, 1),        # (token_lora, k, I, seed)
              ([-1, -1, -1, -1, -1], 3, 24, 2),
              ([3, 1, 0, 2], 2, 16, 3),
              ([-1, 0, 0, -1, -1, 1, 2], 4, 33, 4))


def _grade_fold_join(fn) -> Result:
    for token_lora, k, I, seed in FOLD_CASES:
        c1, delta, tl_ = _fold_inputs(token_lora, k, I, seed)
        want = _fold_truth(c1, delta, tl_, k)
        c1_in, delta_in = c1.clone(), delta.clone()
        h = torch.full_like(want, float("nan"))
        out = fn(c1_in, delta_in, tl_, k, h)
        case = f"token_lora = {token_lora}, top_k = {k}, I = {I}"
        if not _same_bits(c1_in, c1):
            return Result(False, f"05.fold_join: c1 was changed in place ({case}): that is vLLM's add pass; "
                                 f"the folded join reads c1 and the delta and writes only h")
        if not _same_bits(delta_in, delta):
            return Result(False, f"05.fold_join: the delta was changed in place ({case}); write only h")
        if h.isnan().all() and isinstance(out, torch.Tensor) and out.shape == want.shape \
                and torch.allclose(out, want, rtol=1e-4, atol=1e-4):
            return Result(False, "05.fold_join: the values you return are right, but h was never written: "
                                 "write into it (h.copy_(...) or h[:] = ...) and return it")
        wrong = compare("05.fold_join", h, want, what=f"h [P, I] ({case})")
        if wrong:
            rows = [r for r in range(h.shape[0]) if not torch.allclose(h[r], want[r], rtol=1e-4, atol=1e-4)]
            extra = (_rows_of(rows, tl_, k),)
            if any(tl_[r // k] < 0 and h[r].isnan().any() for r in rows):
                extra += ("a token without an adapter has delta rows nobody wrote (NaN here, as torch.empty may "
                          "leave them): select them away (torch.where), do not add or multiply them",)
            return Result(False, wrong.message, wrong.details + extra)
    return Result(True, f"05.fold_join: h right in all {len(FOLD_CASES)} cases, tokens without an adapter "
                        f"included; c1 and the delta left as they were")


FOLD_JOIN_STUB = '''\
import torch
import torch.nn.functional as F


def silu_and_mul_fold(c1, delta, token_lora, top_k, h):
    # h[p] = silu(gate + dg) * (up + du) for pair p = t * top_k + j, the delta added only where token t has
    # an adapter (token_lora[t] >= 0). c1 [P, 2I] = gate | up; delta [P, 2I], its rows for tokens without an
    # adapter never written (any value, NaN included); token_lora [M] int32; h [P, I] to write into.
    # Leave c1 and delta as they are; return h.
    # Plausible, but wrong: it adds every delta row, written or not.
    I = h.shape[1]
    h.copy_(F.silu(c1[:, :I] + delta[:, :I]) * (c1[:, I:] + delta[:, I:]))
    return h
'''


# ---- 05.fold_kernel: a traffic puzzle ---------------------------------------------------------------

FOLD_KERNEL = dict(token_lora=[0, -1, 1, 2, -1, 0, -1, 3], k=3, I=40, BLOCK=64, seed=5)


def _grade_fold_kernel(kernel) -> Result:
    import triton
    f = FOLD_KERNEL
    c1, delta, tl_ = _fold_inputs(f["token_lora"], f["k"], f["I"], f["seed"])
    want = _fold_truth(c1, delta, tl_, f["k"])
    P, I = want.shape
    tmp, h = torch.full_like(c1, float("nan")), torch.full_like(want, float("nan"))
    with count_memory(c1=c1, delta=delta, token_lora=tl_, tmp=tmp, h=h) as mem:
        kernel[(P, triton.cdiv(I, f["BLOCK"]))](c1, delta, tl_, tmp, h, f["k"], I, BLOCK=f["BLOCK"])
    if (oob := out_of_bounds_result("05.fold_kernel", mem)):
        return oob
    wrong = compare("05.fold_kernel", h, want, what="h [P, I]")
    if wrong:
        rows = [r for r in range(P) if not torch.allclose(h[r], want[r], rtol=1e-4, atol=1e-4)]
        extra = (_rows_of(rows, tl_, f["k"]),)
        if any(tl_[r // f["k"]] < 0 and h[r].isnan().any() for r in rows):
            extra += ("the delta rows of tokens without an adapter were never written (NaN here), and 0 x NaN is "
                      "NaN: mask those lanes off in the load (other=0.0) rather than multiplying them away",)
        return Result(False, wrong.message, wrong.details + extra)
    pa = int((tl_ >= 0).sum()) * f["k"]
    one_pass = P * 2 * I * 4                          # the bytes of c1, of delta and of tmp, each read in full once
    targets = [("c1", "load", one_pass, 1, mem.loaded("c1"), one_pass, f"c1 loaded once: P {P} x 2I {2 * I} x 4 B"),
               ("delta", "load", pa * 2 * I * 4, 1, mem.loaded("delta"), pa * 2 * I * 4,
                f"delta loaded only for the {pa} pairs of tokens with an adapter: {pa} x 2I {2 * I} x 4 B"),
               ("tmp", "store", one_pass, 0, mem.stored("tmp"), 0, "tmp never stored: c1 + delta stays in registers"),
               ("tmp", "load", one_pass, 0, mem.loaded("tmp"), 0, "tmp never loaded"),
               ("h", "store", P * I * 4, 1, mem.stored("h"), P * I * 4, f"h stored once: P {P} x I {I} x 4 B")]
    over = [excess(mem, name, kind, once, expected=n) + f" ({why})" for name, kind, once, n, got, target, why
            in targets if got > target]
    fine = [f"{name}: {got:,} B = target ({why})" for name, kind, once, n, got, target, why in targets
            if got <= target]
    report = ("all loads and stores:", *mem.report().splitlines())
    if over:
        more = f" (and {len(over) - 1} more below)" if len(over) > 1 else ""
        return Result(False, f"05.fold_kernel: right answer, but {over[0]}{more}", tuple(over + fine) + report)
    return Result(True, "05.fold_kernel: right answer in one pass: no round trip through tmp, no unwritten "
                        "delta row read, h stored once", tuple(fine) + report)


FOLD_KERNEL_STUB = '''\
import triton
import triton.language as tl


@triton.jit
def fold_act_kernel(c1_ptr, delta_ptr, token_lora_ptr, tmp_ptr, h_ptr, top_k, I, BLOCK: tl.constexpr):
    # h[p] = silu(gate + dg) * (up + du), the delta only where pair p's token has an adapter.
    # c1 [P, 2I] fp32 gate | up; delta [P, 2I] fp32, rows of tokens without an adapter never written;
    # token_lora [M] int32, -1 = no adapter; tmp [P, 2I] fp32 scratch; h [P, I] fp32; all row-major.
    # Program (pair, column tile). Right answer, too many bytes: every delta row is read, and c1 + delta
    # makes a round trip through tmp. Fold the delta in on the way: no tmp, no delta row of a token
    # without an adapter, h stored once.
    pair = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    has = tl.load(token_lora_ptr + pair // top_k) >= 0
    for half in tl.static_range(2):                         # 0: gate, 1: up
        offs = pair * 2 * I + half * I + cols
        c = tl.load(c1_ptr + offs, mask=ok)
        d = tl.load(delta_ptr + offs, mask=ok)
        tl.store(tmp_ptr + offs, c + tl.where(has, d, 0.0), mask=ok)
    gate = tl.load(tmp_ptr + pair * 2 * I + cols, mask=ok)
    up = tl.load(tmp_ptr + pair * 2 * I + I + cols, mask=ok)
    tl.store(h_ptr + pair * I + cols, gate / (1.0 + tl.exp(-gate)) * up, mask=ok)
'''


# ---- 05.schedule_pick: which placement wins, from the committed layer sweep ----------------------------

# the choices are the product rows of the schedule table: sequential, dual_stream, in_k
PICK = dict(rank=64, Ms=(128, 512, 2048), choices=schedule_names("product"))


def _grade_schedule_pick(guess) -> Result:
    from ..results import load
    from .core import revealing
    p = PICK
    if not isinstance(guess, dict) or set(guess) != set(p["Ms"]):
        return Result(False, f"05.schedule_pick: expected a dict with one entry per M, {{{', '.join(f'{M}: ...' for M in p['Ms'])}}}, "
                             f"got {guess!r}")
    if any(v is None for v in guess.values()):
        raise NotDone("some entries are still None: name a schedule for every M")
    bad = [v for v in guess.values() if v not in p["choices"]]
    if bad:
        return Result(False, f"05.schedule_pick: {bad[0]!r} is not one of {', '.join(map(repr, p['choices']))}")
    t = {(r["M"], r["variant"]): r["us_median"] for r in load("layer")
         if r["preset"] == PRESET and r["rank"] == p["rank"]}
    truth = {M: min(p["choices"], key=lambda v: t[M, v]) for M in p["Ms"]}
    wrong = [M for M in p["Ms"] if guess[M] != truth[M]]
    working = tuple(f"M = {M}: " + ", ".join(f"{v} {t[M, v] / t[M, 'no_lora']:.3f}x" for v in p["choices"])
                    + f" of the no-LoRA layer: {truth[M]}" for M in p["Ms"])
    if not wrong:
        return Result(True, f"05.schedule_pick: all {len(p['Ms'])} right (layer.csv, rank {p['rank']})", working)
    hints = {AUTO_CPU: "one stream runs the LoRA kernels after their GEMMs: nothing hides their time",
             AUTO_GPU: "two streams hide the LoRA kernels under the GEMMs, but the deltas still make their "
                       "round trip through HBM",
             AUTO_LARGE: "in_k writes no delta, but its two shrinks run in series with the GEMMs and every pair "
                         "multiplies through all L*r extra K columns"}
    nudges = tuple(f"M = {M}: you said {guess[M]!r}; {hints[guess[M]]}" for M in wrong)
    return Result(False, f"05.schedule_pick: {len(p['Ms']) - len(wrong)} of {len(p['Ms'])} right; not the fastest "
                         f"at M = {', '.join(map(str, wrong))}", working if revealing() else (), nudges=nudges)


PICK_STUB = '''\
# qwen3-30b-a3b, rank 64, L = 4 adapters. Of "sequential" (the LoRA kernels after their GEMMs, deltas added at
# the joins, one stream), "dual_stream" (the same kernels on a second stream) and "in_k" (both LoRA ops in their
# GEMMs' K), which gives the fastest layer at M = 128, 512 and 2048 tokens? Write {M: "schedule"}, then check.
fastest_guess = None
'''

register(
    Exercise("05.fold_join", "05_layer_design", "code", "the folded join in PyTorch: the delta only where "
             "there is an adapter", "silu_and_mul_fold", FOLD_JOIN_STUB, _grade_fold_join,
             hint="Make a mask of pairs with an adapter, `has = (token_lora >= 0).repeat_interleave(top_k)` [P], and "
                  "keep the delta only there: `d = torch.where(has[:, None], delta, torch.zeros_like(delta))` (a "
                  "select, so NaN in the other rows never reaches h). Then `g = c1 + d` and "
                  "`h.copy_(F.silu(g[:, :I]) * g[:, I:])`."),
    Exercise("05.fold_kernel", "05_layer_design", "traffic", "fold the delta into the activation in one pass",
             "fold_act_kernel", FOLD_KERNEL_STUB, _grade_fold_kernel,
             hint="Two costs to look at. tmp: c1 + delta is written and read straight back; does the sum need to "
                  "leave the registers it was computed in? delta: a row of a token without an adapter is read, "
                  "then discarded by tl.where. A load's mask decides which lanes touch memory at all, and its "
                  "`other` what a masked-off lane gives."),
    Exercise("05.delta_bytes", "05_layer_design", "predict", "bytes of the LoRA deltas' round trip at M = 2048",
             "delta_bytes_guess", DELTA_STUB, _grade_delta_bytes,
             hint="P = M x k pairs, all with an adapter. d13 has P rows of 2I values, d2 P rows of H values, "
                  "2 bytes each. The folded join writes each once (the LoRA ops) and reads each once (the "
                  "activation, the top-k sum)."),
    Exercise("05.schedule_pick", "05_layer_design", "predict", "which placement gives the fastest layer at rank 64",
             "fastest_guess", PICK_STUB, _grade_schedule_pick,
             hint="Weigh what each placement pays as M grows. A second stream hides the LoRA kernels' time under "
                  "the base GEMMs while they leave the GPU room; the deltas' round trip grows with the pairs (your "
                  "05.delta_bytes). in_k removes that round trip but puts two shrinks in series with the GEMMs and "
                  "widens their K by L*r = 256 columns at rank 64: it pays only once the deltas outweigh that."),
)
