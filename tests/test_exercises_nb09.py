"""Notebook 09's exercises (their solutions pass in ``python -m moelora_lab.exercises check``): the usual
wrong answers fail with a pointer and without the answer on a first miss, and each prompt states the numbers
its check grades."""
import math

import moelora_lab  # noqa: F401  (first: it decides whether Triton kernels run on the interpreter)
import pytest
import torch

from moelora_lab.exercises import EXERCISES, core, load_solution
from moelora_lab.exercises.nb09 import JOINT, T_BYTES, mean_scale_truth, t_bytes_truth


pytestmark = pytest.mark.usefixtures("fresh_tries")     # each test a new kernel session


def test_group_grads_names_a_transpose_and_a_wrong_chain_rule():
    ex = EXERCISES["09.group_grads"]
    right = load_solution(ex)

    def transposed(xs, a, b, g):
        dx, da, db = right(xs, a, b, g)
        return dx, da.T, db

    def g_for_dt(xs, a, b, g):                       # dA from G itself: only shapes that happen to fit
        dx, da, db = right(xs, a, b, g)
        return dx, da * 2, db

    r = ex.check(transposed)
    assert not r.passed and "da is right but transposed" in r.message
    r = ex.check(g_for_dt)
    assert not r.passed and "da [r, K]" in r.message and any("dT = G B" in n for n in r.nudges)
    assert not ex.check(lambda xs, a, b, g: (xs, a)).passed


def test_a_first_miss_points_without_the_answer():
    truth, _ = t_bytes_truth()
    shown = f"{truth:,.4g}"
    ex = EXERCISES["09.t_bytes"]
    one = truth / (2 + 12 + 32)                       # one pass over T: S P r c
    for guess, pointer in ((2 * one, "never reads them back"), (truth * 2, "bf16"), (truth / 2, "two slices")):
        core._MISSES.clear()                          # each a first miss (the third would show the answer)
        r = ex.check(guess)
        assert not r.passed and shown not in str(r) and not r.details, str(r)
        assert any(pointer in n for n in r.nudges), r.nudges
    m = EXERCISES["09.mean_scale"].check(0.5)
    assert not m.passed and "0.4" not in str(m) and any("without an adapter" in n for n in m.nudges)
    assert "0.4" in EXERCISES["09.mean_scale"].check(0.5, reveal=True).message


def test_the_prompts_state_what_the_checks_grade():
    from moelora_lab.config import MoEShape
    from moelora_lab.profile.grad_traffic import grad_tiles
    truth, q = t_bytes_truth()
    s = MoEShape.from_name(T_BYTES["shape"])
    BN, BK, _ = grad_tiles(T_BYTES["rank"])
    stub = EXERCISES["09.t_bytes"].stub
    for said in (f"K = {s.hidden}", f"N = {s.intermediate}", f"r = {T_BYTES['rank']}", f"M = {T_BYTES['M']}",
                 f"top_k = {s.top_k}", f"BN = {BN}", f"BK = {BK}", "bf16"):
        assert said in stub, said
    assert truth == q["S"] * q["P"] * q["r"] * q["c"] * (2 + math.ceil(q["N"] / BN) + math.ceil(q["K"] / BK))
    n0, n1 = JOINT["tokens_per_adapter"]
    none = JOINT["no_adapter_tokens"]
    assert f"{n0} tokens on adapter 0, {n1} on adapter 1, {none} without" in EXERCISES["09.mean_scale"].stub
    assert mean_scale_truth() == pytest.approx(n0 / (n0 + n1 + none), rel=1e-5)


def test_group_grads_truth_is_autograd():
    """The grader's spec of one group equals torch autograd of out = (xs A^T) B^T."""
    from moelora_lab.exercises.nb09 import _spec_group
    g = torch.Generator().manual_seed(0)
    xs, a, b, go = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((4, 6), (3, 6), (5, 3), (4, 5)))
    leaves = [t.clone().requires_grad_() for t in (xs, a, b)]
    ((leaves[0] @ leaves[1].T) @ leaves[2].T * go).sum().backward()
    for got, leaf in zip(_spec_group(xs, a, b, go), leaves):
        assert torch.allclose(got, leaf.grad)
