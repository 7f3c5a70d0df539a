"""scripts/normalize_notebooks.py: what `make notebooks` strips, and the committed notebooks are stripped."""
import copy
import importlib.util
import json
from pathlib import Path

import pytest

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
    assert out["cells"][0]["outputs"][0]["data"] == {"text/plain": ["HBox(...)"]}
    assert normalize_notebooks.normalize(copy.deepcopy(out)) == out


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebooks_are_normalized(path):
    nb = json.loads(path.read_text())
    assert normalize_notebooks.normalize(copy.deepcopy(nb)) == nb, f"run: python scripts/normalize_notebooks.py {path}"
