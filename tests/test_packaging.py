"""Packaging: what ``make test-wheel`` checks (scripts/wheel_check.py) and how ``make venv`` picks its torch
build (scripts/torch_source.py). The wheel itself is built and used by ``make test-wheel``."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


wheel_check = _script("wheel_check")
torch_source = _script("torch_source")


def test_snippets_are_the_python_blocks_in_order():
    """What the wheel check runs (tests/test_readme.py runs the same blocks on the checkout)."""
    text = "intro\n```bash\nmake\n```\n```python\na = 1\n```\ntext\n```python\nprint(a)\n```\n"
    assert wheel_check.readme_snippets(text) == ["a = 1\n", "print(a)\n"]
    with pytest.raises(ValueError, match="text: no ```python block"):
        wheel_check.readme_snippets("```bash\nmake\n```\n")
    assert "import moelora_lab" in wheel_check.readme_snippets((ROOT / "README.md").read_text())[0]


def test_source_files_are_what_git_would_commit():
    files = set(wheel_check.source_files())
    assert {"pyproject.toml", "moelora_lab/__init__.py", "moelora_lab/data/h200/layer.csv"} <= files
    assert not [f for f in files if f.startswith((".venv/", "build/")) or "__pycache__" in f]


def test_wheel_problems_name_missing_and_stale_files():
    files = ["README.md", "moelora_lab/__init__.py", "moelora_lab/data/h200/layer.csv"]
    good = ["moelora_lab/__init__.py", "moelora_lab/data/h200/layer.csv", "moelora_lab-0.1.0.dist-info/RECORD"]
    assert wheel_check.wheel_problems(good, files) == []
    bad = ["moelora_lab/__init__.py", "moelora_lab/old.py"]
    assert wheel_check.wheel_problems(bad, files) == [
        "missing from the wheel: moelora_lab/data/h200/layer.csv",
        "in the wheel but not a source file: moelora_lab/old.py"]


def test_torch_pin(tmp_path):
    req = tmp_path / "req.txt"
    req.write_text("# torch==0.1 in a comment\nnumpy==2.4.6\ntorch==2.13.0\n")
    assert torch_source.torch_pin(req) == "2.13.0"
    req.write_text("numpy==2.4.6\n")
    with pytest.raises(ValueError, match="requirements: .* has no 'torch==<version>' line"):
        torch_source.torch_pin(req)


def _probe(answer, asked, name):
    def probe():
        asked.append(name)
        return answer
    return probe


@pytest.mark.parametrize("local, gpu, user_vars, cpu_index, args, said, asked", [
    (True, True, ["PIP_FIND_LINKS"], True, [], "2.13.0+cpu (CPU build): a local wheel", ["local"]),
    (False, True, [], True, [], "the CUDA build): nvidia-smi lists a GPU", ["local", "gpu"]),
    (False, False, ["PIP_EXTRA_INDEX_URL"], True, [], "PIP_EXTRA_INDEX_URL set, so nothing is added",
     ["local", "gpu"]),
    (False, False, [], True, ["--extra-index-url", "https://download.pytorch.org/whl/cpu"],
     "2.13.0+cpu (CPU build, ~200 MB): no NVIDIA GPU", ["local", "gpu", "cpu_index"]),
    (False, False, [], False, [], "did not answer; to pick it: PIP_EXTRA_INDEX_URL=", ["local", "gpu", "cpu_index"]),
])
def test_torch_decision_order(local, gpu, user_vars, cpu_index, args, said, asked):
    """The CPU index is added only when nothing else decides and it answers; probes run only when needed."""
    calls = []
    got, line = torch_source.decide("2.13.0", local=_probe(local, calls, "local"), gpu=_probe(gpu, calls, "gpu"),
                                    user_vars=user_vars, cpu_index=_probe(cpu_index, calls, "cpu_index"))
    assert got == args and said in line and calls == asked, (got, line, calls)


def test_cpu_index_probe_reads_the_listed_versions(tmp_path, monkeypatch):
    """The probe asks pip about one index only and looks for ``<pin>+cpu`` among its versions; an index
    that does not answer gives False (at once: no retries)."""
    page = tmp_path / "simple" / "torch"
    page.mkdir(parents=True)
    page.joinpath("index.html").write_text("".join(
        f'<a href="torch-{v}-py3-none-any.whl">torch-{v}-py3-none-any.whl</a>\n'
        for v in ("2.12.0", "2.13.0", "2.13.0+cpu")))
    monkeypatch.setattr(torch_source, "CPU_INDEX", (tmp_path / "simple").as_uri())
    assert torch_source.cpu_index_offers("2.13.0")
    assert not torch_source.cpu_index_offers("2.12.0")
    monkeypatch.setattr(torch_source, "CPU_INDEX", (tmp_path / "nowhere").as_uri())
    assert not torch_source.cpu_index_offers("2.13.0")
