"""Exercises of notebook 04 (two streams, one memory bus).

Shape legend: M tokens, k top-k, P = M*k pairs, E experts, L adapters, r rank, H hidden, I expert
intermediate; bf16 = 2 bytes. Times in µs; the committed H200 data is ``layer.csv`` and
``layer_traces.json`` (``moelora_lab.results``).
"""
from __future__ import annotations

import random

from ..summary import KERNEL_ROWS
from .core import Exercise, Result, predict_result, register

PRESET = "qwen3-30b-a3b"
ONE, TWO = KERNEL_ROWS[1], KERNEL_ROWS[2]      # the schedules of the op's LoRA kernels on one stream and on two


def _trace(M: int, rank: int, schedule: str) -> dict:
    from ..plots.layer import trace_name
    from ..results import load_traces
    return load_traces("layer_traces")[trace_name(PRESET, M, rank, schedule)]


# ---- 04.window: predict a pair's window on two streams from its bytes ---------------------------------

WINDOW = dict(M=128, rank=64, pair="w13")


def _grade_window(guess) -> Result:
    from ..config import MoEShape
    from ..plots.layer import trace_phases
    from ..plots.traffic import sweep_workload
    from ..profile.traffic import layer_traffic
    from ..results import load
    w = WINDOW
    trace = _trace(w["M"], w["rank"], TWO)
    truth = trace_phases(trace["records"])[w["pair"]]["window_us"]
    copy_bps = load("layer")[0]["copy_tbps"] * 1e12
    stages = layer_traffic(MoEShape.from_name(PRESET), w["rank"], sweep_workload(PRESET, w["M"]),
                           lora_path=trace["meta"]["lora_path"])
    base, lora = stages[f"base_{w['pair']}"].bytes, stages[f"lora_{w['pair']}"].bytes
    us = lambda n: n / copy_bps * 1e6
    return predict_result("04.window", guess, truth, rel=0.15, unit=" µs",
                          explain=f"measured: the pair's first start to its last end on the committed two-stream "
                                  f"timeline. One bus, (base {base:,} B + LoRA {lora:,} B) at the copy rate "
                                  f"{copy_bps / 1e12:.2f} TB/s: {us(base + lora):.0f} µs; a bus of its own for the "
                                  f"LoRA (the base alone): {us(max(base, lora)):.0f} µs")


WINDOW_STUB = '''\
# qwen3-30b-a3b, M = 128 tokens, rank 64 (the one-shot path), bf16, the benchmark's routing.
# How long, in µs, does the pair base_w13 || lora_w13 take on two streams on the H200, from the first
# start to the last end? Bytes: moelora_lab.profile.traffic.layer_traffic (stages "base_w13", "lora_w13");
# copy rate: layer_rows[0]["copy_tbps"] TB/s. Write your number, then run the check.
window_guess = None
'''


# ---- 04.fork_point: replay the streams' rules ---------------------------------------------------------

def stream_schedule_reference(ops) -> dict:
    """CUDA stream semantics on an idealised GPU (every stage takes its duration, whatever runs beside it).
    ops in enqueue order: ("run", stream, stage, us) | ("record", stream, event) | ("wait", stream, event)."""
    ready, event_at, times = {}, {}, {}
    for op, stream, *args in ops:
        if op == "run":
            name, duration = args
            start = ready.get(stream, 0.0)
            times[name] = (start, start + duration)
            ready[stream] = start + duration
        elif op == "record":
            event_at[args[0]] = ready.get(stream, 0.0)
        elif op == "wait":
            ready[stream] = max(ready.get(stream, 0.0), event_at[args[0]])
        else:
            raise ValueError(f"op: {op!r} is not run, record or wait")
    return times


def layer_ops(us: dict, *, fork_before: bool = True, dual: bool = True) -> list:
    """The order ``moe_lora_layer`` enqueues its stages and events in (``us``: stage -> duration).
    fork_before=False records each fork after the base GEMM instead; dual=False puts everything on main."""
    side = "lora" if dual else "main"
    ops = []
    for n, (base, lora, join) in enumerate((("base_w13", "lora_w13", "act"), ("base_w2", "lora_w2", "sum"))):
        fork, done = f"fork{n + 1}", f"join{n + 1}"
        if fork_before:
            ops.append(("record", "main", fork))
        ops.append(("run", "main", base, us[base]))
        if not fork_before:
            ops.append(("record", "main", fork))
        ops += [("wait", side, fork), ("run", side, lora, us[lora]), ("record", side, done),
                ("wait", "main", done), ("run", "main", join, us[join])]
    return ops


def _random_ops(seed: int) -> list:
    """A legal random enqueue order on three streams: events are waited for only after they are recorded."""
    rng = random.Random(seed)
    ops, recorded = [], []
    for i in range(16):
        stream = rng.choice(("s0", "s1", "s2"))
        kind = rng.choice(("run", "record", "wait") if recorded else ("run", "record"))
        if kind == "run":
            ops.append(("run", stream, f"k{i}", round(rng.uniform(1, 50), 1)))
        elif kind == "record":
            recorded.append(f"e{i}")
            ops.append(("record", stream, f"e{i}"))
        else:
            ops.append(("wait", stream, rng.choice(recorded)))
    return ops


def _fork_cases():
    seq = _trace(16, 16, ONE)
    us = {r["name"]: round(r["end_us"] - r["start_us"], 1) for r in seq["records"]}
    long_lora = dict(us, lora_w13=us["base_w13"] * 1.5, lora_w2=us["base_w2"] * 0.5)
    return us, [
        ("fork recorded before base_w13 (the layer's order), M = 16 stage times", layer_ops(us)),
        ("fork recorded after base_w13", layer_ops(us, fork_before=False)),
        (f"one stream (schedule={ONE!r})", layer_ops(us, dual=False)),
        ("fork before, a LoRA longer than its base GEMM", layer_ops(long_lora)),
        ("three streams, random events", _random_ops(56)),
        ("three streams, random events", _random_ops(125)),
    ]


def _where(ops, stage) -> str:
    """'on lora, after waiting for fork2 (recorded on main after act)': what decides the stage's start."""
    i = next(i for i, o in enumerate(ops) if o[0] == "run" and o[2] == stage)
    stream, waits = ops[i][1], []
    for o in reversed(ops[:i]):
        if o[1] == stream and o[0] == "run":
            break
        if o[1] == stream and o[0] == "wait":
            j = next(j for j, r in enumerate(ops) if r[0] == "record" and r[2] == o[2])
            before = [r[2] for r in ops[:j] if r[0] == "run" and r[1] == ops[j][1]]
            after = f"after {before[-1]}" if before else "before any work"
            waits.append(f"{o[2]} (recorded on {ops[j][1]} {after})")
    waits = list(dict.fromkeys(reversed(waits)))
    return f"on {stream}" + (f", after waiting for {' and '.join(waits)}" if waits else "")


def _grade_fork(schedule) -> Result:
    us, cases = _fork_cases()
    for title, ops in cases:
        want = stream_schedule_reference(ops)
        got = schedule(list(ops))
        if not isinstance(got, dict):
            return Result(False, f"04.fork_point: expected a dict stage -> (start_us, end_us), got "
                                 f"{type(got).__name__}")
        wrong = []
        for stage, (s, e) in want.items():
            if stage not in got:
                wrong.append(f"{stage} ({_where(ops, stage)}): missing; expected {s:.1f}-{e:.1f} µs")
                continue
            try:
                gs, ge = (float(v) for v in got[stage])
            except (TypeError, ValueError):
                wrong.append(f"{stage}: expected a (start_us, end_us) pair, got {got[stage]!r}")
                continue
            if abs(gs - s) > 1e-6 or abs(ge - e) > 1e-6:
                wrong.append(f"{stage} ({_where(ops, stage)}): yours {gs:.1f}-{ge:.1f} µs, "
                             f"expected {s:.1f}-{e:.1f} µs")
        if wrong:
            return Result(False, f"04.fork_point: {len(wrong)} of {len(want)} stages wrong in the case '{title}'",
                          tuple(wrong[:5]) + (("...",) if len(wrong) > 5 else ())
                          + ("the ops: " + ", ".join(map(str, ops)),) * title.startswith("three"))
    before, after, one = (stream_schedule_reference(ops) for _, ops in cases[:3])
    end = lambda t: max(e for _, e in t.values())
    measured = _trace(16, 16, TWO)["records"]
    return Result(True, f"04.fork_point: right in all {len(cases)} cases", (
        f"fork before base_w13: lora_w13 starts at {before['lora_w13'][0]:.1f} µs beside it; the layer ends at "
        f"{end(before):.0f} µs",
        f"fork after: lora_w13 starts at {after['lora_w13'][0]:.1f} µs, when base_w13 ends; the layer ends at "
        f"{end(after):.0f} µs, as on one stream ({end(one):.0f} µs)",
        f"the H200's two-stream run of the same case ends at "
        f"{max(r['end_us'] for r in measured) - min(r['start_us'] for r in measured):.0f} µs: stages beside each "
        f"other stretch, because they share one bus (section 4)"))


FORK_STUB = '''\
def stream_schedule(ops):
    # Replay CUDA streams on an idealised GPU: every stage takes its duration, whatever runs beside it.
    # ops, in the order the CPU enqueues them (streams are names such as "main" and "lora"):
    #   ("run", stream, stage, duration_us)  the stage runs after everything enqueued on its stream before it
    #   ("record", stream, event)            the event completes when everything enqueued on that stream
    #                                        before it has finished
    #   ("wait", stream, event)              later work on this stream starts only once the event completed
    # Return {stage: (start_us, end_us)}; time starts at 0.0 on every stream.
    ready = {}      # stream -> when the work enqueued on it so far has finished
    event_at = {}   # event -> when it completes
    times = {}      # stage -> (start_us, end_us)
    for op, stream, *args in ops:
        raise NotImplementedError   # handle "run", "record" and "wait"
    return times
'''


# ---- 04.hidden: how much LoRA time do two streams take off the critical path ---------------------------

HIDDEN = dict(M=2048, rank=16)


def _grade_hidden(guess) -> Result:
    from ..plots.layer import overlap_table
    from ..results import load_traces
    if isinstance(guess, (int, float)) and not isinstance(guess, bool) and 1 < guess <= 100:
        return Result(False, f"04.hidden: {guess} looks like a percentage; write a fraction (a quarter is 0.25)")
    h = HIDDEN
    (row,) = [r for r in overlap_table(load_traces("layer_traces"))
              if (r["preset"], r["M"], r["rank"]) == (PRESET, h["M"], h["rank"])]
    # 20%: a value read from another table must fail, not pass on a wide margin
    return predict_result("04.hidden", guess, row["hidden"], rel=0.20,
                          explain=f"one stream {row['seq_us']:.0f} µs, two streams {row['dual_us']:.0f} µs, LoRA "
                                  f"alone {row['lora_seq_us']:.0f} µs: ({row['seq_us']:.0f} - {row['dual_us']:.0f}) "
                                  f"/ {row['lora_seq_us']:.0f}; yet the LoRA ran beside the base work "
                                  f"{row['overlap']:.0%} of its time on two streams")


HIDDEN_STUB = '''\
# qwen3-30b-a3b, M = 2048 tokens, rank 16: what share of the LoRA's one-stream time do two streams take
# off the layer's critical path ("LoRA time hidden", as a fraction: 0.5 = half)? Section 5's table has
# what you need. Write your number, then run the check.
hidden_guess = None
'''

register(
    Exercise("04.fork_point", "04_stream_overlap", "code", "replay two streams: where the fork is recorded",
             "stream_schedule", FORK_STUB, _grade_fork,
             hint="Keep one clock per stream (ready) and one time per event (event_at). run: start = the stream's "
                  "clock, end = start + duration, and the clock moves to end. record: the event completes at the "
                  "stream's clock now (the end of what was enqueued on it before). wait: the stream's clock becomes "
                  "max(its clock, the event's time); never earlier than it was."),
    Exercise("04.window", "04_stream_overlap", "predict", "the time of base_w13 beside lora_w13, from their bytes",
             "window_guess", WINDOW_STUB, _grade_window,
             hint="Both kernels are memory-bound and share one HBM. Running side by side does not give either its "
                  "own bus: which quantity sets the window then, each kernel's bytes alone or something of the "
                  "two together? Find the bytes of the two stages in the byte model, and mind the units of the "
                  "copy rate (TB/s) and of the answer (µs)."),
    Exercise("04.hidden", "04_stream_overlap", "predict", "how much LoRA time two streams hide at M = 2048",
             "hidden_guess", HIDDEN_STUB, _grade_hidden,
             hint="For each pair at M = 2048, rank 16, the one-stream run pays base + LoRA (the 'alone' columns) and "
                  "the two-stream run pays the measured window. Add up what the windows save over both pairs and "
                  "divide by the LoRA's time alone (both pairs)."),
)
