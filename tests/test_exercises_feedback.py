"""Feedback of the exercises: a missed prediction says which way and how far but keeps the answer until
asked (or the third miss); hints point without solving; a traffic check names the tensor, its count
against the expected one, and any out-of-bounds access; reference predictions follow the committed data."""
import math

import moelora_lab  # noqa: F401  (first: it decides whether Triton kernels run on the interpreter)
import pytest
import torch
import triton
import triton.language as tl

from moelora_lab.exercises import EXERCISES, check, core, count_memory, load_solution, load_source
from moelora_lab.exercises.core import REVEAL_AFTER, how_far, predict_result
from moelora_lab.exercises.memory import excess

interpreter_only = pytest.mark.skipif(torch.cuda.is_available(),
                                      reason="CPU tensors through the interpreter; the GPU suite checks the kernels")


pytestmark = pytest.mark.usefixtures("fresh_tries")     # each test a new kernel session


def _hidden_truth() -> float:
    from moelora_lab.exercises.nb04 import HIDDEN, PRESET
    from moelora_lab.plots.layer import overlap_table
    from moelora_lab.results import load_traces
    (row,) = [r for r in overlap_table(load_traces("layer_traces"))
              if (r["preset"], r["M"], r["rank"]) == (PRESET, HIDDEN["M"], HIDDEN["rank"])]
    return row["hidden"]


def test_how_far_says_the_direction_and_the_size_of_a_miss():
    assert how_far(230, 100) == "about 2.3x too high" and how_far(25, 100) == "about 4x too low"
    assert how_far(110, 100) == "10% too high" and how_far(90, 100) == "10% too low"
    assert how_far(100, 100) == "exact" and "sign" in how_far(-5, 100) and how_far(3, 0) == "too high"
    with pytest.raises(ValueError, match="rel"):
        predict_result("x.p", 1, 1, rel=-0.1)


def test_a_first_miss_says_high_or_low_and_keeps_the_answer():
    ex, truth = EXERCISES["04.hidden"], _hidden_truth()
    shown = f"{truth:,.4g}"
    high, low = ex.check(0.5), ex.check(0.1)
    assert not high.passed and "too high" in high.message and "1.8x" in high.message
    assert not low.passed and "too low" in low.message and "2.7x" in low.message
    for r in (high, low):
        assert shown not in str(r) and r.details == () and any("reveal=True" in n for n in r.nudges)


def test_the_third_miss_or_reveal_shows_the_answer(capsys):
    ex, truth = EXERCISES["04.hidden"], _hidden_truth()
    shown = f"{truth:,.4g}"
    tries = [ex.check(0.6) for _ in range(REVEAL_AFTER)]
    assert all(shown not in str(r) for r in tries[:-1]) and shown in tries[-1].message and tries[-1].details
    assert core._MISSES == {"04.hidden": REVEAL_AFTER}
    other = check("07.scaling", 1.0, reveal=True)                      # its first miss, asked for
    assert not other.passed and "vs " in other.message and other.details and "vs " in capsys.readouterr().out
    assert check("04.hidden", None).done is False and core._MISSES["04.hidden"] == REVEAL_AFTER  # a stub is no try
    with pytest.raises(TypeError, match="reveal"):
        ex.check(0.6, reveal="yes")


def test_a_missed_column_index_says_which_way_without_the_column():
    ex = EXERCISES["07.b_column"]
    column = load_solution(ex)
    r = ex.check(column + 3)
    assert not r.passed and "3 columns too high" in r.message and str(column) not in r.message and not r.details
    assert f"the column is {column}" in ex.check(column - 1, reveal=True).message


@pytest.mark.parametrize("ex_id, keys", [
    ("03.keep_t_out", ["tl.dot(t", "t itself", "Delete the store", "debug_barrier"]),
    ("05.fold_kernel", ["ok & has", "mask=ok", "other=0.0", "delta_ptr + offs"]),
    ("04.window", ["copy_tbps * 1e12", "1e6", '["base_w13"].bytes', "add", "divide"]),
])
def test_hints_point_without_giving_the_solution(ex_id, keys):
    hint = EXERCISES[ex_id].hint
    assert len(hint) > 80, "a hint must still point somewhere"
    assert not [k for k in keys if k in hint], f"{ex_id}'s hint gives away its solution"


@interpreter_only
def test_a_traffic_failure_names_the_tensor_and_its_counts():
    ex = EXERCISES["02.shrink_once"]
    r = ex.check(load_source(ex.stub, ex.answer))
    assert not r.passed and "a: read 16 times per block, expected once (262,144 B against 16,384 B)" in r.message
    keep = EXERCISES["03.keep_t_out"].check(load_source(EXERCISES["03.keep_t_out"].stub, "fused_lora_kernel"))
    assert "t: written once, expected never" in keep.message and "t: read 3 times, expected never" in keep.message


@triton.jit
def _copy_unmasked_load(src_ptr, dst_ptr, n, shift, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs + shift), mask=offs < n)   # the load reads every lane


@interpreter_only
def test_counts_against_the_expected_and_flags_out_of_bounds_reads():
    buf, dst = torch.arange(64, dtype=torch.float32), torch.zeros(64)
    src = buf[8:48]                                   # a view: 40 elements, real memory on both sides
    with count_memory(src=src, dst=dst) as mem:
        _copy_unmasked_load[(1,)](src, dst, 40, 0, BLOCK=64)
    (line,) = mem.out_of_bounds()
    assert line.startswith("src: 24 elements read out of bounds, up to index 63 of its 40 elements"), line
    assert mem.loaded("src") == 40 * 4                # the stray lanes are flagged, not counted as src's
    assert excess(mem, "src", "load", 160) is None
    assert excess(mem, "src", "load", 80) == "src: read twice, expected once (160 B against 80 B)"
    assert excess(mem, "src", "load", 160, expected=0) == "src: read once, expected never (160 B against 0 B)"
    with pytest.raises(ValueError, match="kind"):
        excess(mem, "src", "read", 80)
    with count_memory(src=src, dst=dst) as mem:
        _copy_unmasked_load[(1,)](src, dst, 40, -8, BLOCK=32)
    assert "src: 8 elements read out of bounds, up to index -8 of its 40 elements" in mem.out_of_bounds()[0]
    with count_memory(src=src, dst=dst) as mem:
        _copy_unmasked_load[(1,)](src, dst, 40, 0, BLOCK=32)
    assert mem.out_of_bounds() == []


@interpreter_only
def test_a_traffic_check_flags_an_out_of_bounds_read():
    ex = EXERCISES["05.fold_kernel"]
    stub = ex.stub.replace("c = tl.load(c1_ptr + offs, mask=ok)", "c = tl.load(c1_ptr + offs)")
    assert stub != ex.stub
    r = ex.check(load_source(stub, ex.answer))
    assert not r.passed and "out of bounds" in r.message
    assert any(d.startswith("c1: ") and "read out of bounds" in d for d in r.details), r.details


def test_every_reference_prediction_follows_the_committed_data():
    """Each predict exercise's solution passes its check (within its tolerance of the value the committed data
    gives); 04.hidden's is that value itself, and the number older data gave (0.21) is rejected."""
    predicts = [ex for ex in EXERCISES.values() if ex.kind == "predict"]
    assert len(predicts) >= 8
    for ex in predicts:
        r = ex.check(load_solution(ex))
        assert r.passed, str(r)
    assert math.isclose(load_solution(EXERCISES["04.hidden"]), _hidden_truth(), rel_tol=1e-9)
    assert not EXERCISES["04.hidden"].check(0.21).passed


def test_no_constant_schedule_passes_06_schedule():
    """On the layer sweep the fastest schedule changes with M and r (two streams at small M, both LoRA ops in K at
    large M, from an M that depends on r): every constant answer fails the check and scores clearly worse than the
    reference rule, which reads both the tokens and the rank."""
    from moelora_lab.plots.capstone import SCHEDULE_CHOICES, schedule_cases, score_rule
    from moelora_lab.results import load

    ex = EXERCISES["06.schedule"]
    reference = load_solution(ex)
    cases = schedule_cases(load("layer"))
    ours = score_rule(reference, cases)
    assert ex.check(reference).passed and len({c["best"] for c in cases}) >= 2
    for choice in SCHEDULE_CHOICES:
        r = ex.check(lambda case, choice=choice: choice)
        assert r.done and not r.passed, f"the constant {choice!r} passed: {r}"
        if all(choice in c["us"] for c in cases):
            s = score_rule(lambda case, choice=choice: choice, cases)
            assert s["mean"] >= ours["mean"] + 0.01 and s["worst"]["regret"] >= ours["worst"]["regret"] + 0.05
    at = {(c["features"]["M"], c["features"]["rank"]): c["features"] for c in cases}
    assert reference(at[512, 16]) != reference(at[512, 64])         # the rank moves the border
    assert reference(at[1, 16]) != reference(at[8192, 16])          # and so do the tokens
