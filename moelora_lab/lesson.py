"""What the notebooks use to stay honest: claims checked against the data, real code shown with its
line numbers, and one switch between the committed H200 data and live measurements.

* :func:`claim` prints a sentence whose numbers come from the data and fails the cell (so
  ``make test``) the moment the data stops supporting it.
* :func:`show_code` prints a function or kernel from its module, whole or as excerpts, with the
  file's own line numbers and every elision marked.
* :func:`data` returns the rows of a committed data file (checked against the code's stamp, see
  :mod:`moelora_lab.results`) or, with ``live=True`` on a CUDA GPU, measures them now with the
  benchmark that produced the file; :func:`source` says which of the two a figure shows.
"""
from __future__ import annotations

import collections
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from . import results

PACKAGE_ROOT = Path(__file__).resolve().parent.parent


class ClaimError(AssertionError):
    """A sentence of a notebook that its data no longer supports."""


_LIVE = {"on": False}        # set by live_mode(): claims about the committed data become reports


def claim(text: str, holds: bool = True, **values) -> str:
    """Print ``text`` with ``values`` filled in (``str.format`` fields) and return it; raise
    :class:`ClaimError` naming the sentence and the values if ``holds`` is false.

    ``claim("two streams hide {hidden:.0%} of the LoRA time", hidden=h, holds=h > 0.5)``

    In a notebook switched to live measurements (:func:`live_mode`) the sentences were written for
    the committed H200 data; one that does not hold on this GPU's numbers is printed marked
    "does not hold here" instead of stopping the notebook.
    """
    if not isinstance(text, str):
        raise TypeError(f"text: expected the sentence as a str, got {type(text).__name__}")
    sentence = text.format(**values)
    if not holds and _LIVE["on"]:
        print(f"[does not hold here; it holds for the committed H200 data] {sentence}")
        return sentence
    if not holds:
        shown = ", ".join(f"{k}={v!r}" for k, v in values.items())
        raise ClaimError(f"this sentence no longer holds for the data: {sentence!r} ({shown}); "
                         "the data or the code changed: rewrite the sentence or find out why")
    print(sentence)
    return sentence


def _unwrap(obj):
    """The Python function under @triton.jit / @triton.heuristics / @triton.autotune wrappers."""
    while not inspect.isfunction(obj) and hasattr(obj, "fn"):
        obj = obj.fn
    obj = inspect.unwrap(obj) if inspect.isfunction(obj) else obj    # @contextmanager, @wraps
    if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismodule(obj)):
        raise TypeError(f"obj: expected a function, kernel, class or module, got {type(obj).__name__}")
    return obj


def _find(lines: list[str], text: str, start: int, what: str, name: str) -> int:
    for i in range(start, len(lines)):
        if text in lines[i]:
            return i
    raise ValueError(f"{what}: {text!r} is not in {name} (from its line {start + 1} on); the code changed: "
                     "update the excerpt")


def _elided(count: int, width: int) -> str:
    return f"{'⋮':>{width}}   ({count} line{'s' if count != 1 else ''} not shown)"


def show_code(obj, *excerpts: tuple[str, str]) -> str:
    """Print the source of ``obj`` with its file's line numbers: whole, or only the excerpts, each
    a (first line containing, last line containing) pair of substrings, in order; the lines left
    out are marked ``⋮`` with their count. Returns the printed text."""
    fn = _unwrap(obj)
    lines, first = inspect.getsourcelines(fn)
    if first == 0:                                   # a module: its lines count from 1
        first = 1
    lines = [line.rstrip("\n") for line in lines]
    path = Path(inspect.getsourcefile(fn)).resolve()
    try:
        path = path.relative_to(PACKAGE_ROOT)
    except ValueError:
        pass
    name = f"{getattr(fn, '__name__', 'module')} ({path})"
    spans, at = [], 0
    for pair in excerpts or [(None, None)]:
        if pair == (None, None):
            spans.append((0, len(lines) - 1))
            break
        if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
            raise TypeError(f"excerpts: expected (start, end) pairs of substrings, got {pair!r}")
        lo = _find(lines, pair[0], at, "excerpt start", name)
        hi = _find(lines, pair[1], lo, "excerpt end", name)
        spans.append((lo, hi))
        at = hi + 1
    out, width = [f"{path}, {name.split(' ')[0]}:"], len(str(first + len(lines)))
    prev = -1
    for lo, hi in spans:
        if lo > prev + 1:
            out.append(_elided(lo - prev - 1, width))
        out += [f"{first + i:>{width}}  {lines[i]}" for i in range(lo, hi + 1)]
        prev = hi
    if prev < len(lines) - 1:
        out.append(_elided(len(lines) - 1 - prev, width))
    text = "\n".join(out)
    print(text)
    return text


def gpu_available() -> bool:
    """A CUDA GPU that runs the compiled kernels (not the interpreter)."""
    import torch

    from ._backend import INTERPRET
    return torch.cuda.is_available() and not INTERPRET


FAKE_LIVE_ENV = "MOELORA_FAKE_LIVE"      # tests: LIVE on without a GPU, on a fake live data set (fake_live_rows)


def _fake_live() -> bool:
    return os.environ.get(FAKE_LIVE_ENV, "") not in ("", "0")


def live_mode(requested: bool) -> bool:
    """The notebook's switch: live measurements only when asked for and a GPU can make them.
    Prints what the notebook's figures will show."""
    _LIVE["on"] = False
    if requested and _fake_live():
        _LIVE["on"] = True
        print(f"LIVE on a fake live data set ({FAKE_LIVE_ENV} is set: the committed rows of each live "
              "sweep's own cases, times perturbed per variant); a test of the live paths, not a measurement")
        return True
    if requested and not gpu_available():
        print("LIVE = True, but there is no CUDA GPU here: showing the committed H200 data instead")
        return False
    if requested:
        _LIVE["on"] = True
        import torch
        print(f"LIVE: every measured figure below is measured now on {torch.cuda.get_device_name()} "
              "(this takes a few minutes)")
        return True
    print("Showing the committed H200 data (set LIVE = True on a CUDA GPU to measure every figure now)")
    return False


def data(name: str, *, live: bool = False, bench: tuple[str, ...] | list[str] = ()) -> list[dict]:
    """Rows of the data file ``name``: committed (checked against the code) or, with ``live``,
    measured now by ``python -m moelora_lab.bench <bench...>`` into a temporary folder."""
    if not live:
        return results.load(name, accept_older_rules=name in results.WALKS)
    if not bench:
        raise ValueError(f"bench: live data for {name!r} needs the benchmark's arguments, e.g. ['kernels', ...]")
    if _fake_live():
        return fake_live_rows(name, bench)
    with tempfile.TemporaryDirectory() as tmp:
        _run_benchmark(bench, out=tmp, name=name)
        if Path(tmp, f"{name}_traces.json").exists():
            _LIVE_TRACES[name] = results.load_traces(f"{name}_traces", tmp)
        return results.load(name, tmp)


def _run_benchmark(bench, *, out: str, name: str) -> None:
    """``python -m moelora_lab.bench <bench...> --out <out> --name <name>`` as its own process (the
    library never imports the benchmark), on this package's source. Its messages are printed as they
    come, its progress bar redrawn in place; RuntimeError with the last messages if it fails."""
    path = os.pathsep.join(p for p in (str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "moelora_lab.bench", *map(str, bench), "--out", out, "--name", name]
    last, on_bar = collections.deque(maxlen=12), False
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=dict(os.environ, PYTHONPATH=path)) as proc:
        for line in proc.stdout:        # universal newlines: each redraw of a progress bar is a line
            line = line.rstrip("\n")
            if _PROGRESS_BAR.search(line):
                print("\r" + line, end="", file=sys.stderr, flush=True)
                on_bar = True
            elif line:
                print(("\n" if on_bar else "") + line, file=sys.stderr, flush=True)
                last.append(line)
                on_bar = False
    if proc.returncode:
        raise RuntimeError(f"python -m moelora_lab.bench {' '.join(map(str, bench))} failed "
                           f"(exit {proc.returncode}):\n" + "\n".join(last))


_PROGRESS_BAR = re.compile(r"\|\s*\d+/\d+ \[[^\]]*\]$")      # tqdm: "name: 50%|###  | 4/8 [00:01<00:01, 3.2case/s]"


_LIVE_TRACES: dict[str, dict] = {}

# the benchmark options that pick cases, and the column each fills
_CASE_OPTIONS = {"--presets": "preset", "--tokens": "M", "--ranks": "rank", "--variants": "variant",
                 "--paths": "path", "--ops": "op"}


def _measured_time(column: str) -> bool:
    return (column.startswith("us_") or column.endswith("_us")) and column not in ("floor_us", "roofline_us")


def fake_live_rows(name: str, bench) -> list[dict]:
    """What a live ``data(name, live=True, bench=bench)`` returns under ``MOELORA_FAKE_LIVE=1`` (tests, no
    GPU): the committed rows of the cases ``bench`` names (its ``--presets``, ``--tokens``, ``--ranks`` and
    ``--variants``; a live sweep measures those, not the committed set), with every measured time
    (``us_*``, ``*_us``; not the floors) scaled by a factor of 0.85 to 1.15 that depends on the row's variant or path, so
    rankings and ratios move as on another GPU. Saved traces are the committed ones of the
    same cases."""
    import zlib
    rows = results.load(name, accept_older_rules=name in results.WALKS)
    args, picked, option = [str(a) for a in bench], {}, None
    for a in args[1:]:
        if a.startswith("--"):
            option = a if a in _CASE_OPTIONS else None
        elif option:
            picked.setdefault(_CASE_OPTIONS[option], set()).add(a)
    out = []
    for row in rows:
        if any(col in row and str(row[col]) not in values for col, values in picked.items()):
            continue
        who = str(row.get("variant") or row.get("path") or row.get("schedule") or "")
        factor = 0.85 + 0.3 * (zlib.crc32(who.encode()) % 1000) / 999
        out.append({k: (v * factor if isinstance(v, float) and _measured_time(k) else v) for k, v in row.items()})
    try:
        saved = results.load_traces(f"{name}_traces")
    except FileNotFoundError:
        return out
    _LIVE_TRACES[name] = {key: t for key, t in saved.items()         # the traces of the sweep's cases only
                          if not any(col in t.get("meta", {}) and str(t["meta"][col]) not in values
                                     for col, values in picked.items() if col != "variant")}
    return out


def traces(name: str = "layer", *, live: bool = False) -> dict:
    """The layer timelines saved with ``data(name)``: the committed ones, or those the last live
    ``data(name, live=True)`` call recorded."""
    if not live:
        return results.load_traces(f"{name}_traces")
    if name not in _LIVE_TRACES:
        raise ValueError(f"no live traces for {name!r}: call data({name!r}, live=True, bench=['layer', ...]) first")
    return _LIVE_TRACES[name]


def source(rows: list[dict], *, live: bool = False) -> str:
    """Which data a figure shows: 'measured now on ...' or 'committed data: ...' (with the
    label of a tile walk measured under older rules, see :data:`results.WALKS`)."""
    rows = rows if isinstance(rows, list) else [rows]
    older = None if live or "config" not in rows[0] else results.older_rules(rows)
    return ("measured now: " if live else "committed data: ") + results.label(rows) + (f"; {older}" if older else "")
