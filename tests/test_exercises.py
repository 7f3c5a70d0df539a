"""The exercises: the load/store counter, the framework, the contract of ``python -m moelora_lab.exercises``,
and every exercise's place in its notebook (stub cell verbatim, a check cell, a hint to reveal)."""
import json
import re
import subprocess
import sys
from pathlib import Path

import moelora_lab  # noqa: F401  (first: it decides whether Triton kernels run on the interpreter)
import pytest
import torch
import triton
import triton.language as tl

from moelora_lab.exercises import EXERCISES, KINDS, Exercise, Result, check, count_memory, load_source
from moelora_lab.exercises.__main__ import main
from moelora_lab.exercises.core import NotDone, compare, predict_result

ROOT = Path(__file__).parent.parent
NOTEBOOKS = ROOT / "notebooks"


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


@triton.jit
def _twice_kernel(src_ptr, dst_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    a = tl.load(src_ptr + offs)
    b = tl.load(src_ptr + offs)
    tl.store(dst_ptr + offs, a + b)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through the interpreter; the GPU suite checks the kernels")
def test_count_memory_counts_masked_loads_and_stores_per_tensor():
    src, dst = torch.arange(40, dtype=torch.float32), torch.zeros(40)
    with count_memory(src=src, dst=dst) as mem:
        _copy_kernel[(3,)](src, dst, 40, BLOCK=16)            # 48 lanes, 40 inside the mask
    assert torch.equal(dst, src)
    assert mem.loaded("src") == mem.unique_loaded("src") == 40 * 4 and mem.stored("dst") == 40 * 4
    assert mem.loaded("dst") == mem.stored("src") == 0 and mem.total_loaded == 160
    with count_memory(src=src, dst=dst) as mem:
        _twice_kernel[(1,)](src, dst, BLOCK=16)
    assert mem.loaded("src") == 2 * mem.unique_loaded("src") == 2 * 16 * 4
    assert "2x its 64 distinct bytes" in mem.report()
    with pytest.raises(KeyError, match="not given to count_memory"):
        mem.loaded("nope")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through the interpreter; the GPU suite checks the kernels")
def test_count_memory_puts_unnamed_tensors_under_other_and_restores_the_interpreter():
    from triton.runtime import interpreter
    before = interpreter.InterpreterBuilder.create_masked_load
    src, dst = torch.ones(16), torch.zeros(16)
    with count_memory(src=src) as mem:
        _copy_kernel[(1,)](src, dst, 16, BLOCK=16)
    assert mem.stored("other") == 64 and interpreter.InterpreterBuilder.create_masked_load is before
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        with count_memory(src=[1, 2]):
            pass


def _exercise(grade, **kw):
    return Exercise(**dict(dict(id="02.t", notebook="02_hbm_round_trip", kind="code", title="t", answer="f",
                                stub="def f():\n    raise NotImplementedError\n", grade=grade), **kw))


def test_a_check_never_raises_and_says_not_done_for_a_stub():
    def grade(f):
        f()
        return Result(True, "ok")

    ex = _exercise(grade)
    assert not ex.check(None).done and not ex.check(None).passed
    stub = load_source(ex.stub, "f")
    assert "NotImplementedError" in ex.check(stub).message and not ex.check(stub).done
    assert "ZeroDivisionError" in ex.check(lambda: 1 / 0).message and ex.check(lambda: 1 / 0).done
    assert _exercise(lambda v: (_ for _ in ()).throw(NotDone("untouched"))).check(1).done is False
    assert ex.check(lambda: 1).passed
    with pytest.raises(ValueError, match="kind"):
        _exercise(grade, kind="quiz")
    with pytest.raises(ValueError, match="must start with"):
        _exercise(grade, id="03.t")


def test_predict_and_compare_feedback():
    r = predict_result("x.p", 110, 100, rel=0.05, unit=" B")
    assert not r.passed and "10% too high" in r.message and "vs 100" not in r.message
    assert predict_result("x.p", 100, 100, rel=0.05).passed and not predict_result("x.p", "a", 1, rel=1).passed
    want = torch.zeros(6, 3)
    got = want.clone()
    got[4, 1], got[2] = 0.5, float("nan")
    r = compare("x.c", got, want, what="out")
    assert "2 of 6 rows" in r.message and "row 2" in r.details[0] and "NaN" in r.details[0]
    assert compare("x.c", want.clone(), want) is None and "shape" in compare("x.c", want[:2], want).message


def test_check_prints_the_feedback(capsys):
    ex_id = next(iter(EXERCISES))
    result = check(ex_id, None)
    assert not result.passed and "not done yet" in capsys.readouterr().out
    with pytest.raises(KeyError, match="no exercise"):
        check("99.none", 1)


def test_the_lab_has_its_exercises():
    """At least three in each of notebooks 01-05, of every kind, at least four traffic puzzles."""
    by_notebook = {}
    for ex in EXERCISES.values():
        by_notebook.setdefault(ex.notebook[:2], []).append(ex)
    assert all(len(by_notebook.get(n, [])) >= 3 for n in ("01", "02", "03", "04", "05")), \
        {n: [e.id for e in v] for n, v in by_notebook.items()}
    kinds = [ex.kind for ex in EXERCISES.values()]
    assert set(kinds) == set(KINDS) and kinds.count("traffic") >= 4


def test_list_prints_one_line_per_exercise(capsys):
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == len(EXERCISES)
    for line, ex in zip(lines, EXERCISES.values()):
        assert line.split()[:3] == [ex.id, ex.notebook, ex.kind]


def test_check_fails_when_a_solution_is_wrong_and_when_a_stub_passes(tmp_path, capsys):
    ex = next(e for e in EXERCISES.values() if e.kind == "predict")
    (tmp_path / f"nb{ex.notebook[:2]}.py").write_text(f"{ex.answer} = -12345.0\n")
    assert main(["check", "--solutions", str(tmp_path), "--only", ex.id]) == 1
    assert "FAIL" in capsys.readouterr().out
    assert main(["check", "--solutions", str(tmp_path / "missing"), "--only", ex.id]) == 1


def test_the_cli_runs_as_a_module():
    out = subprocess.run([sys.executable, "-m", "moelora_lab.exercises", "list"], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    assert len(out.strip().splitlines()) == len(EXERCISES)


def _cells(notebook):
    return json.loads((NOTEBOOKS / f"{notebook}.ipynb").read_text())["cells"]


def _squash(text):
    return re.sub(r"\s+", " ", text).strip()


@pytest.mark.parametrize("ex", list(EXERCISES.values()), ids=lambda e: e.id)
def test_every_exercise_sits_in_its_notebook(ex):
    """The stub cell verbatim, then a check cell on the stub's answer (shipped unsolved: its output says
    so), and the hint in a <details> block of a markdown cell before the stub."""
    cells = _cells(ex.notebook)
    src = ["".join(c["source"]) for c in cells]
    stubs = [i for i, s in enumerate(src) if cells[i]["cell_type"] == "code" and s.strip() == ex.stub.strip()]
    assert len(stubs) == 1, f"{ex.notebook}: the stub of {ex.id} must be one code cell, verbatim"
    call = re.compile(r"check\(\s*[\"']" + re.escape(ex.id) + r"[\"']\s*,\s*" + re.escape(ex.answer) + r"\s*\)")
    checks = [i for i, s in enumerate(src) if cells[i]["cell_type"] == "code" and call.search(s)]
    assert checks and checks[0] > stubs[0], f"{ex.notebook}: no check({ex.id!r}, {ex.answer}) after the stub"
    out = "".join("".join(o.get("text", "")) for o in cells[checks[0]].get("outputs", []))
    assert "[not done yet]" in out or "[NOT YET]" in out, f"{ex.id}: the committed check cell should show the stub "\
                                                          f"rejected, got {out[:200]!r}"
    hints = [i for i, s in enumerate(src[:stubs[0]]) if cells[i]["cell_type"] == "markdown" and "<details>" in s
             and _squash(ex.hint) in _squash(s)]
    assert hints, f"{ex.notebook}: no <details> hint with the text of {ex.id}'s hint before its stub"


def test_the_registers_prompt_names_the_shape_it_grades():
    """03.registers is graded on ``nb03.REGISTERS``; its prompt, stub and hint state that shape in words, so each
    must name the same BLOCK_M, rank and warps (a changed shape fails here, not silently in the prose)."""
    from moelora_lab.exercises.nb03 import REGISTERS

    bm, r, warps = REGISTERS["block_m"], REGISTERS["rank"], REGISTERS["num_warps"]
    ex = EXERCISES["03.registers"]
    prompt = [_squash("".join(c["source"])) for c in _cells(ex.notebook)
              if c["cell_type"] == "markdown" and "Exercise 03.registers" in "".join(c["source"])]
    assert len(prompt) == 1
    assert f"r = {r} at BLOCK_M = {bm}" in prompt[0] and f"`{bm} × {r}`" in prompt[0] and f"{warps}-warp" in prompt[0]
    assert f"r = {r} at BLOCK_M = {bm}" in ex.stub and f"{warps} warps" in ex.stub
    assert f"{bm} x {r}" in ex.hint and f"{warps} warps" in ex.hint


def test_readme_table_lists_every_exercise():
    from moelora_lab.exercises.__main__ import table
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- exercises -->\n", 1)[1].split("<!-- /exercises -->", 1)[0]
    assert block.strip() == table().strip(), "README's exercise table is stale: paste `python -m " \
                                             "moelora_lab.exercises table` between the exercises markers"


def test_traffic_checks_run_compiled_kernels_on_the_interpreter(tmp_path):
    """Where kernels compile (a GPU), a traffic check runs the interpreted twin of the learner's kernel."""
    script = (
        "import moelora_lab, os\n"
        "assert os.environ['TRITON_INTERPRET'] == '0'\n"
        "import torch, triton, triton.language as tl\n"
        "from moelora_lab.exercises import count_memory\n"
        "from moelora_lab.exercises.memory import interpreted\n"
        "@triton.jit\n"
        "def k(src_ptr, dst_ptr, BLOCK: tl.constexpr):\n"
        "    offs = tl.arange(0, BLOCK)\n"
        "    tl.store(dst_ptr + offs, tl.load(src_ptr + offs) * 2)\n"
        "src, dst = torch.arange(16.), torch.zeros(16)\n"
        "with count_memory(src=src, dst=dst) as mem:\n"
        "    interpreted(k)[(1,)](src, dst, BLOCK=16)\n"
        "assert torch.equal(dst, 2 * src) and mem.loaded('src') == mem.stored('dst') == 64\n"
        "print('ok')\n")
    os = __import__("os")
    env = dict(os.environ, MOELORA_INTERPRET="0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))   # installed or not
    env.pop("TRITON_INTERPRET", None)
    (tmp_path / "twin.py").write_text(script)            # @triton.jit reads its source from a file
    out = subprocess.run([sys.executable, str(tmp_path / "twin.py")], capture_output=True, text=True, env=env,
                         cwd=ROOT)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
