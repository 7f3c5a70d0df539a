"""Exercises: a stub the learner edits in a notebook, a check that says what is wrong, a hint.

Three kinds (``KINDS``):
  predict  the learner writes a number before the cell that measures or computes it; the check says
           whether it is too high or too low and by how much (within the exercise's tolerance passes);
           a miss keeps the answer hidden until the learner asks (``check(id, value, reveal=True)``)
           or misses ``REVEAL_AFTER`` times in this Python process;
  code     the learner completes a function (PyTorch or Triton); the check runs it against the
           reference on fresh inputs and names the rows that are wrong and by how much;
  traffic  the learner rewrites a Triton kernel that already gives the right answer so that it moves
           fewer bytes; graded on the Triton interpreter by counting its global loads and stores
           (``memory.count_memory``) against a target, and checked against the reference first.

An ``Exercise`` holds its ``stub``: the exact source of the notebook cell the learner edits,
self-contained (it imports what it needs), defining ``answer`` (a function, a kernel or a number).
``check(id, value)`` grades a value and prints the feedback; it never raises, so a notebook with an
unfinished stub still runs to the end ("not done yet"). ``python -m moelora_lab.exercises`` runs
every check against the reference solutions (``solutions/`` at the repository root) and against
the stubs (every stub must be rejected).
"""
from __future__ import annotations

import importlib.util
import itertools
import linecache
import math
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("predict", "code", "traffic")
EXERCISES: dict[str, "Exercise"] = {}
_SOURCES = itertools.count()
REVEAL_AFTER = 3                           # the wrong try of a predict exercise that shows its answer
_MISSES: dict[str, int] = {}               # exercise id -> wrong tries so far (one kernel session)
_REVEAL: ContextVar[bool] = ContextVar("moelora_lab_exercise_reveal", default=False)


def revealing() -> bool:
    """True while a predict check may show its answer (asked for, or the REVEAL_AFTER-th miss)."""
    return _REVEAL.get()


class NotDone(Exception):
    """Raised by a checker when the value is still the stub's (``None``, or ``NotImplementedError``)."""


@dataclass(frozen=True)
class Result:
    """What a check found. ``passed``: the answer is accepted. ``done``: False while it is the stub's.
    ``nudges``: what a wrong prediction likely mixed up, shown even while the answer (in ``details``,
    the working) stays hidden."""

    passed: bool
    message: str
    details: tuple[str, ...] = ()
    done: bool = True
    nudges: tuple[str, ...] = ()

    def __str__(self) -> str:
        mark = "PASSED" if self.passed else ("not done yet" if not self.done else "NOT YET")
        return "\n".join([f"[{mark}] {self.message}", *(f"    {d}" for d in (*self.details, *self.nudges))])


@dataclass(frozen=True)
class Exercise:
    """One exercise. ``grade(value) -> Result`` may raise ``NotDone``; ``check`` turns that and any
    error of the learner's code into a Result."""

    id: str                  # "<notebook number>.<name>", e.g. "02.expand_once"
    notebook: str            # notebook file stem, e.g. "02_hbm_round_trip"
    kind: str                # one of KINDS
    title: str
    answer: str              # the name the stub defines and the solution module provides
    stub: str                # the notebook cell's source, exactly
    grade: Callable = field(repr=False)
    hint: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind: {self.kind!r} is not one of {KINDS}")
        if not self.id.startswith(self.notebook[:2] + "."):
            raise ValueError(f"id: {self.id!r} must start with the notebook's number {self.notebook[:2]!r}")

    def check(self, value, *, reveal: bool = False) -> Result:
        """Grade ``value``. A predict miss hides the answer unless ``reveal`` or it is the
        ``REVEAL_AFTER``-th miss of this exercise; only misses count (a stub's None does not)."""
        if not isinstance(reveal, bool):
            raise TypeError(f"reveal: expected True or False, got {type(reveal).__name__}")
        if self.kind != "predict":
            return self._check(value)
        misses = _MISSES.get(self.id, 0)
        token = _REVEAL.set(reveal or misses + 1 >= REVEAL_AFTER)
        try:
            result = self._check(value)
        finally:
            _REVEAL.reset(token)
        if result.passed or not result.done:
            return result
        _MISSES[self.id] = misses + 1
        if reveal or misses + 1 >= REVEAL_AFTER:
            return result
        left = REVEAL_AFTER - misses - 1
        return Result(False, result.message, (), nudges=result.nudges + (
            f"the answer stays hidden: try again ({left} more {'miss' if left == 1 else 'misses'} show it), or "
            f"check({self.id!r}, {self.answer}, reveal=True) to see it with the working",))

    def _check(self, value) -> Result:
        if value is None:
            return Result(False, f"{self.id}: `{self.answer}` is still None: fill it in, then run this cell again",
                          done=False)
        if self.kind == "traffic":
            from .memory import interpreted
            value = interpreted(value)      # on a GPU: the same kernel, run by the interpreter on the CPU
        try:
            return self.grade(value)
        except NotDone as exc:
            return Result(False, f"{self.id}: {exc}", done=False)
        except NotImplementedError:
            return Result(False, f"{self.id}: `{self.answer}` still raises NotImplementedError: write its body",
                          done=False)
        except Exception as exc:   # the learner's code failed: show it, do not stop the notebook
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
            return Result(False, f"{self.id}: running `{self.answer}` raised {type(exc).__name__}: {first}")


def register(*exercises: Exercise) -> None:
    for ex in exercises:
        if ex.id in EXERCISES:
            raise ValueError(f"exercise {ex.id!r} registered twice")
        EXERCISES[ex.id] = ex


def get(exercise_id: str) -> Exercise:
    if exercise_id not in EXERCISES:
        raise KeyError(f"exercise_id: no exercise {exercise_id!r}; known: {', '.join(sorted(EXERCISES))}")
    return EXERCISES[exercise_id]


def check(exercise_id: str, value, *, reveal: bool = False) -> Result:
    """Grade ``value`` for exercise ``exercise_id``, print the feedback and return the Result.
    ``reveal=True`` shows a predict exercise's answer even when the guess misses."""
    result = get(exercise_id).check(value, reveal=reveal)
    print(result)
    return result


def hint(exercise_id: str) -> None:
    print(get(exercise_id).hint)


def load_source(source: str, name: str, *, label: str = "stub"):
    """Run ``source`` as a module of its own and return what it defines as ``name``. The source is
    registered with ``linecache`` so that ``@triton.jit`` (which reads a kernel's source) works."""
    filename = f"<moelora_lab exercise {label} {next(_SOURCES)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace = {"__name__": f"moelora_lab_exercise_{label}"}
    exec(compile(source, filename, "exec"), namespace)
    if name not in namespace:
        raise NameError(f"the {label} source does not define {name!r}")
    return namespace[name]


def solutions_dir() -> Path:
    """``solutions/`` at the repository root (next to the package), else in the working directory."""
    here = Path(__file__).resolve().parents[2] / "solutions"
    return here if here.is_dir() else Path.cwd() / "solutions"


def load_solution(ex: Exercise, folder: Path | None = None):
    """The reference answer of ``ex``: ``answer`` from ``solutions/nb<NN>.py``."""
    folder = Path(folder) if folder is not None else solutions_dir()
    path = folder / f"nb{ex.notebook[:2]}.py"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no solutions for notebook {ex.notebook} (expected nb{ex.notebook[:2]}.py)")
    spec = importlib.util.spec_from_file_location(f"moelora_lab_solutions_nb{ex.notebook[:2]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, ex.answer):
        raise AttributeError(f"{path} does not define {ex.answer!r} (exercise {ex.id})")
    return getattr(module, ex.answer)


# --- helpers for graders -----------------------------------------------------------------------------

def how_far(guess: float, truth: float) -> str:
    """'about 2.3x too high', '12% too low', 'exact': how a guess misses, without the truth itself."""
    if guess == truth:
        return "exact"
    if truth == 0 or (guess < 0) != (truth < 0) or guess == 0:
        return f"too {'high' if guess > truth else 'low'}" + (" (the sign is wrong)" if guess * truth < 0 else "")
    ratio, high = guess / truth, guess > truth
    if max(ratio, 1 / ratio) >= 1.5:          # far off: a factor reads better than a percentage
        return f"about {max(ratio, 1 / ratio):.2g}x too {'high' if high else 'low'}"
    return f"{abs(ratio - 1):.0%} too {'high' if high else 'low'}"


def predict_result(ex_id: str, guess, truth: float, *, rel: float, unit: str = "", explain: str = "",
                   reveal: bool | None = None) -> Result:
    """Grade a prediction: within ``rel`` (relative) of ``truth`` passes. The message says how far off
    and which way; it names ``truth`` (and ``explain``) only when the guess passes or ``reveal`` (by
    default: :func:`revealing`, set by ``Exercise.check``)."""
    if not isinstance(rel, (int, float)) or isinstance(rel, bool) or rel < 0:
        raise ValueError(f"rel: expected a relative tolerance >= 0, got {rel!r}")
    if isinstance(guess, bool) or not isinstance(guess, (int, float)) or not math.isfinite(guess):
        return Result(False, f"{ex_id}: expected a number, got {guess!r}")
    off = (guess - truth) / truth if truth else (0.0 if guess == 0 else math.inf)
    ok = abs(off) <= rel
    show = ok or (revealing() if reveal is None else reveal)
    said = f"your {guess:,.4g}{unit}" + (f" vs {truth:,.4g}{unit}" if show else "") + f": {how_far(guess, truth)}"
    return Result(ok, f"{ex_id}: {said} ({'within' if ok else 'outside'} the {rel:.0%} this exercise accepts)",
                  (explain,) if explain and show else ())


def with_known_misses(res: Result, guess, known: dict, rel: float) -> Result:
    """``res`` with a nudge added where a failed ``guess`` lands within ``rel`` of a known mistake (``known``:
    the value a mistake gives -> what to reconsider, never the answer)."""
    if res.passed or isinstance(guess, bool) or not isinstance(guess, (int, float)) or not math.isfinite(guess):
        return res
    for value, say in known.items():
        if abs(guess - value) <= rel * abs(value):
            return Result(False, res.message, res.details, nudges=res.nudges + (say,))
    return res


def compare(ex_id: str, got, want, *, what: str = "output", rtol: float = 1e-4, atol: float = 1e-4,
            row_name: str = "row", max_rows: int = 5) -> Result | None:
    """None when ``got`` matches ``want`` (same shape, close); else a Result naming the wrong rows."""
    import torch

    if not isinstance(got, torch.Tensor):
        return Result(False, f"{ex_id}: {what} should be a torch.Tensor, got {type(got).__name__}")
    if tuple(got.shape) != tuple(want.shape):
        return Result(False, f"{ex_id}: {what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    g, w = got.detach().float().cpu(), want.detach().float().cpu()
    bad = ~torch.isclose(g, w, rtol=rtol, atol=atol, equal_nan=False)
    if not bad.any():
        return None
    rows = bad.reshape(bad.shape[0], -1).any(1).nonzero().flatten().tolist() if g.dim() else [0]
    details = []
    for r in rows[:max_rows]:
        gr, wr = g[r].reshape(-1), w[r].reshape(-1)
        err = (gr - wr).abs().nan_to_num(float("inf")).max().item()
        details.append(f"{row_name} {r}: max |error| {err:.3g}" + (" (NaN: never written?)" if gr.isnan().any() else ""))
    if len(rows) > max_rows:
        details.append(f"... and {len(rows) - max_rows} more {row_name}s")
    return Result(False, f"{ex_id}: {what} is wrong in {len(rows)} of {g.shape[0] if g.dim() else 1} "
                         f"{row_name}s", tuple(details))


def out_of_bounds_result(ex_id: str, mem) -> Result | None:
    """A failing Result naming every out-of-bounds access ``mem`` (a ``memory.MemoryCount``) saw, or None."""
    lines = mem.out_of_bounds()
    if not lines:
        return None
    return Result(False, f"{ex_id}: the kernel reads or writes out of bounds", tuple(lines))
