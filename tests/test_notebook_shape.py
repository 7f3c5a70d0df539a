"""The lessons' shape: a length budget, answers first, sections that close on what the learner now knows,
exercises spread through 05, and an appendix that the lessons link to (and nbval executes, as it does every
notebook under notebooks/)."""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent / "notebooks"
LESSONS = sorted(ROOT.glob("*.ipynb"))
APPENDIX = sorted((ROOT / "appendix").glob("*.ipynb"))

MAIN_PATH_WORDS = 21_000     # every lesson's markdown together (eleven lessons, 00 to 10)
NOTEBOOK_WORDS = 4_000
NOTEBOOK_CELLS = 60
LAYER_DESIGN_WORDS, LAYER_DESIGN_CELLS, LAYER_DESIGN_EXERCISES = 3_500, 45, 3


def load(path):
    return json.loads(path.read_text())["cells"]


def text(cell):
    return "".join(cell["source"])


def words(path):
    return sum(len(re.findall(r"\S+", text(c))) for c in load(path) if c["cell_type"] == "markdown")


def sections(cells):
    """(heading, cells) for every `## ` section of a notebook; what comes before the first one is left out."""
    out = []
    for c in cells:
        if c["cell_type"] == "markdown" and text(c).lstrip().startswith("## "):
            out.append((text(c).lstrip().splitlines()[0], []))
        if out:
            out[-1][1].append(c)
    return out


def test_the_main_path_keeps_its_length_budget():
    counts = {p.stem: words(p) for p in LESSONS}
    assert sum(counts.values()) <= MAIN_PATH_WORDS, (
        f"the lessons hold {sum(counts.values())} markdown words together, over the budget of {MAIN_PATH_WORDS}: "
        f"{counts}; cut repetition, or move history to notebooks/appendix/")


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_no_lesson_is_too_long(path):
    cells = load(path)
    assert len(cells) <= NOTEBOOK_CELLS, f"{path.name}: {len(cells)} cells, over {NOTEBOOK_CELLS}"
    assert words(path) <= NOTEBOOK_WORDS, f"{path.name}: {words(path)} markdown words, over {NOTEBOOK_WORDS}"


def test_the_layer_design_lesson_is_a_lesson():
    path = ROOT / "05_layer_design.ipynb"
    cells = load(path)
    assert len(cells) <= LAYER_DESIGN_CELLS and words(path) <= LAYER_DESIGN_WORDS, (len(cells), words(path))
    where = [heading for heading, body in sections(cells)
             if any(c["cell_type"] == "code" and re.search(r"\bcheck\(\s*\"05\.", text(c)) for c in body)]
    assert len(where) >= LAYER_DESIGN_EXERCISES and len(set(where)) >= LAYER_DESIGN_EXERCISES, (
        f"05's exercises sit in {where}: want at least {LAYER_DESIGN_EXERCISES}, in as many sections")


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_answers_come_first(path):
    """Under the title: the question, where the answer is, and a cell that prints the answer from the data
    (a claim, so it fails when the data stop supporting it) before the first section."""
    cells = load(path)
    title = text(cells[0])
    assert re.match(rf"# {path.stem[:2]} · ", title), f"{path.name}: cell 0 is not the title"
    assert "**Question.**" in title and "**Answer.**" in title, f"{path.name}: cell 0 lacks the question or answer"
    first_section = next(i for i, c in enumerate(cells) if c["cell_type"] == "markdown"
                         and text(c).lstrip().startswith("## "))
    answer = [i for i, c in enumerate(cells[:min(first_section, 5)])
              if c["cell_type"] == "code" and text(c).lstrip().startswith("# The answer")]
    assert answer, f"{path.name}: no `# The answer` cell among the first cells, before the first section"
    assert "claim(" in text(cells[answer[0]]), f"{path.name}: the answer cell prints no claim()"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_sections_say_what_the_learner_now_knows(path):
    missing = [heading for heading, body in sections(load(path))
               if not any(c["cell_type"] == "markdown" and "**Now you know:**" in text(c) for c in body)]
    assert not missing, f"{path.name}: these sections end without a '**Now you know:**' line: {missing}"


def test_the_appendix_is_linked_from_the_tour_and_the_layer_lesson():
    names = [p.name for p in APPENDIX]
    assert "A0_data_provenance.ipynb" in names and "A1_layer_design_history.ipynb" in names, names
    tour = " ".join(text(c) for c in load(ROOT / "00_tour.ipynb"))
    assert all(f"appendix/{n}" in tour for n in names), f"00 does not link every appendix notebook: {names}"
    assert "appendix/A1_layer_design_history.ipynb" in " ".join(text(c) for c in load(ROOT / "05_layer_design.ipynb"))


@pytest.mark.parametrize("path", APPENDIX, ids=lambda p: p.stem)
def test_appendix_notebooks_say_where_they_belong(path):
    title = text(load(path)[0])
    assert re.match(r"# A\d · ", title), f"{path.name}: cell 0 is not an appendix title"
    assert re.search(r"\]\(\.\./0\d_\w+\.ipynb\)", title), f"{path.name}: the title does not link its lesson"


def test_budget_checks_can_fail(tmp_path):
    """The counters see a long notebook and a section without its closing line."""
    cell = {"cell_type": "markdown", "metadata": {}, "source": ["## 1. A section\n", "word " * 5000]}
    path = tmp_path / "09_long.ipynb"
    path.write_text(json.dumps({"cells": [cell]}))
    assert words(path) > NOTEBOOK_WORDS
    assert [h for h, body in sections(load(path))] == ["## 1. A section"]
