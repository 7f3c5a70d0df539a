"""Notebook 10's exercises (their solutions pass in ``python -m moelora_lab.exercises check``): the usual
wrong answers fail with a pointer and without the answer on a first miss, and each prompt states the numbers
its check grades."""
import moelora_lab  # noqa: F401  (first: it decides whether Triton kernels run on the interpreter)
import pytest
import torch

from moelora_lab.config import MoEShape
from moelora_lab.exercises import EXERCISES, core, load_solution
from moelora_lab.exercises.nb10 import CODES, WEIGHTS, code_factor_truth, weight_bytes_truth


pytestmark = pytest.mark.usefixtures("fresh_tries")     # each test a new kernel session


def test_block_scale_names_the_usual_mistakes():
    ex = EXERCISES["10.block_scale"]
    right = load_solution(ex)

    def inverted(w, block):
        data, scale = right(w, block)
        return data, 1 / scale

    def per_tensor(w, block):                       # one scale for the whole weight, repeated per block
        BN, BK = block
        scale = torch.full((w.shape[0] // BN, w.shape[1] // BK), float(w.abs().max()) / 448)
        return (w / scale.max()).to(torch.float8_e4m3fn), scale

    def not_fp8(w, block):
        data, scale = right(w, block)
        return data.float(), scale

    def off_by_a_bit(w, block):                     # scales one part in 1e5 off: the data round differently
        data, scale = right(w, block)
        return data, scale * (1 + 1e-5)

    r = ex.check(inverted)
    assert not r.passed and "inverted" in r.message and any("multiplies" in n for n in r.nudges)
    r = ex.check(per_tensor)
    assert not r.passed and "whole weight's scale" in r.message
    r = ex.check(not_fp8)
    assert not r.passed and "float8_e4m3fn" in r.message
    r = ex.check(off_by_a_bit)
    assert not r.passed and "scale [SN, SK]" in r.message
    assert not ex.check(lambda w, block: right(w, block)[0]).passed


def test_a_first_miss_points_without_the_answer():
    factor = code_factor_truth()
    ex = EXERCISES["10.code_factor"]
    for guess, pointer in ((1 / factor, "larger than x"), (448.0, "not 1")):
        core._MISSES.clear()
        r = ex.check(guess)
        assert not r.passed and f"{factor:.4g}" not in str(r) and not r.details, str(r)
        assert any(pointer in n for n in r.nudges), r.nudges
    truth, q = weight_bytes_truth()
    ex = EXERCISES["10.weight_bytes"]
    for guess, pointer in ((2 * truth, "bf16"), (q["E"] / q["k"] * truth, "k experts")):
        core._MISSES.clear()
        r = ex.check(guess)
        assert not r.passed and f"{truth:,.4g}" not in str(r) and not r.details, str(r)
        assert any(pointer in n for n in r.nudges), r.nudges
    assert f"{truth:,.0f}" in " ".join(ex.check(2 * truth, reveal=True).details)


def test_the_prompts_state_what_the_checks_grade():
    assert code_factor_truth() == pytest.approx(448 / CODES["amax"], rel=1e-6)
    assert f"largest magnitude is {CODES['amax']}" in EXERCISES["10.code_factor"].stub
    s = MoEShape.from_name(WEIGHTS["shape"])
    stub = EXERCISES["10.weight_bytes"].stub
    for said in (f"H = {s.hidden}", f"I = {s.intermediate}", f"{s.num_experts} experts", f"top_k = {s.top_k}",
                 f"{WEIGHTS['block'][0]} x {WEIGHTS['block'][1]} block"):
        assert said in stub, said
    truth, _ = weight_bytes_truth()
    assert truth == s.top_k * (3 * s.intermediate * s.hidden + 4 * (12 * 16 + 16 * 6))
