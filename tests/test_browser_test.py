"""scripts/browser_test.py: what counts as a broken explorer, judged from page snapshots (no browser
needed here; `make test-browser` runs the script itself in headless Chromium)."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("browser_test", ROOT / "scripts" / "browser_test.py")
browser_test = importlib.util.module_from_spec(spec)
spec.loader.exec_module(browser_test)


def snap(text="64 pairs", imgs=None, **extra):
    img = dict(loaded=True, w=1425, h=1050, over=0, ink=0.2, hash="1425x1050:7")
    return dict(dict(text=text, imgs=[img] if imgs is None else imgs, sideways=0, busy=False, error=False, cut=[]),
                **extra)


def test_a_good_redraw_passes():
    assert browser_test.problems(snap("32 pairs"), snap()) == []


def test_each_kind_of_breakage_is_named():
    before = snap()
    blank = dict(before["imgs"][0], ink=0.001)
    cases = {
        "did not change": snap(unchanged=True),
        "figure is gone": snap(imgs=[]),
        "blank": snap(imgs=[blank]),
        "px past the notebook column": snap(imgs=[dict(blank, ink=0.3, over=40)]),
        "scrolls sideways": snap(sideways=1),
        "label cut": snap(cut=["tokens M"]),
        "shows an error": snap("draw failed: ValueError", error=True),
        "widget shows as text": snap("HBox(children=(Dropdown(description='preset', …"),
    }
    for words, after in cases.items():
        found = browser_test.problems(after, before)
        assert len(found) == 1 and words in found[0], (words, found)


def test_an_explorer_without_a_figure_may_stay_without_one():
    assert browser_test.problems(snap("a table", imgs=[]), snap("a list", imgs=[])) == []
