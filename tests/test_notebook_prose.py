"""The notebooks' prose cannot drift from their data: no measured or modelled number is typed into
markdown (numbers with a unit of time, rate, bytes, ratio or share), and every notebook compares at
least three of its outputs under nbval (``# NBVAL_CHECK_OUTPUT``)."""
import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
EVERY_NOTEBOOK = NOTEBOOKS + sorted((Path(__file__).parent.parent / "notebooks" / "appendix").glob("*.ipynb"))
# a number followed by a unit: what a measurement or the byte model would print
MEASURED = re.compile(r"\d[\d.,]*\s*(?:–\s*[\d.,]+\s*)?(µs|us\b|ms\b|%|×(?!\s*\d)|x\b(?!\s*\d)|TB/s|GB/s|TFLOP/s|GiB|MiB|KiB|MB\b|GB\b)")


def cells(path, kind):
    return [(i, "".join(c["source"])) for i, c in enumerate(json.loads(path.read_text())["cells"])
            if c["cell_type"] == kind]


def test_the_lab_has_its_notebooks():
    names = [p.stem for p in NOTEBOOKS]
    assert names == ["00_tour", "01_routing", "02_hbm_round_trip", "03_register_resident_rank",
                     "04_stream_overlap", "05_layer_design", "06_capstone", "07_adapters",
                     "08_beyond_one_gpu", "09_backward_pass", "10_quantized_base"]


@pytest.mark.parametrize("path", EVERY_NOTEBOOK, ids=lambda p: p.stem)
def test_no_measured_number_in_markdown(path):
    found = []
    for i, text in cells(path, "markdown"):
        text = re.sub(r"`[^`]*`", "", text)                # code spans name things, they do not measure
        found += [f"cell {i}: {m.group(0)!r}" for m in MEASURED.finditer(text)]
    assert not found, (f"{path.name}: numbers typed into markdown drift from the data; print them from the "
                       f"data or state them next to a claim() that checks them: {found}")


@pytest.mark.parametrize("path", EVERY_NOTEBOOK, ids=lambda p: p.stem)
def test_outputs_checked_by_nbval(path):
    checked = [i for i, text in cells(path, "code") if "# NBVAL_CHECK_OUTPUT" in text]
    assert len(checked) >= 3, f"{path.name}: only cells {checked} are compared by nbval; want at least 3"


def _claim_calls(path):
    import ast
    for i, text in cells(path, "code"):
        text = "\n".join(line for line in text.split("\n") if not line.lstrip().startswith(("%", "!")))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "claim":
                yield i, node


@pytest.mark.parametrize("path", EVERY_NOTEBOOK, ids=lambda p: p.stem)
def test_every_claim_can_fail(path):
    """A claim() checks its sentence against the data: its ``holds`` is an expression, never absent or a constant
    (a sentence that holds whatever the data says is printed with print())."""
    import ast
    bad = []
    for i, node in _claim_calls(path):
        holds = {k.arg: k.value for k in node.keywords}.get("holds")
        if holds is None or isinstance(holds, ast.Constant):
            bad.append(f"cell {i}: {ast.unparse(node)[:90]}")
    assert not bad, f"{path.name}: claims that cannot fail: {bad}"
