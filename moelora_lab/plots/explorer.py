"""Explorers: a few controls and one view that is redrawn whenever a control changes.

    ex = Explorer(controls, draw, figsize=(9.5, 5))
    display(ex)

``controls`` maps each argument of ``draw`` to a widget with a ``value`` (Dropdown, SelectionSlider,
ToggleButtons, Checkbox, ...). ``draw(fig, **values)`` fills ``fig``, a fresh
``matplotlib.figure.Figure`` of ``figsize`` inches, and returns what goes under it:

* ``None`` or a ``str``: the figure is shown (when it has axes) and the text under it;
* an ``ipywidgets.Widget`` (an interactive plot, a table): shown instead of the figure;
* a tuple ``(widget_or_None, text_or_None)``: both.

The explorer owns every widget it shows: an ``Image`` that receives the figure as PNG bytes and an
``HTML`` that receives the text. A redraw is a pair of widget-state updates, so it does not matter
on which thread or after which message the kernel runs the callback. (``interactive_output`` with
``print`` and ``plt.show()`` inside the callback relies on the Output widget capturing whatever the
kernel publishes under the message that triggered it; JupyterLab 4.6 can deliver widget messages to
a kernel subshell, and a figure published under another message then lands elsewhere or nowhere.)
The figure never passes through pyplot, so the inline backend never shows it a second time.

Controls offer only choices that exist: the explorer refuses a choice widget with one option, a
slider with two stops or none, and duplicate labels, and sets one label width that fits the longest
label. When a draw fails, the view is cleared and the error is shown in place of the text.
"""
from __future__ import annotations

import html
import io
import threading
import traceback
from collections.abc import Callable

import ipywidgets as widgets
from matplotlib.figure import Figure

HINT = "Explorer ({names}): run this cell to get the controls and the figure."
CHOICES = (widgets.Dropdown, widgets.ToggleButtons, widgets.RadioButtons, widgets.SelectionSlider,
           widgets.Select)
SLIDERS = (widgets.IntSlider, widgets.FloatSlider)
PNG_SCALE = 1.5                 # PNG pixels per screen pixel: sharp on dense screens, quick to encode
TEXT_STYLE = ("font-family: var(--jp-code-font-family, monospace); font-size: var(--jp-code-font-size, 13px); "
              "white-space: pre-wrap; line-height: 1.35; margin: 4px 0 0 0")


def check_controls(controls: dict) -> None:
    """Raise ValueError/TypeError for controls that offer no real choice or share a label."""
    if not isinstance(controls, dict) or not controls:
        raise TypeError(f"controls: expected a non-empty dict name -> widget, got {controls!r}")
    seen = {}
    for name, w in controls.items():
        if not isinstance(w, widgets.ValueWidget):
            raise TypeError(f"controls[{name!r}]: expected an ipywidgets widget with a value, got {type(w).__name__}")
        if isinstance(w, CHOICES) and len(w.options) < 2:
            raise ValueError(f"controls[{name!r}]: {type(w).__name__} with {len(w.options)} option(s) "
                             f"{list(w.options)!r} offers no choice; show the value as text instead")
        if isinstance(w, widgets.SelectionSlider) and len(w.options) == 2:
            raise ValueError(f"controls[{name!r}]: a slider with two stops {list(w.options)!r}; use ToggleButtons")
        if isinstance(w, SLIDERS):
            stops = round((w.max - w.min) / w.step) + 1 if w.step else 1
            if stops <= 2:
                raise ValueError(f"controls[{name!r}]: a slider with {stops} stop(s) ({w.min}..{w.max}); "
                                 "use ToggleButtons or a fixed value")
        label = w.description.strip()
        if label and label in seen:
            raise ValueError(f"controls[{name!r}] and controls[{seen[label]!r}]: both are labelled {label!r}; "
                             "give each control its own description")
        seen[label] = name


def label_width(controls: dict) -> str:
    """One CSS width that fits the longest label on the left of a control (a checkbox has its label on
    the right and is indented by this width, so its box lines up with the other controls)."""
    longest = max((len(w.description) for w in controls.values() if not isinstance(w, widgets.Checkbox)), default=0)
    return f"{0.6 * longest + 1.5:.1f}em"


def button_width(w: widgets.ToggleButtons) -> str:
    """A CSS width that fits the longest option label of toggle buttons."""
    return f"{0.6 * max(len(str(label)) for label in w._options_labels) + 2:.1f}em"


class Explorer:
    """Controls, a view (figure or widget) and a text line; redrawn by ``draw`` on every change.

    controls: name -> value widget, passed to ``draw`` by name. draw(fig, **values): see the module.
    figsize: inches of the figure (it is shown at most as wide as the notebook column).
    controls_box: the widget that lays out the controls (default: one column, in the given order).
    dpi: pixels per inch on screen; the PNG has ``PNG_SCALE`` times as many, for sharp text on dense screens.
    """

    def __init__(self, controls: dict, draw: Callable, *, figsize: tuple[float, float] = (9.5, 5.0),
                 controls_box: widgets.Widget | None = None, dpi: int = 100):
        check_controls(controls)
        if not callable(draw):
            raise TypeError(f"draw: expected a function draw(fig, **values), got {draw!r}")
        if len(figsize) != 2 or not all(isinstance(v, (int, float)) and v > 0 for v in figsize):
            raise ValueError(f"figsize: expected (width, height) in inches, both > 0, got {figsize!r}")
        if controls_box is not None and not isinstance(controls_box, widgets.Widget):
            raise TypeError(f"controls_box: expected a widget laying out the controls, got {controls_box!r}")
        self.controls, self.draw, self.figsize, self.dpi = dict(controls), draw, tuple(figsize), int(dpi)
        width = label_width(self.controls)
        for w in self.controls.values():
            if w.description or isinstance(w, widgets.Checkbox):
                w.style.description_width = width
            if isinstance(w, widgets.ToggleButtons):           # the label beside the buttons, not above them
                w.style.button_width = w.style.button_width or button_width(w)
                w.layout.display, w.layout.flex_flow = "flex", "row wrap"
            if hasattr(w, "continuous_update"):
                w.continuous_update = False
        self.image = widgets.Image(format="png", layout=widgets.Layout(max_width="100%", height="auto", margin="0"))
        self.text = widgets.HTML()
        self.view = widgets.Box([self.image], layout=widgets.Layout(width="100%"))
        box = controls_box or widgets.VBox(list(self.controls.values()))
        self.widget = widgets.VBox([box, self.view, self.text])
        self.widget.add_class("moelora-explorer")
        self.draws, self.error = 0, None
        self._lock, self._pending, self._busy = threading.Lock(), False, False
        for w in self.controls.values():
            w.observe(self.update, names="value")
        self.update()

    def values(self) -> dict:
        """The controls' current values, by name."""
        return {name: w.value for name, w in self.controls.items()}

    def update(self, change=None) -> None:
        """Redraw with the current values; a change that arrives while drawing is drawn right after."""
        with self._lock:
            self._pending = True
            if self._busy:
                return
            self._busy = True
        try:
            while True:
                with self._lock:
                    if not self._pending:
                        self._busy = False
                        return
                    self._pending = False
                self._render(self.values())
        except BaseException:
            with self._lock:
                self._busy = False
            raise

    def _render(self, values: dict) -> None:
        self.widget.add_class("moelora-explorer-busy")
        fig = Figure(figsize=self.figsize, dpi=self.dpi, layout="constrained")
        try:
            result = self.draw(fig, **values)
            view, text = result if isinstance(result, tuple) else (
                (result, None) if isinstance(result, widgets.Widget) else (None, result))
            if view is not None and not isinstance(view, widgets.Widget):
                raise TypeError(f"draw returned {type(view).__name__} as its view; expected a widget or None")
            if text is not None and not isinstance(text, str):
                raise TypeError(f"draw returned {type(text).__name__} as its text; expected a str or None")
            self._show(view if view is not None else (self._png(fig) if fig.axes else None), text)
            self.error = None
            self.widget.remove_class("moelora-explorer-error")
        except Exception as exc:                # shown in the explorer, where the person who moved a control looks
            self.error = exc
            lines = traceback.format_exception(exc)
            self._show(None, None)
            self.text.value = (f'<div style="{TEXT_STYLE}; color: var(--jp-error-color1, #c00)">draw failed: '
                               f"{html.escape(f'{type(exc).__name__}: {exc}')}\n\n"
                               f"{html.escape(''.join(lines[-12:]))}</div>")
            self.widget.add_class("moelora-explorer-error")
        finally:
            self.draws += 1
            self.widget.remove_class("moelora-explorer-busy")

    def _png(self, fig: Figure) -> bytes:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=PNG_SCALE * self.dpi, facecolor="white")
        self.image.width = str(round(fig.get_figwidth() * self.dpi))
        return buf.getvalue()

    def _show(self, view, text: str | None) -> None:
        if isinstance(view, bytes):
            self.image.value = view
            view = self.image
        self.view.children = (view,) if view is not None else ()
        self.text.value = f'<div style="{TEXT_STYLE}">{html.escape(text)}</div>' if text else ""

    def hint(self) -> str:
        """What a notebook shows for the explorer where no kernel has run the cell."""
        return HINT.format(names=", ".join(w.description or name for name, w in self.controls.items()))

    def _repr_mimebundle_(self, **kwargs):
        bundle = self.widget._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = self.hint()
        return bundle
