"""moelora_lab.plots.explorer: redraws into widgets it owns, never through pyplot; refuses controls
that offer no choice; shows a hint where no kernel ran the cell and the error where a draw fails."""
import threading

import matplotlib.pyplot as plt
import pytest

widgets = pytest.importorskip("ipywidgets")      # the lab extra (absent from a bare GPU image)

from moelora_lab.plots.explorer import Explorer, check_controls, label_width

PNG = b"\x89PNG\r\n\x1a\n"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def line(fig, slope, label):
    fig.add_subplot().plot([0, 1], [0, slope])
    return f"{label}: slope {slope}"


def make(draw=line, **kwargs):
    controls = dict(slope=widgets.SelectionSlider(options=[1, 2, 3], value=1, description="slope"),
                    label=widgets.Dropdown(options=["a", "b"], value="a", description="label of the line"))
    return Explorer(controls, draw, figsize=(4, 3), **kwargs)


def test_first_draw_fills_the_image_and_the_text():
    ex = make()
    assert ex.draws == 1 and ex.error is None
    assert bytes(ex.image.value).startswith(PNG) and ex.view.children == (ex.image,)
    assert "a: slope 1" in ex.text.value
    assert ex.image.width == "400"                       # 4 inches at 100 dpi on screen
    assert "moelora-explorer" in ex.widget._dom_classes


def test_every_change_redraws_the_figure_and_the_text():
    ex = make()
    seen = {bytes(ex.image.value)}
    for slope in (2, 3, 1):
        ex.controls["slope"].value = slope
        seen.add(bytes(ex.image.value))
        assert f"slope {slope}" in ex.text.value
    ex.controls["label"].value = "b"
    assert ex.draws == 5 and len(seen) == 3 and "b: slope 1" in ex.text.value


def test_no_figure_passes_through_pyplot():
    before = plt.get_fignums()
    ex = make()
    ex.controls["slope"].value = 2
    assert plt.get_fignums() == before


def test_a_failing_draw_clears_the_view_and_shows_the_error():
    def draw(fig, slope, label):
        if slope == 2:
            raise ValueError("slope 2 is not drawn")
        return line(fig, slope, label)

    ex = make(draw)
    ex.controls["slope"].value = 2
    assert isinstance(ex.error, ValueError) and ex.view.children == ()
    assert "draw failed" in ex.text.value and "slope 2 is not drawn" in ex.text.value
    assert "moelora-explorer-error" in ex.widget._dom_classes
    ex.controls["slope"].value = 3                       # the next good draw brings the figure back
    assert ex.error is None and ex.view.children == (ex.image,)
    assert "moelora-explorer-error" not in ex.widget._dom_classes


def test_draw_may_return_a_widget_or_nothing_to_show():
    table = widgets.HTML("<table></table>")
    ex = make(lambda fig, slope, label: (table, "a table") if slope == 1 else None)
    assert ex.view.children == (table,) and "a table" in ex.text.value
    ex.controls["slope"].value = 2                       # no axes, no text: an empty view, no error
    assert ex.view.children == () and ex.text.value == "" and ex.error is None


def test_draw_returning_something_else_is_an_error_shown():
    ex = make(lambda fig, slope, label: 42)
    assert isinstance(ex.error, TypeError) and "draw failed" in ex.text.value


def test_a_change_made_while_drawing_is_drawn_after():
    calls = []

    def draw(fig, slope, label):
        calls.append(slope)
        if len(calls) == 2:                             # a change arrives during this draw
            ex.controls["slope"].value = 3
        return line(fig, slope, label)

    ex = make(draw)
    ex.controls["slope"].value = 2
    assert calls == [1, 2, 3] and "slope 3" in ex.text.value


def test_draws_from_two_threads_do_not_overlap():
    active, overlaps = [], []

    def draw(fig, slope, label):
        active.append(1)
        overlaps.append(len(active) > 1)
        fig.add_subplot().plot([0, slope])
        active.pop()

    ex = make(draw)
    threads = [threading.Thread(target=ex.update) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not any(overlaps) and ex.draws >= 2


def test_the_saved_output_is_a_hint_to_run_the_cell():
    bundle = make()._repr_mimebundle_()
    assert WIDGET_VIEW in bundle
    assert bundle["text/plain"] == ("Explorer (slope, label of the line): run this cell to get the controls and "
                                    "the figure.")


def test_labels_get_one_width_that_fits_the_longest():
    ex = make()
    widths = {w.style.description_width for w in ex.controls.values()}
    assert widths == {label_width(ex.controls)} and float(widths.pop()[:-2]) > 0.6 * len("label of the line")
    assert all(w.continuous_update is False for w in ex.controls.values() if hasattr(w, "continuous_update"))


@pytest.mark.parametrize("control, message", [
    (widgets.Dropdown(options=["only"], description="preset"), "offers no choice"),
    (widgets.ToggleButtons(options=["only"], description="preset"), "offers no choice"),
    (widgets.SelectionSlider(options=[16, 64], description="tokens"), "two stops"),
    (widgets.IntSlider(min=1, max=2, description="tokens"), "2 stop"),
])
def test_controls_without_a_real_choice_are_refused(control, message):
    with pytest.raises(ValueError, match=message):
        check_controls({"x": control, "y": widgets.Checkbox(description="y")})


def test_duplicate_labels_and_bad_arguments_are_refused():
    same = dict(a=widgets.Checkbox(description="rank"), b=widgets.Dropdown(options=[1, 2], description="rank"))
    with pytest.raises(ValueError, match="both are labelled 'rank'"):
        check_controls(same)
    with pytest.raises(TypeError, match="controls"):
        check_controls({})
    with pytest.raises(TypeError, match=r"controls\['a'\]"):
        check_controls({"a": widgets.Button(description="go")})
    with pytest.raises(TypeError, match="draw"):
        Explorer({"a": widgets.Checkbox(description="a")}, draw=None)
    with pytest.raises(ValueError, match="figsize"):
        Explorer({"a": widgets.Checkbox(description="a")}, line, figsize=(0, 3))
