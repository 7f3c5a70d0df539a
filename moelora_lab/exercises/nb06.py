"""Exercises of notebook 06 (the capstone): a path dispatcher and a layer schedule, scored by regret.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, K in, N out, S slices, P = M*k pairs.

A rule is graded on every case of the committed H200 sweep (``moelora_lab.plots.capstone``): its
regret on a case is the time of its choice over the fastest measured choice, minus one. It passes when
its mean and its worst regret are both at most the exercise's target; the feedback names the cases
it lost most on and, after the learner's own score, the current ``auto`` rule's.
"""
from __future__ import annotations

from .core import Exercise, Result, register

# Targets (fractions): the reference solutions pass them; no constant answer does (on the layer sweep the
# fastest schedule changes with M and r: two streams at small M, both LoRA ops in K at large M).
DISPATCH_TARGET = dict(mean=0.03, worst=0.40)
SCHEDULE_TARGET = dict(mean=0.01, worst=0.005)   # worst < the gap at M = 512, r 16: the rule must read r


def _pct(x: float) -> str:
    return f"{x:.1%}" if x < 0.1 else f"{x:.0%}"


def _grade_rule(ex_id: str, choose, *, data: str, target: dict, cases_of, auto, auto_name: str) -> Result:
    """Score ``choose`` against the committed sweep ``data`` and phrase the verdict."""
    from ..plots.capstone import case_name, largest_regrets, score_rule
    from ..results import load

    cases = cases_of(load(data))
    try:
        mine = score_rule(choose, cases, name=f"`{choose.__name__}`" if hasattr(choose, "__name__") else "it")
    except ValueError as exc:
        return Result(False, f"{ex_id}: {exc}")
    ours = score_rule(auto, cases, name=auto_name)
    worst = mine["worst"]
    ok = mine["mean"] <= target["mean"] and worst["regret"] <= target["worst"]
    head = (f"{ex_id}: mean regret {_pct(mine['mean'])} (target ≤ {_pct(target['mean'])}), worst {_pct(worst['regret'])} "
            f"(target ≤ {_pct(target['worst'])})" + ("" if worst["regret"] == 0 else f" at {case_name(worst['features'])}"))
    presets = sorted({r["features"]["preset"] for r in mine["rows"]})
    per_preset = [(p, [r["regret"] for r in mine["rows"] if r["features"]["preset"] == p]) for p in presets]
    details = [f"the fastest choice in {mine['best_picked']} of {mine['n']} cases"
               + ("; mean regret " + ", ".join(f"{p} {_pct(sum(v) / len(v))}" for p, v in per_preset)
                  if len(presets) > 1 else ""),
               f"our {auto_name}: mean {_pct(ours['mean'])}, worst {_pct(ours['worst']['regret'])} "
               f"({case_name(ours['worst']['features'])})"]
    lost = largest_regrets(mine, 5)
    if lost:
        details.append("largest regrets:")
        details += [f"  {case_name(r['features'])}: {r['choice']} {r['us']:.1f} µs, {r['best']} {r['best_us']:.1f} µs "
                    f"is fastest: regret {_pct(r['regret'])}" for r in lost]
    return Result(ok, head, tuple(details))


# ---- 06.dispatcher: choose the LoRA path per case of the op sweep ---------------------------------

def _grade_dispatcher(choose_path) -> Result:
    from ..plots.capstone import auto_path, path_cases
    return _grade_rule("06.dispatcher", choose_path, data="kernels", target=DISPATCH_TARGET, cases_of=path_cases,
                       auto=auto_path, auto_name='path="auto" rule')


DISPATCHER_STUB = '''\
# choose_path(case) -> "one_shot", "two_kernel" or "small_batch": the path to run one case of the H200 sweep.
# case: {"preset", "op" ("w13" or "w2"), "M" tokens, "rank" r, "loras" L, "top_k" k, "num_experts" E,
#        "pairs" M*k, "K" in features, "N" out features per slice, "slices" S (2 for w13, 1 for w2)}
# Scored over every case: regret = time of your path / time of the fastest measured path - 1.
# It answers "one_shot" everywhere: find where the two-kernel path wins and say so in a few comparisons.
def choose_path(case):
    return "one_shot"
'''

# ---- 06.schedule: choose the layer's schedule per case of the layer sweep -------------------------

def _grade_schedule(choose_schedule) -> Result:
    from ..plots.capstone import auto_schedule, schedule_cases
    return _grade_rule("06.schedule", choose_schedule, data="layer", target=SCHEDULE_TARGET,
                       cases_of=schedule_cases, auto=auto_schedule, auto_name='schedule="auto" rule (on a GPU)')


SCHEDULE_STUB = '''\
# choose_schedule(case) -> "sequential", "dual_stream", "in_k" or "fused": how to run the MoE layer with LoRA
# for one case (M, r) of the H200 layer sweep.
# case: {"preset", "M" tokens, "rank" r, "loras" L, "top_k" k, "num_experts" E, "pairs" M*k,
#        "pairs_per_expert", "hidden" H, "intermediate" I, "fused_fits" (False: "fused" cannot run here)}
# Scored like choose_path. It answers two streams everywhere: find where another schedule wins, and say so
# in terms of the case's tokens and rank.
def choose_schedule(case):
    return "dual_stream"
'''

register(
    Exercise("06.dispatcher", "06_capstone", "code", "a LoRA path dispatcher, scored by regret",
             "choose_path", DISPATCHER_STUB, _grade_dispatcher,
             hint="Read the map above: the two-kernel path wins only past rank 64, where each expert gets few pairs: "
                  "at rank 128 from a handful of pairs up to a few per expert, at the widest ranks from a single pair "
                  "up to a few dozen per expert. Everywhere else the fused kernel wins. Comparisons on case['rank'] "
                  "and on case['pairs'] / case['num_experts'] get you under the target."),
    Exercise("06.schedule", "06_capstone", "code", "a layer schedule per (M, r), scored by regret",
             "choose_schedule", SCHEDULE_STUB, _grade_schedule,
             hint="Read the table's 'fastest' column down each rank: where does the winner change, and is it at the "
                  "same M for both ranks? in_k widens each grouped GEMM's K by L·r columns, so a border in pairs per "
                  "expert may move with the rank. Mind \"fused\": it runs only where case['fused_fits'] is True, and "
                  "the check rejects it elsewhere."),
)
