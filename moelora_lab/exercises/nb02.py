"""Exercises of notebook 02 (the HBM round trip of the two-kernel path).

Shape legend: M tokens, k top-k, P = M*k pairs, G (adapter, expert) groups, r rank, K in, N out,
S slices; bf16 = 2 bytes. The two traffic puzzles (shrink, expand) live in ``nb02_kernels``.
"""
from __future__ import annotations

import torch

from .core import Exercise, Result, predict_result, register

# ---- 02.roundtrip_bytes: predict, then reveal -------------------------------------------------------

ROUNDTRIP = dict(M=512, k=8, r=16, S=2)      # w13 of qwen3-30b-a3b: gate and up, two slices


def _roundtrip_truth():
    """The byte model's traffic of the rank buffer T on the two-kernel path for ROUNDTRIP (every token
    has an adapter): shrink's write and expand's read (the launcher allocates T without a fill);
    qwen3-30b-a3b's w13 (K = H, N = I)."""
    from ..config import MoEShape
    from ..profile.traffic import count_workload, lora_op_traffic
    m, shape = ROUNDTRIP, MoEShape.from_name("qwen3-30b-a3b")
    ids = torch.randint(0, shape.num_experts, (m["M"], m["k"]), generator=torch.Generator().manual_seed(0))
    work = count_workload(ids, torch.zeros(m["M"], dtype=torch.long), shape.num_experts, 1)
    t = lora_op_traffic("two_kernel", work, in_features=shape.hidden, out_features=shape.intermediate,
                        num_slices=m["S"], rank=m["r"])
    return {name: t.part(name) for name in ("intermediate_write", "intermediate_read")}


def _near(guess, value) -> bool:
    return isinstance(guess, (int, float)) and not isinstance(guess, bool) and abs(guess - value) <= 0.1 * value


def _grade_roundtrip(guess) -> Result:
    parts = _roundtrip_truth()
    m = ROUNDTRIP
    one = m["S"] * m["M"] * m["k"] * m["r"] * 2             # one pass over T [S, P, r] in bf16
    res = predict_result("02.roundtrip_bytes", guess, sum(parts.values()), rel=0.10, unit=" B",
                         explain=f"T is [S, P, r] = [{m['S']}, {m['M'] * m['k']}, {m['r']}] bf16: {one:,} B per pass; "
                                 f"the byte model counts {len(parts)} passes, shrink's write and expand's read")
    details, nudges = [f"  {name}: {nbytes:,} B" for name, nbytes in parts.items()], []
    if _near(guess, one):
        nudges.append("your number is half: one pass (the expand reads back every byte the shrink wrote) or one "
                       "slice (w13 has two, gate and up, each with its own T rows)")
    elif _near(guess, 3 * one):
        nudges.append("your number is three passes: the launcher allocates T with torch.empty, so nothing "
                       "writes it before the shrink")
    elif _near(guess, 4 * one):
        nudges.append("your number is twice: T is stored in x's dtype (bf16, 2 bytes); the fp32 accumulator "
                       "stays in registers")
    return Result(res.passed, res.message, res.details + tuple(details), nudges=tuple(nudges))


ROUNDTRIP_STUB = '''\
# How many bytes does the rank buffer T cost the two-kernel path in one call of w13 (S = 2 slices)
# at M = 512 tokens, top-k 8, rank 16, bf16? Count both passes of the table above: shrink's write
# and expand's read. Write your number, then run the check.
roundtrip_guess = None
'''

# ---- 02.predict_time: predict a measured time from bytes and bandwidth -------------------------------

PREDICT_TIME = dict(preset="qwen3-30b-a3b", op="w13", rank=64, M=512, path="two_kernel")


def _measured(**where) -> dict:
    from ..results import load
    rows = [row for row in load("kernels") if all(row[key] == value for key, value in where.items())]
    if len(rows) != 1:
        raise LookupError(f"the committed sweep has {len(rows)} rows for {where}, expected one")
    return rows[0]


def _grade_predict_time(guess) -> Result:
    case = PREDICT_TIME
    row = _measured(**case)
    floor = row["bytes"] / (row["copy_tbps"] * 1e12) * 1e6
    us = row["us_median"]
    res = predict_result("02.predict_time", guess, us, rel=0.40, unit=" µs",
                         explain=f"{row['bytes']:,} B at the copy bandwidth {row['copy_tbps']:.2f} TB/s take "
                                 f"{floor:.1f} µs (the byte floor); the measured median is {us / floor:.2f}x that: "
                                 f"the kernels stream at {floor / us:.0%} of the copy rate")
    small = _measured(**dict(case, M=1))
    small_floor = small["bytes"] / (small["copy_tbps"] * 1e12) * 1e6
    note = (f"the same sum at M = 1 gives {small_floor:.2f} µs against {small['us_median']:.1f} µs measured "
            f"({small['us_median'] / small_floor:.0f}x): section 5 says why")
    return Result(res.passed, res.message, res.details + (note,))


PREDICT_TIME_STUB = '''\
# Predict the median time, in µs, of the two-kernel path for qwen3-30b-a3b w13, r = 64, M = 512 in the
# committed sweep. Its bytes are in section 3's table (two-kernel column, r = 64); the copy bandwidth
# measured in the same run prints below. Write your number, then run the check.
from moelora_lab.results import load

print(f"copy bandwidth measured with the sweep: {load('kernels')[0]['copy_tbps']:.2f} TB/s")
predict_time_guess = None
'''

register(
    Exercise("02.roundtrip_bytes", "02_hbm_round_trip", "predict", "bytes of the rank buffer's round trip",
             "roundtrip_guess", ROUNDTRIP_STUB, _grade_roundtrip,
             hint="T holds one row of r values per (slice, pair): S x M x k rows. The launcher allocates it "
                  "without a fill; the shrink writes every value once and the expand reads it once; bf16 is "
                  "2 bytes."),
)

from . import nb02_kernels  # noqa: E402,F401  (registers 02.shrink_once and 02.expand_once, in the notebook's order)

register(
    Exercise("02.predict_time", "02_hbm_round_trip", "predict", "the two-kernel path's time from its bytes",
             "predict_time_guess", PREDICT_TIME_STUB, _grade_predict_time,
             hint="A memory-bound kernel cannot beat its bytes / the bandwidth (TB/s is 1e12 bytes per second, "
                  "a µs is 1e-6 seconds). That floor is a lower bound: real kernels reach only part of the "
                  "copy rate, so round the floor up."),
)
