"""scripts/normalize_notebooks.py: what `make notebooks` strips, and the committed notebooks are stripped."""
import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("normalize_notebooks", ROOT / "scripts" / "normalize_notebooks.py")
normalize_notebooks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(normalize_notebooks)
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_volatile_parts_are_dropped():
    widget = {"application/vnd.jupyter.widget-view+json": {"model_id": "3f2a"}, "text/plain": ["HBox(...)"]}
    nb = {"metadata": {"widgets": {"state": {}}, "kernelspec": {"display_name": "Python 3", "name": "python3"}},
          "cells": [{"cell_type": "code", "metadata": {"execution": {"iopub.status.idle": "2026-11-30T12:00"}},
                     "outputs": [{"output_type": "display_data", "data": widget, "metadata": {}}]}]}
    out = normalize_notebooks.normalize(copy.deepcopy(nb))
    assert "widgets" not in out["metadata"]
    assert out["metadata"]["kernelspec"]["display_name"] == "Python 3 (ipykernel)"
    assert out["cells"][0]["metadata"] == {}
    assert out["cells"][0]["outputs"][0]["data"] == {"text/plain": [normalize_notebooks.HINT]}
    assert normalize_notebooks.normalize(copy.deepcopy(out)) == out


@pytest.mark.parametrize("text, kept", [
    (["HBox(children=(VBox(children=(SelectionSlider(continuous_update=False, description='tokens M'…"], False),
    ("Output()", False),
    ("Dropdown(description='preset', options=('a', 'b'), value='a')", False),
    (["Explorer (tokens M, rank r): run this cell to get the controls and the figure."], True),
])
def test_widget_reprs_become_a_hint_and_an_explorer_keeps_its_own(text, kept):
    out = {"output_type": "display_data", "metadata": {},
           "data": {"application/vnd.jupyter.widget-view+json": {"model_id": "3f2a"}, "text/plain": text}}
    nb = normalize_notebooks.normalize({"metadata": {}, "cells": [{"cell_type": "code", "outputs": [out]}]})
    assert nb["cells"][0]["outputs"][0]["data"] == {"text/plain": text if kept else [normalize_notebooks.HINT]}


def test_outputs_without_a_widget_view_are_left_alone():
    text = {"text/plain": ["Output()"]}                  # printed by a cell, not a widget: not ours to change
    nb = normalize_notebooks.normalize({"metadata": {}, "cells": [{"cell_type": "code", "outputs": [
        {"output_type": "execute_result", "metadata": {}, "data": dict(text)}]}]})
    assert nb["cells"][0]["outputs"][0]["data"] == text


def test_written_as_jupyterlab_writes_it(tmp_path):
    # one-space indent, characters as they are, a final newline: what JupyterLab saves, byte for byte
    nb = {"cells": [{"cell_type": "markdown", "id": "a1", "metadata": {}, "source": ["µs · L·r"]}],
          "metadata": {"kernelspec": dict(normalize_notebooks.KERNELSPEC)}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "x.ipynb"
    path.write_text(json.dumps(nb))
    normalize_notebooks.main([str(path)])
    assert path.read_text() == json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
    assert "µs · L·r" in path.read_text() and path.read_text().startswith('{\n "cells": [\n  {\n   "cell_type"')


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebooks_are_normalized(path):
    nb = json.loads(path.read_text())
    assert normalize_notebooks.normalize(copy.deepcopy(nb)) == nb, f"run: python scripts/normalize_notebooks.py {path}"


def test_stream_outputs_of_one_name_are_joined():
    outs = [{"output_type": "stream", "name": "stdout", "text": ["a\n", "b"]},
            {"output_type": "stream", "name": "stdout", "text": "c\nd\n"},
            {"output_type": "stream", "name": "stderr", "text": "w\n"},
            {"output_type": "stream", "name": "stdout", "text": "e\n"}]
    nb = normalize_notebooks.normalize({"metadata": {}, "cells": [{"cell_type": "code", "outputs": outs}]})
    assert nb["cells"][0]["outputs"] == [
        {"output_type": "stream", "name": "stdout", "text": ["a\n", "bc\n", "d\n"]},
        {"output_type": "stream", "name": "stderr", "text": ["w\n"]},
        {"output_type": "stream", "name": "stdout", "text": ["e\n"]}]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the tour is committed as run on the CPU; on a GPU its first "
                                                     "cell names the GPU and the kernels run natively")
def test_executing_the_tour_again_leaves_it_as_committed(tmp_path):
    """What `make notebooks` promises: executed again and normalized, a notebook is the committed file."""
    nbclient = pytest.importorskip("nbclient")
    path = ROOT / "notebooks" / "00_tour.ipynb"
    committed = json.loads(path.read_text())
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(str(path), as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    again = normalize_notebooks.normalize(json.loads(nbformat.writes(nb)))
    for i, (old, new) in enumerate(zip(committed["cells"], again["cells"])):
        assert old.get("outputs") == new.get("outputs"), f"cell {i} prints something else when run again"
    assert again == committed
