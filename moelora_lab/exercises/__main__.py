"""``python -m moelora_lab.exercises list | check [--stubs] [--only ID ...]``.

list            one line per exercise: id, notebook, kind, title
table           the README's table of notebooks and their exercises (markdown)
check           every check against the reference solutions (``solutions/nb<NN>.py``); exit 0 only if all pass
check --stubs   every check against the unmodified stubs; exit 0 only if every stub is rejected
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from . import EXERCISES
from .core import Result, load_solution, load_source, solutions_dir


def _run(ex, stubs: bool, folder: Path | None) -> Result:
    try:
        value = load_source(ex.stub, ex.answer) if stubs else load_solution(ex, folder)
    except Exception as exc:
        return Result(False, f"{ex.id}: could not load the {'stub' if stubs else 'solution'}: "
                             f"{type(exc).__name__}: {exc}")
    return ex.check(value)


def table() -> str:
    """Markdown: one row per notebook with exercises, each exercise as `id` (kind): title."""
    rows = ["| notebook | exercises |", "|---|---|"]
    by_notebook: dict = {}
    for ex in EXERCISES.values():
        by_notebook.setdefault(ex.notebook, []).append(ex)
    for notebook in sorted(by_notebook):
        cell = "<br>".join(f"`{ex.id}` ({ex.kind}): {ex.title}" for ex in by_notebook[notebook])
        rows.append(f"| `{notebook}.ipynb` | {cell} |")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m moelora_lab.exercises`` (runs on a CPU)."""
    p = argparse.ArgumentParser(prog="python -m moelora_lab.exercises", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("list", help="one line per exercise: id, notebook, kind, title")
    sub.add_parser("table", help="the README's table of notebooks and their exercises (markdown)")
    c = sub.add_parser("check", help="run every check against the solutions (or, with --stubs, the stubs)")
    c.add_argument("--stubs", action="store_true", help="check the stubs instead: every one must be rejected")
    c.add_argument("--solutions", type=Path, default=None, help=f"solutions folder (default {solutions_dir()})")
    c.add_argument("--only", nargs="+", default=None, metavar="ID", help="only these exercises")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.what == "list":
        for ex in EXERCISES.values():
            print(f"{ex.id:24s} {ex.notebook:28s} {ex.kind:8s} {ex.title}")
        return 0
    if args.what == "table":
        print(table())
        return 0
    chosen = [EXERCISES[i] for i in args.only] if args.only else list(EXERCISES.values())
    failures = []
    for ex in chosen:
        t0 = time.monotonic()
        result = _run(ex, args.stubs, args.solutions)
        ok = (not result.passed) if args.stubs else result.passed
        verdict = ("rejected" if not result.passed else "PASSED (a stub must fail)") if args.stubs else \
            ("passed" if result.passed else "FAILED")
        print(f"{'ok  ' if ok else 'FAIL'} {ex.id:24s} {ex.kind:8s} {verdict} ({time.monotonic() - t0:.1f} s)")
        if not ok or not args.stubs:
            print("     " + str(result).replace("\n", "\n     "))
        if not ok:
            failures.append(ex.id)
    what = "stubs rejected" if args.stubs else "solutions passed"
    print(f"{len(chosen) - len(failures)} of {len(chosen)} {what}" + (f"; failing: {', '.join(failures)}" if failures
                                                                      else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
