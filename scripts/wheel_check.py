"""The wheel is the package: build it, install it outside the checkout, use it as a newcomer would.

``make test-wheel`` runs this (any Python >= 3.11 with pip; the standard library only). In a temporary
folder outside the checkout:

1. copy the files git tracks or would track (no ignored build leftovers) and build the wheel from them;
2. check the wheel holds every such file under ``moelora_lab/`` (the committed data included) and
   nothing else there;
3. make a fresh venv and install the wheel with its declared dependencies, plus ipykernel, nbclient
   and nbformat to run a notebook, all at the versions ``requirements-cpu.txt`` pins (a constraint file;
   the torch build as ``make venv`` picks it, ``scripts/torch_source.py``); ``pip check``;
4. from another temporary folder, with that venv's python: ``import moelora_lab`` resolves to the venv's
   site-packages and reads its data; each ```` ```python ```` block of the README as its own script (a
   ``False`` in what it prints fails);
   ``python -m moelora_lab.exercises list``; a notebook (default ``notebooks/00_tour.ipynb``, copied
   there) executed by nbclient.

Usage::

    python scripts/wheel_check.py [--notebook notebooks/00_tour.ipynb] [--keep]

The temporary folder is removed on success and kept (its path printed) on failure or with ``--keep``.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "moelora_lab"
NOTEBOOK_RUNNERS = ("ipykernel", "nbclient", "nbformat")
# run in the venv: where the package comes from, and its data read back through the package
WHERE = """
import sys, sysconfig
from importlib import resources
from pathlib import Path
import moelora_lab
from moelora_lab import lesson
checkout, expected = Path(sys.argv[1]), int(sys.argv[2])
here = Path(moelora_lab.__file__).resolve()
site = Path(sysconfig.get_paths()["purelib"]).resolve()
assert here.is_relative_to(site), f"import moelora_lab gave {here}, not the venv's {site}"
assert not here.is_relative_to(checkout), f"import moelora_lab gave the checkout's {here}"
layer = resources.files("moelora_lab") / "data" / "h200" / "layer.csv"
header = layer.read_text().splitlines()[0]
assert header.startswith("preset,"), f"{layer}: unexpected header {header[:60]!r}"
rows = lesson.data("layer")
files = [p for p in (here.parent / "data").rglob("*") if p.is_file()]
assert len(files) == expected, f"{len(files)} data files installed, {expected} tracked"
print(f"import moelora_lab -> {here}; {len(files)} data files; data/h200/layer.csv: {len(rows)} rows read")
"""
# run in the venv: execute one notebook; its first cell checks which python and which package run it
NOTEBOOK = """
import sys
from pathlib import Path
import nbclient, nbformat
src, venv, timeout = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
nb = nbformat.read(src, as_version=4)
nb.cells.insert(0, nbformat.v4.new_code_cell(
    "import sys\\nfrom pathlib import Path\\nimport moelora_lab\\n"
    f"assert Path(sys.prefix).resolve() == Path({venv!r}).resolve(), sys.prefix\\n"
    f"assert Path(moelora_lab.__file__).resolve().is_relative_to(Path({venv!r}).resolve()), moelora_lab.__file__"))
nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                        resources={"metadata": {"path": str(src.parent)}}).execute()
nbformat.write(nb, src.with_name("executed_" + src.name))
print(f"{src.name}: {sum(c.cell_type == 'code' for c in nb.cells) - 1} code cells ran without error")
"""


def readme_snippets(text: str) -> list[str]:
    """The ```` ```python ```` blocks of a markdown text, in order (as ``tests/test_readme.py`` reads them).

    Raises
    ------
    ValueError
        If ``text`` has no such block.
    """
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    if not blocks:
        raise ValueError("text: no ```python block found; the README's example must be one")
    return blocks




def source_files(root: Path = ROOT) -> list[str]:
    """Paths (relative to ``root``) git tracks or would track: ``git ls-files --cached --others
    --exclude-standard``, less those deleted from the working tree."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                cwd=root, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        raise RuntimeError(f"{root} must be a git checkout (git ls-files lists what the wheel may hold): {err}")
    return sorted(p for p in set(listed.split("\0")) if p and (root / p).is_file())


def wheel_problems(names: list[str], files: list[str]) -> list[str]:
    """What is wrong with a wheel whose members are ``names``, built from the source ``files``: a file of
    the package missing, or a package member that is no source file (a stale build leftover)."""
    wanted = {f for f in files if f.startswith(PACKAGE + "/") and "/__pycache__/" not in f}
    held = {n for n in names if n.startswith(PACKAGE + "/")}
    return [f"missing from the wheel: {f}" for f in sorted(wanted - held)] + \
           [f"in the wheel but not a source file: {n}" for n in sorted(held - wanted)]


class Steps:
    """Runs and times the steps; the first failure stops the check."""

    def __init__(self):
        self.start = time.monotonic()

    def run(self, title: str, cmd: list, show: str = "stdout", **kwargs) -> str:
        """Run ``cmd``; print its ``show`` stream (``"stdout"``, ``"stderr"`` or ``""``), both if it fails."""
        began = time.monotonic()
        print(f"== {title}", flush=True)
        done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
        if done.returncode != 0:
            out = (done.stdout + done.stderr).strip()
            raise RuntimeError(f"{title} failed (exit {done.returncode}):\n{out[-4000:]}")
        out = getattr(done, show).strip() if show else ""
        if out:
            print("   " + out[-1500:].replace("\n", "\n   "))
        print(f"   ({time.monotonic() - began:.0f} s)", flush=True)
        return done.stdout


def check(tmp: Path, notebook: Path, cell_timeout: int) -> None:
    steps = Steps()
    files = source_files()
    src, dist, venv, run = tmp / "src", tmp / "dist", tmp / "venv", tmp / "run"
    for rel in files:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    steps.run(f"build the wheel from {len(files)} source files",
              [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--progress-bar", "off", "-w", dist, src])
    wheels = sorted(dist.glob(f"{PACKAGE}-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip wheel left {[w.name for w in wheels]} in {dist}, not one {PACKAGE} wheel")
    wheel = wheels[0]
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    problems = wheel_problems(names, files)
    if problems:
        raise RuntimeError(f"{wheel.name}:\n  " + "\n  ".join(problems))
    data = [f for f in files if f.startswith(f"{PACKAGE}/data/")]
    print(f"   {wheel.name}: every source file of {PACKAGE}/ ({len(data)} under {PACKAGE}/data/), nothing else")

    py = venv / "bin" / "python"
    steps.run("a fresh venv", [sys.executable, "-m", "venv", venv])
    torch_args = steps.run("the torch build", [py, ROOT / "scripts" / "torch_source.py",
                                                ROOT / "requirements-cpu.txt"], show="stderr").split()
    steps.run(f"install the wheel and {', '.join(NOTEBOOK_RUNNERS)} (pinned by requirements-cpu.txt)",
              [py, "-m", "pip", "install", "--quiet", "--quiet", "--progress-bar", "off", *torch_args,
               "-c", ROOT / "requirements-cpu.txt", wheel, *NOTEBOOK_RUNNERS])
    steps.run("pip check", [py, "-m", "pip", "check"])

    run.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MPLBACKEND", "PYTHONSTARTUP")}
    inside = dict(cwd=run, env=env)
    steps.run("import moelora_lab and its data", [py, "-c", WHERE, ROOT, len(data)], **inside)
    for i, code in enumerate(readme_snippets((ROOT / "README.md").read_text())):
        (run / f"readme_snippet_{i}.py").write_text(code)
        said = steps.run(f"the README's Python example {i}", [py, f"readme_snippet_{i}.py"], **inside)
        if re.search(r"\bFalse\b", said):
            raise RuntimeError(f"the README's example {i} ran, but a check it prints says False:\n{said}")
    listed = steps.run("python -m moelora_lab.exercises list", [py, "-m", "moelora_lab.exercises", "list"],
                       show="", **inside).splitlines()
    if not listed:
        raise RuntimeError("python -m moelora_lab.exercises list printed nothing")
    print(f"   {len(listed)} exercises listed, from {listed[0].split()[0]} to {listed[-1].split()[0]}")
    shutil.copy2(notebook, run / notebook.name)
    steps.run(f"notebook {notebook.name}", [py, "-c", NOTEBOOK, run / notebook.name, venv, cell_timeout], **inside)
    print(f"== the wheel works outside the checkout ({time.monotonic() - steps.start:.0f} s in all)")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--notebook", type=Path, default=ROOT / "notebooks" / "00_tour.ipynb",
                        help="the notebook to execute against the installed wheel")
    parser.add_argument("--cell-timeout", type=int, default=600, help="seconds per notebook cell")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = parser.parse_args(argv)
    if not args.notebook.is_file():
        parser.error(f"--notebook: {args.notebook} is not a file; give a notebook of notebooks/")
    tmp = Path(tempfile.mkdtemp(prefix="moelora_wheel_")).resolve()
    if tmp.is_relative_to(ROOT):
        tmp.rmdir()
        parser.error(f"the temporary folder {tmp} lies inside the checkout; set TMPDIR to a folder outside it")
    try:
        check(tmp, args.notebook.resolve(), args.cell_timeout)
    except RuntimeError as err:
        print(f"wheel check FAILED: {err}\n(kept for a look: {tmp})", file=sys.stderr)
        return 1
    if args.keep:
        print(f"kept: {tmp}")
    else:
        shutil.rmtree(tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
