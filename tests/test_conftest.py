"""tests/conftest.py: a notebook's cells stay on one pytest-xdist worker, in order."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_notebooks_cells_run_on_one_worker_in_order(tmp_path):
    pytest.importorskip("xdist")
    pytest.importorskip("nbval")
    nbformat = pytest.importorskip("nbformat")
    # Each cell needs the one before it; on two workers, a split notebook fails with NameError.
    # Six notebooks of six cells: a scheduler that splits them cannot keep every chain whole.
    for n in range(6):
        cells = ["import os\nchain = [os.getpid()]"]
        cells += [f"chain.append(os.getpid())\nassert len(chain) == {i + 2}" for i in range(5)]
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
        nbformat.write(nb, tmp_path / f"nb{n}.ipynb")
    (tmp_path / "test_plain.py").write_text("def test_one():\n    pass\n\ndef test_two():\n    pass\n")
    (tmp_path / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    run = subprocess.run(
        [sys.executable, "-m", "pytest", str(tmp_path), "-n", "2", "--nbval-lax", "--nbval-current-env",
         "-p", "no:cacheprovider", "-q", "--rootdir", str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "38 passed" in run.stdout, run.stdout[-2000:]


def test_one_unit_modules_exist_and_share_a_module_fixture():
    """The modules the scheduler keeps together are still there, and still set up a module-scoped fixture (else
    the entry is stale and only costs balance)."""
    from conftest import ONE_UNIT_MODULES
    root = pathlib.Path(__file__).resolve().parents[1]
    for path in ONE_UNIT_MODULES:
        assert '@pytest.fixture(scope="module")' in (root / path).read_text(), path
