"""Exercises of notebook 07 (real adapters: PEFT's fused-3D MoE LoRA in the lab's layout).

Shape legend: E experts, r rank, K in, N out, H hidden, I expert intermediate; L adapters (slots).
PEFT's fused layout: lora_A [E*r, K], row e*r + i; lora_B [N, r*E], column i*E + e. The lab's: A [E, r, K],
B [E, N, r] per slot, the scaling folded into B. Every truth comes from ``moelora_lab.adapters.load_peft``
run on a synthetic adapter (a ``(state_dict, config)`` pair, as PEFT's ``save_pretrained`` writes it).
"""
from __future__ import annotations

import math

import torch

from .core import Exercise, Result, compare, predict_result, register, revealing

NB = "07_adapters"
PREFIX = "model.layers.0.mlp.experts"


def _fused_adapter(E: int, r: int, H: int, I: int, *, alpha: float, rslora: bool = False, seed: int = 0):
    """A random fused-3D adapter of one MoE layer as (state_dict, config): gate_up_proj's pair nested
    inside (``experts.base_layer.``), down_proj's outside (``experts.``)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {f"{PREFIX}.base_layer.lora_A.weight": torch.randn(E * r, H, generator=g),       # gate_up A
               f"{PREFIX}.base_layer.lora_B.weight": torch.randn(2 * I, r * E, generator=g),   # gate_up B
               f"{PREFIX}.lora_A.weight": torch.randn(E * r, I, generator=g),                  # down A
               f"{PREFIX}.lora_B.weight": torch.randn(H, r * E, generator=g)}                  # down B
    config = dict(peft_type="LORA", r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=[],
                  target_parameters=["experts.down_proj", "experts.gate_up_proj"])
    return tensors, config


def _loaded(tensors: dict, config: dict) -> dict:
    """load_peft's layer: {"gate_up": (A [E, r, H], B [E, 2I, r]), "down": (A [E, r, I], B [E, H, r])}."""
    from ..adapters import load_peft
    w = load_peft((tensors, config), pack=False)[PREFIX]
    gate_b, up_b = (b[0] for b in w["w13_lora_b"])
    return {"gate_up": (w["w13_lora_a"][0][0], torch.cat([gate_b, up_b], dim=1)),
            "down": (w["w2_lora_a"][0][0], w["w2_lora_b"][0][0])}


# ---- 07.b_column: predict where PEFT keeps (expert e, rank i) in lora_B ----------------------------

B_COLUMN = dict(shape="qwen3-30b-a3b", r=16, expert=37, rank_index=3)


def _b_column_truth() -> tuple[int, int, int]:
    """(column, E, r): load_peft on a down_proj lora_B whose column c holds the number c."""
    from ..config import MoEShape
    c = B_COLUMN
    E, r = MoEShape.from_name(c["shape"]).num_experts, c["r"]
    tensors, config = _fused_adapter(E, r, 2, 1, alpha=r)                 # scaling 1; K and N as small as can be
    numbered = torch.arange(r * E, dtype=torch.float32)                   # exact in fp32
    tensors[f"{PREFIX}.lora_B.weight"] = numbered.expand(2, r * E).clone()
    B = _loaded(tensors, config)["down"][1]                               # [E, N, r]
    return int(B[c["expert"], 0, c["rank_index"]]), E, r


def _grade_b_column(guess) -> Result:
    column, E, r = _b_column_truth()
    e, i = B_COLUMN["expert"], B_COLUMN["rank_index"]
    number = isinstance(guess, (int, float)) and not isinstance(guess, bool) and math.isfinite(guess)
    if not number or guess != int(guess):
        return Result(False, f"07.b_column: expected a column index (an integer), got {guess!r}")
    guess = int(guess)
    explain = (f"lora_B [N, r·E] is rank-major: the E = {E} columns of rank 0 (one per expert) come first, then "
               f"rank 1's, ...: column i·E + e = {i}·{E} + {e} = {column}")
    if guess == column:
        return Result(True, f"07.b_column: column {guess}: exact", (explain,))
    nudges = ()
    if guess == e * r + i:
        nudges += (f"{guess} = e·r + i is where lora_A keeps it (row e·r + i, expert-major); lora_B's columns run "
                    "the other way",)
    elif guess == i * r + e or guess == e * E + i:
        nudges += (f"{guess} mixes the two orders: the stride between ranks of one expert is E = {E}, and "
                    "experts sit next to each other",)
    way = f"{abs(guess - column)} column{'s' if abs(guess - column) > 1 else ''} too {'high' if guess > column else 'low'}"
    shown = f", the column is {column}" if revealing() else ""
    return Result(False, f"07.b_column: your column {guess}: {way}{shown}", (explain,), nudges=nudges)


B_COLUMN_STUB = '''\
# qwen3-30b-a3b has E = 128 experts. A PEFT adapter of rank r = 16 on its experts.down_proj saves
# lora_B as one matrix [N, r*E]. Which column (0-based) holds rank i = 3 of expert e = 37?
# Write the column index, then run the check.
b_column_guess = None
'''

# ---- 07.convert_fused: one fused PEFT pair -> the lab's per-expert A and B ----------------------------

CONVERT_CASES = (dict(E=4, r=3, H=8, I=6, alpha=6),                      # (E, r, H, I, alpha, rslora)
                 dict(E=3, r=5, H=6, I=4, alpha=10, rslora=True),
                 dict(E=6, r=2, H=5, I=7, alpha=1))


def _diagnose(ex_id: str, what: str, got, want, lora_A, lora_B, E: int, scaling: float) -> Result | None:
    """None when (A, B) = ``got`` equals ``want``; else a Result naming the bug when it is a known one."""
    (a, b), (wa, wb) = got, want
    r = lora_A.shape[0] // E
    for name, value, ref in (("A", a, wa), ("B", b, wb)):
        if not isinstance(value, torch.Tensor):
            return Result(False, f"{ex_id}: {what}: {name} should be a torch.Tensor, got {type(value).__name__}")
        if tuple(value.shape) != tuple(ref.shape):
            return Result(False, f"{ex_id}: {what}: {name} has shape {tuple(value.shape)}, expected {tuple(ref.shape)} "
                                 f"({'[E, r, K]' if name == 'A' else '[E, N, r]'})")

    def close(x, y):
        return torch.allclose(x.detach().float(), y.float(), rtol=1e-5, atol=1e-5)

    if not close(a, wa):
        if close(a, lora_A.reshape(r, E, -1).transpose(0, 1)):
            return Result(False, f"{ex_id}: {what}: A is read rank-major (row i·E + e); lora_A's rows are "
                                 "expert-major: row e·r + i")
        if close(a, wa * scaling):
            return Result(False, f"{ex_id}: {what}: A is multiplied by the scaling; leave A as saved and fold the "
                                 "scaling into B")
        return compare(ex_id, a, wa, what=f"{what}: A [E, r, K]", row_name="expert")
    if close(b, wb):
        return None
    expert_major = lora_B.reshape(lora_B.shape[0], E, r).transpose(0, 1)      # [E, N, r], the wrong reading
    known = {"read expert-major (column e·r + i) and the scaling is missing": expert_major,
             "read expert-major (column e·r + i); lora_B's columns are rank-major: column i·E + e":
                 expert_major * scaling,
             f"not multiplied by the scaling ({scaling:.4g}): fold it into B": wb / scaling,
             f"multiplied by the scaling twice ({scaling:.4g}²)": wb * scaling}
    for say, value in known.items():
        if close(b, value):
            return Result(False, f"{ex_id}: {what}: B is {say}")
    return compare(ex_id, b, wb, what=f"{what}: B [E, N, r]", row_name="expert")


def _grade_convert(fn) -> Result:
    if not callable(fn):
        return Result(False, f"07.convert_fused: expected a function, got {type(fn).__name__}")
    seed = int(torch.randint(0, 2 ** 31 - 1, ()))
    for n, case in enumerate(CONVERT_CASES):
        E, r, rslora = case["E"], case["r"], case.get("rslora", False)
        tensors, config = _fused_adapter(E, r, case["H"], case["I"], alpha=case["alpha"], rslora=rslora, seed=seed + n)
        want = _loaded(tensors, config)
        scaling = case["alpha"] / (math.sqrt(r) if rslora else r)
        for param, nest in (("gate_up", "base_layer."), ("down", "")):
            lora_A, lora_B = tensors[f"{PREFIX}.{nest}lora_A.weight"], tensors[f"{PREFIX}.{nest}lora_B.weight"]
            out = fn(lora_A.clone(), lora_B.clone(), E, scaling)
            if not isinstance(out, (tuple, list)) or len(out) != 2:
                return Result(False, f"07.convert_fused: return a pair (A, B), got {type(out).__name__}")
            what = (f"case {n + 1}, {param}_proj (E = {E}, r = {r}, lora_A {tuple(lora_A.shape)}, lora_B "
                    f"{tuple(lora_B.shape)}, scaling {scaling:.4g})")
            wrong = _diagnose("07.convert_fused", what, out, want[param], lora_A, lora_B, E, scaling)
            if wrong:
                return wrong
    shapes = "; ".join(f"E = {c['E']}, r = {c['r']}" + (" (rslora)" if c.get("rslora") else "") for c in CONVERT_CASES)
    return Result(True, f"07.convert_fused: equals load_peft's A and B on {len(CONVERT_CASES)} fresh adapters, "
                        "gate_up_proj and down_proj each", (shapes,))


CONVERT_STUB = '''\
import torch


def convert_fused(lora_A, lora_B, num_experts, scaling):
    """One fused-3D PEFT LoRA pair (one parameter of one layer) in the lab's per-expert layout.

    lora_A [E*r, K]: row e*r + i holds rank i of expert e (expert-major)
    lora_B [N, r*E]: column i*E + e holds rank i of expert e (rank-major)
    num_experts: E; scaling: the adapter's lora_alpha / r (or lora_alpha / sqrt(r) with rslora).
    Returns (A [E, r, K], B [E, N, r]) with B multiplied by scaling: expert e's update is B[e] @ A[e].
    """
    raise NotImplementedError
'''

# ---- 07.scaling: predict rslora's scaling ----------------------------------------------------------

SCALING = dict(r=8, lora_alpha=16, use_rslora=True)          # adapter 1 of the notebook's section 4


def _grade_scaling(guess) -> Result:
    c = SCALING
    tensors, config = _fused_adapter(2, c["r"], 1, 1, alpha=c["lora_alpha"], rslora=c["use_rslora"])
    tensors[f"{PREFIX}.lora_B.weight"] = torch.ones_like(tensors[f"{PREFIX}.lora_B.weight"])
    truth = float(_loaded(tensors, config)["down"][1][0, 0, 0])            # B = 1 times the scaling
    plain = c["lora_alpha"] / c["r"]
    res = predict_result("07.scaling", guess, truth, rel=0.01,
                         explain=f"rslora divides lora_alpha by √r: {c['lora_alpha']} / √{c['r']} = {truth:.4g}")
    if isinstance(guess, (int, float)) and not res.passed and math.isclose(guess, plain, rel_tol=0.01):
        return Result(False, res.message, res.details, nudges=(
            f"{plain:g} = lora_alpha / r is plain LoRA's scaling; use_rslora=True changes it",))
    return res


SCALING_STUB = '''\
# Adapter 1 below is saved with r = 8, lora_alpha = 16 and use_rslora=True. By what number does PEFT
# multiply its B (A x), the number load_peft folds into B? Write it, then run the check.
scaling_guess = None
'''

register(
    Exercise("07.b_column", NB, "predict", "which column of lora_B holds (expert e, rank i)",
             "b_column_guess", B_COLUMN_STUB, _grade_b_column,
             hint="lora_B [N, r·E] is rank-major: reshape its columns as [r, E] (PEFT's own code does "
                  "weight_B.reshape(N, r, E)). Rank 0 of experts 0 … E − 1 comes first, then rank 1 of every "
                  "expert, and so on."),
    Exercise("07.convert_fused", NB, "code", "a fused PEFT pair in the lab's layout",
             "convert_fused", CONVERT_STUB, _grade_convert,
             hint="r = lora_A.shape[0] // E. A is a plain reshape to [E, r, K]. B: reshape to [N, r, E] (column "
                  "i·E + e), then permute to [E, N, r]. Multiply B, not A, by the scaling."),
    Exercise("07.scaling", NB, "predict", "the scaling of an rslora adapter",
             "scaling_guess", SCALING_STUB, _grade_scaling,
             hint="Plain LoRA scales by lora_alpha / r. Rank-stabilised LoRA (use_rslora=True) scales by "
                  "lora_alpha / √r instead, so a wider rank does not shrink the update as much."),
)
