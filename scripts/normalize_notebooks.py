"""Store notebooks exactly as JupyterLab writes them when it opens and saves them, minus what changes
from one execution to the next, so `make notebooks` twice leaves git clean and a notebook opens
without the unsaved-changes dot:

* per-cell execution timestamps and the saved widget state (its model ids are random) are dropped;
* the widget-view entries of outputs are dropped (no kernel holds their models when the notebook is
  opened); where what remains is a widget's repr ("HBox(children=(...", "Output()"), it becomes a
  hint to run the cell (an explorer writes its own hint, which is kept);
* consecutive stream outputs of one name (stdout, stderr) become one output, as JupyterLab shows
  them: how the kernel's writes were cut into messages depends on timing;
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
        if "outputs" in cell:
            cell["outputs"] = merge_streams(cell["outputs"])
        for out in cell.get("outputs", []):
            data = out.get("data")
            if data and WIDGET_VIEW in data:
                del data[WIDGET_VIEW]
                text = data.get("text/plain", "")
                text = "".join(text) if isinstance(text, list) else text
                if not text or WIDGET_REPR.match(text):
                    data["text/plain"] = [HINT]
    return nb


def merge_streams(outputs: list[dict]) -> list[dict]:
    """Join runs of stream outputs of the same name; the text is stored as lines, as nbformat does."""
    merged: list[dict] = []
    for out in outputs:
        if out.get("output_type") != "stream":
            merged.append(out)
            continue
        text = out["text"] if isinstance(out["text"], str) else "".join(out["text"])
        last = merged[-1] if merged else None
        if last is not None and last.get("output_type") == "stream" and last["name"] == out["name"]:
            text = "".join(last["text"]) + text
            merged.pop()
        merged.append({**out, "text": text.splitlines(keepends=True)})
    return merged


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
