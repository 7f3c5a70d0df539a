"""Store notebooks exactly as JupyterLab writes them when it opens and saves them, minus what changes
from one execution to the next, so `make notebooks` twice leaves git clean and a notebook opens
without the unsaved-changes dot:

* per-cell execution timestamps and the saved widget state (its model ids are random) are dropped;
* the widget-view entries of outputs are dropped (no kernel holds their models when the notebook is
  opened); where what remains is a widget's repr ("HBox(children=(...", "Output()"), it becomes a
  hint to run the cell (an explorer writes its own hint, which is kept);
* the kernelspec is written as JupyterLab's running kernel names it. JupyterLab also rewrites
  ``language_info`` from the kernel when it starts; the executing kernel has written that already.
  JSON is written as JupyterLab writes it: one-space indent, non-ASCII characters as they are, a
  final newline.

    python scripts/normalize_notebooks.py notebooks/*.ipynb
"""
from __future__ import annotations

import json
import re
import sys

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
WIDGET_REPR = re.compile(r"^(?:[A-Z]\w*\((?:children=|description=|layout=|.*\)$)|Output\(\)$)")
HINT = "Interactive controls: run this cell to get them."


def normalize(nb: dict) -> dict:
    nb["metadata"].pop("widgets", None)
    nb["metadata"]["kernelspec"] = dict(KERNELSPEC)
    for cell in nb["cells"]:
        cell.get("metadata", {}).pop("execution", None)
        for out in cell.get("outputs", []):
            data = out.get("data")
            if data and WIDGET_VIEW in data:
                del data[WIDGET_VIEW]
                text = data.get("text/plain", "")
                text = "".join(text) if isinstance(text, list) else text
                if not text or WIDGET_REPR.match(text):
                    data["text/plain"] = [HINT]
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
