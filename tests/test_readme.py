"""The README works as written: its Python snippet and its ``python -m moelora_lab ...`` commands run in a fresh
shell with the venv activated, every path it and CONTRIBUTING name exists, its layout lists every top-level entry,
and the versions of its install notes are the pinned ones."""
from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CONTRIBUTING = ROOT / "CONTRIBUTING.md"
# the README's commands that run on a CPU in a few seconds: run, they must succeed
CPU_COMMANDS = {
    "python -m moelora_lab.exercises list",
    "python -m moelora_lab.bench --help",
    "python -m moelora_lab.summary",
    "python -m moelora_lab.train --layer reference",
}
# the README's commands that need a CUDA GPU (one, or several for the distributed benchmark): on a machine
# without one they must stop at once, saying so
GPU_COMMANDS = {
    "python -m moelora_lab.bench dram",
    "python -m moelora_lab.bench kernels",
    "python -m moelora_lab.bench layer",
    "python -m moelora_lab.dist.bench",
}
EXTENSIONS = ("py", "ipynb", "csv", "json", "md", "txt", "yml", "toml", "sh", "cfg", "png", "cff")
NOT_TRACKED = (".venv", ".venv-triton36")        # made by `make`, named by the install notes


def _readme() -> str:
    return README.read_text()


def _fresh_shell(command: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """``command`` in bash with only the venv on PATH, as after ``source .venv/bin/activate`` in a new terminal."""
    venv_bin = Path(sys.executable).parent
    env = {"PATH": f"{venv_bin}{os.pathsep}/usr/bin{os.pathsep}/bin", "VIRTUAL_ENV": str(venv_bin.parent),
           "HOME": os.environ.get("HOME", str(cwd)), "LANG": "C.UTF-8"}
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def readme_commands() -> set[str]:
    """Every ``python -m moelora_lab...`` command of the README (in code spans and code blocks), comments cut."""
    found = set()
    for line in re.findall(r"python -m moelora_lab[^`\n]*", _readme()):
        found.add(" ".join(line.split("#")[0].split()))
    return found


def test_every_readme_command_is_classified():
    commands = {c for c in readme_commands() if "<" not in c}          # `bench <subcommand>`: a pattern
    assert commands == CPU_COMMANDS | GPU_COMMANDS, \
        f"README commands not classified here: {sorted(commands - CPU_COMMANDS - GPU_COMMANDS)}; gone from the " \
        f"README: {sorted(CPU_COMMANDS | GPU_COMMANDS - commands)}"


def _installed() -> bool:
    """The README's commands assume the package installed in the venv (``make`` does it, editable)."""
    try:
        importlib.metadata.distribution("moelora_lab")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_install = pytest.mark.skipif(not _installed(), reason="moelora_lab is not installed in this Python "
                                   "(make, or pip install -e .): the README's commands run as a venv user runs them")


@needs_install
@pytest.mark.parametrize("command", sorted(CPU_COMMANDS))
def test_readme_cpu_commands_run(command, tmp_path):
    done = _fresh_shell(command, tmp_path)
    assert done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert done.stdout.strip(), f"{command} printed nothing"


@needs_install
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("command", sorted(GPU_COMMANDS))
def test_readme_gpu_commands_stop_at_once_without_a_gpu(command, tmp_path):
    done = _fresh_shell(command, tmp_path, timeout=60)
    assert done.returncode == 2 and "GPU" in done.stderr, f"{command}: exit {done.returncode}\n{done.stderr}"


@needs_install
def test_readme_python_snippet_runs(tmp_path):
    blocks = re.findall(r"^```python\n(.*?)^```", _readme(), re.S | re.M)
    assert blocks, "README.md has no ```python block"
    for i, code in enumerate(blocks):
        script = tmp_path / f"snippet_{i}.py"
        script.write_text(code)
        done = _fresh_shell(f"python {script.name}", tmp_path)
        assert done.returncode == 0, f"README snippet {i} failed:\n{done.stderr}"
        assert "matches the spec: True" in done.stdout or i > 0, done.stdout


def _path_like(text: str) -> list[str]:
    """Words of code spans and of code blocks (not Python ones) that name a repository path: with a slash, or a
    file name with a known extension (``bash scripts/x.sh`` names ``scripts/x.sh``; ``<name>`` marks a pattern)."""
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))
    out = []
    for chunk in spans + [body for lang, body in blocks if lang != "python"]:
        for word in chunk.split():
            token = word.split("=")[-1].strip(",;:()\"'")
            if not re.fullmatch(r"[\w.\-/]+", token) or token.startswith(("http", "-")) or "//" in token:
                continue
            if "/" in token or re.search(rf"\.({'|'.join(EXTENSIONS)})$", token):
                out.append(token)
    return out


def _exists(token: str, tracked: set[str]) -> bool:
    """Whether a tracked path is ``token`` or ends with it (the README names package files from moelora_lab/ or
    from their folder, e.g. `reference.py`, `data/h200/`), as a file or as a folder."""
    if token.split("/")[0] in NOT_TRACKED:
        return True
    rel = "/" + token.strip("/") + "/"
    return any(rel in "/" + t + "/" for t in tracked)


def _tracked(*options: str) -> list[str]:
    """``git ls-files`` (with ``options``): the repository's files, those of the working tree that exist."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout (git ls-files)")
    out = subprocess.run(["git", "ls-files", *options], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [t for t in out.splitlines() if (ROOT / t).exists()]


@pytest.mark.parametrize("doc", [README, CONTRIBUTING], ids=lambda p: p.name)
def test_every_named_path_exists(doc):
    tracked = _tracked("--cached", "--others", "--exclude-standard")        # a new file counts before its commit
    tokens = _path_like(doc.read_text())
    assert len(tokens) > 10, f"{doc.name}: the path extraction found almost nothing: {tokens}"
    missing = sorted({t for t in tokens if not _exists(t, set(tracked))})
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


def test_the_path_check_catches_a_missing_file():
    tracked = {"scripts/gpu_data.sh", "moelora_lab/reference.py", "moelora_lab/data/h200/align.csv"}
    assert _path_like("run `scripts/gpu_suite.sh` or `bash scripts/gpu_data.sh`, see `align.csv`, "
                      "`<out>/<name>.csv`, `chrome://tracing`, `--out DIR`, `.ci/run`") == \
        ["scripts/gpu_suite.sh", "scripts/gpu_data.sh", "align.csv", ".ci/run"]
    assert not _exists("scripts/gpu_suite.sh", tracked) and not _exists("h200/align.py", tracked)
    assert _exists("reference.py", tracked) and _exists("data/h200/", tracked) and _exists("scripts/", tracked)


def test_layout_lists_every_top_level_entry():
    top = {t.split("/")[0] + ("/" if "/" in t else "") for t in _tracked()}
    section = _readme().split("## Layout\n", 1)[1].split("```", 2)[1]
    listed = {line.split()[0] for line in section.splitlines() if line and not line[0].isspace()}
    assert listed == top, f"README layout: missing {sorted(top - listed)}, not in the repository {sorted(listed - top)}"


def test_install_notes_state_the_pinned_versions():
    text = " ".join(_readme().split())
    python = re.search(r'requires-python = ">=(\d+\.\d+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert f"Needs Python ≥ {python}" in text
    pins = dict(re.findall(r"^([\w-]+)==([\w.+]+)", (ROOT / "requirements-cpu.txt").read_text(), re.M))
    assert f"`torch=={pins['torch']}`" in text
    assert f"torch {pins['torch']}, triton {pins['triton']} (what torch {pins['torch']} pulls from PyPI), " \
           f"numpy {pins['numpy']}" in text
    conda = re.search(r"^name: (\S+)", (ROOT / "environment.yml").read_text(), re.M).group(1)
    assert f"conda activate {conda}" in text and "conda env create -f environment.yml" in text


def test_first_screen_is_in_the_order_a_newcomer_needs():
    """What the lab is, a figure, the two commands, what next; the install notes after. No measured number is
    typed there (the figure carries the data)."""
    first = _readme().split("## Install notes", 1)[0]
    order = [first.index("A Jupyter-first lab"), first.index("!["), first.index("make lab "),
             first.index("make test "), first.index("**What next:**")]
    assert order == sorted(order), "README's first screen: paragraph, figure, make lab / make test, what next"
    assert "00_tour.ipynb" in first.split("**What next:**", 1)[1]
    prose = re.sub(r"```.*?```|!\[[^\]]*\]\([^)]*\)|`[^`]*`", "", first, flags=re.S)
    numbers = set(re.findall(r"\w*\d[\w.]*", prose)) - {"H200", "02"}     # a GPU's name, a notebook's number
    assert not numbers, f"README's first screen types numbers no test guards: {sorted(numbers)}"


def test_linked_files_exist():
    targets = re.findall(r"\]\(([^)#\s]+)\)", _readme())
    local = [t for t in targets if "://" not in t]
    assert any(t.endswith(".png") for t in local), "README's first screen has no figure from the lab"
    missing = [t for t in local if not (ROOT / t).is_file()]
    assert not missing, f"README links to files that do not exist: {missing}"
