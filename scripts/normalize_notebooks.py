"""Drop what changes from one execution of a notebook to the next, so `make notebooks` twice leaves
git clean: per-cell execution timestamps, the saved widget state (its model ids are random), and
the widget-view entries of outputs (their text/plain form stays). The kernelspec is written as
JupyterLab's running kernel names it, so a notebook opens without the unsaved-changes dot.

    python scripts/normalize_notebooks.py notebooks/*.ipynb
"""
from __future__ import annotations

import json
import sys

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def normalize(nb: dict) -> dict:
    nb["metadata"].pop("widgets", None)
    nb["metadata"]["kernelspec"] = dict(KERNELSPEC)
    for cell in nb["cells"]:
        cell.get("metadata", {}).pop("execution", None)
        for out in cell.get("outputs", []):
            data = out.get("data")
            if data and WIDGET_VIEW in data:
                del data[WIDGET_VIEW]
    return nb


def main(paths: list[str]) -> int:
    for path in paths:
        with open(path) as f:
            nb = json.load(f)
        text = json.dumps(normalize(nb), indent=1, ensure_ascii=False) + "\n"
        with open(path, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
