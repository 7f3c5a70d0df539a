"""Layer timelines to explore in JupyterLab: zoom and pan along time, hover a bar for its bytes.

Shape legend: M tokens, r rank, L adapters; a record is ``{"stream": "main" | "lora", "name": stage,
"start_us": float, "end_us": float}`` (``moelora_lab.profile.timeline``).

Drawn with plotly: a ``plotly.graph_objects.Figure`` renders through the JupyterLab extension that
the plotly wheel itself installs (no extension build, no kernel round trip on hover or zoom), in
the notebook of Jupyter Notebook 7 alike, and inside an ipywidgets ``Output``; its HTML output
also draws where no kernel runs (nbviewer, a saved page). ``go.FigureWidget`` (through anywidget)
gives a figure that a widget owns and ``update_widget`` redraws in place. The static matplotlib
timelines (``plots.layer.draw_timelines``) stay the picture for nbval and for plain viewers.

``timeline_figure`` draws runs of one case on one time axis, one row per stream a run used;
``case_figure`` does it for a committed case (``results.load_traces()``), with every stage's bytes,
kernel and tiles from ``profile.timeline.stage_model`` and the copy rate measured with the data.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

from IPython.display import display

from .._backend import optional_module
from ..config import MoEShape
from ..layer.table import SCHEDULES as ROWS
from ..profile.profiler import kernel_label
from ..profile.timeline import bench_workload, overlap_metrics, stage_model
from ..profile.traffic import layer_traffic
from ..results import label as provenance_label
from .layer import trace_name
from .timeline import STAGE_COLORS

OTHER_COLOR = "#9467bd"                               # a stage STAGE_COLORS does not know
LANE_ROWS = {"main": "main", "lora": "side"}         # record stream -> row suffix of a two-stream run
# schedule -> (label, streams drawn) from its row: the op's LoRA kernels are named by their streams, others by name
SCHEDULES = {name: (f"{row.streams} stream{'s' * (row.streams > 1)}" if row.lora_paths is None else name, row.streams)
             for name, row in ROWS.items()}
# what case_figure draws by default: the op's LoRA kernels on one and two streams, and the LoRA inside the GEMMs
DEFAULT_SCHEDULES = tuple(name for name, row in ROWS.items() if row.lora_paths is None or row.gemm_lora_tiles)
# plotly's display options: the wheel zooms along time, no logo, no lasso/box selection. Pass a copy
# (dict(CONFIG)): plotly's to_html adds "responsive" to the dict it is given, and a responsive figure
# of auto height collapses to nothing in JupyterLab's output area.
CONFIG = MappingProxyType({"scrollZoom": True, "displaylogo": False, "modeBarButtonsToRemove": ("select2d", "lasso2d")})
INSTALL_HINT = "pip install -r requirements-cpu.txt (or `make venv`)"


def _go():
    """``plotly.graph_objects``, imported on first use: moelora_lab imports without plotly."""
    return optional_module("plotly.graph_objects", needed_for="the interactive timeline",
                           install=f"{INSTALL_HINT}, or pip install plotly")


def _check_positive(name: str, value) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}: expected a positive number or None, got {value!r}")
    return float(value)


def _check_stages(name: str, stages) -> dict[str, dict]:
    """{stage: bytes} or {stage: {"bytes", "kernel", "tiles", ...}} (``profile.timeline.stage_model``) ->
    {stage: {"bytes": ..., "kernel": ..., "tiles": {...}}}."""
    if stages is None:
        return {}
    if not isinstance(stages, Mapping):
        raise TypeError(f"{name}: expected a dict {{stage: bytes}} or stage_model(meta), got {type(stages).__name__}")
    out = {}
    for stage, v in stages.items():
        entry = dict(v) if isinstance(v, Mapping) else {"bytes": v}
        b = entry.get("bytes")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or b < 0:
            raise ValueError(f"{name}[{stage!r}]: expected a byte count >= 0 (or a dict with one under 'bytes'), "
                             f"got {v!r:.80}")
        if not isinstance(entry.get("tiles") or {}, Mapping):
            raise ValueError(f"{name}[{stage!r}]['tiles']: expected a dict of tile parameters, got {entry['tiles']!r}")
        out[stage] = entry
    return out


def _check_cases(cases, stage_bytes) -> list[tuple[str, list, int, dict]]:
    if isinstance(cases, (str, bytes, Mapping)) or not isinstance(cases, Sequence) or not cases:
        raise TypeError(f"cases: expected a non-empty list of (label, records[, streams[, stages]]), "
                        f"got {type(cases).__name__}")
    shared, out = _check_stages("stage_bytes", stage_bytes), []
    for case in cases:
        if not (isinstance(case, (tuple, list)) and 2 <= len(case) <= 4 and isinstance(case[0], str)):
            raise TypeError(f"cases: expected (label, records), (label, records, streams) or "
                            f"(label, records, streams, stages), got {case!r:.80}")
        name, records, streams = case[0], case[1], case[2] if len(case) > 2 else 2
        if streams not in (1, 2):
            raise ValueError(f"cases[{name!r}]: streams must be 1 or 2, got {streams!r}")
        if not isinstance(records, Sequence) or not records:
            raise ValueError(f"cases[{name!r}]: records must be a non-empty list of timeline records")
        for r in records:
            if not isinstance(r, Mapping) or not {"stream", "name", "start_us", "end_us"} <= set(r):
                raise ValueError(f"cases[{name!r}]: a record needs stream, name, start_us, end_us; got {r!r:.80}")
            if not isinstance(r.get("args", {}), Mapping):
                raise ValueError(f"cases[{name!r}]: a record's args must be a dict, got {r['args']!r:.80}")
            if streams == 2 and r["stream"] not in LANE_ROWS:
                raise ValueError(f"cases[{name!r}]: stream {r['stream']!r} of stage {r['name']!r} is not one of "
                                 f"{sorted(LANE_ROWS)}; pass streams=1 to put every stage on one row")
        own = _check_stages(f"cases[{name!r}] stages", case[3]) if len(case) == 4 else {}
        out.append((name, list(records), streams, own or shared))
    names = [c[0] for c in out]
    if len(set(names)) != len(names):
        raise ValueError(f"cases: labels must differ (they name the rows), got {names}")
    return out


def hover_text(stage: str, stream: str, start_us: float, dur_us: float, nbytes=None, copy_tbps=None, *,
               kernel: str | None = None, tiles: Mapping | None = None, args: Mapping | None = None) -> str:
    """The hover label of one bar: stage (and its ``kernel``), stream, start and duration; with ``nbytes``
    the bytes moved and the achieved bandwidth, bytes / duration (TB/s), also as a share of
    ``copy_tbps``; then the kernel's ``tiles`` and a record's own ``args``."""
    lines = [f"<b>{stage}</b>"] + ([f"kernel: {kernel}"] if kernel else [])
    lines += [f"stream: {stream}", f"start: {start_us:.1f} µs", f"duration: {dur_us:.1f} µs"]
    if nbytes is None:
        lines.append("bytes: not in the byte model")
    else:
        lines.append(f"bytes moved: {nbytes / 1e6:.2f} MB ({int(nbytes):,} B)")
        if dur_us > 0:
            tbps = nbytes / dur_us / 1e6
            share = f" = {tbps / copy_tbps:.0%} of the copy rate {copy_tbps:.2f} TB/s" if copy_tbps else ""
            lines.append(f"achieved: {tbps:.2f} TB/s{share}")
    items = [f"{k}={v}" for k, v in (tiles or {}).items()]
    lines += [("tiles: " if i == 0 else "       ") + ", ".join(items[i:i + 4]) for i in range(0, len(items), 4)]
    lines += [f"{k}: {v}" for k, v in (args or {}).items()]
    return "<br>".join(lines)


def timeline_figure(cases, *, stage_bytes=None, copy_tbps=None, floor_us=None, title=None):
    """One ``plotly.graph_objects.Figure`` of the runs in ``cases`` on one shared time axis.

    cases: [(label, records)], [(label, records, streams)] or [(label, records, streams, stages)];
    ``streams`` 2 (default) gives rows "label: main" and "label: side" (record streams "main" and
    "lora"), 1 gives one row "label: main" (a one-stream run has no side row). Time runs from each
    run's first start, in µs. stages, or ``stage_bytes`` for the runs without their own: {stage: bytes}
    or ``profile.timeline.stage_model(meta)`` (bytes, kernel, tiles), for the hover's bytes and achieved
    bandwidth; copy_tbps: the copy rate (TB/s) that bandwidth is set against; floor_us: a dashed line
    where the fused layer's byte floor ends. One bar trace per stage (the legend toggles it), coloured
    as in the static plot; a black line marks the end of each run's critical path, quoted beside it.
    Zoom and pan act on time only (the rows stay fixed); double-click resets.
    """
    go = _go()
    runs = _check_cases(cases, stage_bytes)
    copy_tbps, floor_us = _check_positive("copy_tbps", copy_tbps), _check_positive("floor_us", floor_us)
    if title is not None and not isinstance(title, str):
        raise TypeError(f"title: expected a str or None, got {type(title).__name__}")
    rows, bars, marks = [], {}, []
    for name, records, streams, stages in runs:
        metrics = overlap_metrics(records)              # checks the records (ends after starts)
        first = len(rows)
        rows += [f"{name}: {lane}" for lane in (("main", "side") if streams == 2 else ("main",))]
        t0 = min(r["start_us"] for r in records)
        for r in sorted(records, key=lambda r: r["start_us"]):
            lane = LANE_ROWS[r["stream"]] if streams == 2 else "main"
            start, dur, model = r["start_us"] - t0, r["end_us"] - r["start_us"], stages.get(r["name"], {})
            b = bars.setdefault(r["name"], dict(x=[], base=[], y=[], text=[]))
            b["x"].append(dur)
            b["base"].append(start)
            b["y"].append(f"{name}: {lane}")
            kernel = r.get("kernel") or ", ".join(map(kernel_label, r.get("kernels") or ())) or model.get("kernel")
            args = dict(r.get("args") or {}, **({"kernel time": f"{r['busy_us']:.1f} µs"} if "busy_us" in r else {}))
            b["text"].append(hover_text(r["name"], f"{lane} ({name})", start, dur, model.get("bytes"), copy_tbps,
                                        kernel=kernel, tiles=model.get("tiles"), args=args))
        marks.append((name, metrics["critical_path_us"], first, len(rows) - 1))
    fig = go.Figure()
    for stage, b in bars.items():                       # legend in the order the stages first ran
        fig.add_trace(go.Bar(name=stage, legendgroup=stage, orientation="h", x=b["x"], base=b["base"], y=b["y"],
                             width=0.7, marker=dict(color=STAGE_COLORS.get(stage, OTHER_COLOR),
                                                    line=dict(color="black", width=0.5)),
                             hovertext=b["text"], hovertemplate="%{hovertext}<extra></extra>"))
    for name, span, lo, hi in marks:
        fig.add_shape(type="line", name=f"critical path: {name}", x0=span, x1=span, y0=lo - 0.45, y1=hi + 0.45,
                      xref="x", yref="y", line=dict(color="black", width=2.5))
        fig.add_annotation(x=span, y=rows[lo], text=f"{span:.0f} µs", showarrow=False, xanchor="left",
                           yanchor="middle", xshift=4, font=dict(size=11))
    if floor_us:
        fig.add_shape(type="line", name=f"byte floor of the fused layer, {floor_us:.0f} µs", showlegend=True,
                      x0=floor_us, x1=floor_us, y0=0, y1=1, xref="x", yref="paper",
                      line=dict(color="black", width=1.2, dash="dash"))
    end = max(span for _, span, _, _ in marks)
    fig.update_layout(
        barmode="overlay", dragmode="zoom", hovermode="closest", height=150 + 44 * len(rows), autosize=True,
        margin=dict(l=10, r=10, t=70 if title else 40, b=50), template="plotly_white",
        title=dict(text=title, x=0, xanchor="left", font=dict(size=13)) if title else None,
        legend=dict(title=dict(text="stage (click: hide/show)"), traceorder="normal"),
        xaxis=dict(title=dict(text="time from the run's first start (µs); critical path: black line"),
                   range=[0, 1.12 * max(end, floor_us or 0)], showgrid=True),   # room for the labels
        yaxis=dict(categoryorder="array", categoryarray=rows, range=[len(rows) - 0.5, -0.5], fixedrange=True),
    )
    return fig


def case_copy_tbps(meta: Mapping) -> float | None:
    """The copy rate (TB/s) measured with a trace: ``meta['copy_tbps']``, else the rate its ``floor_us``
    was computed with (the byte model's floor / floor_us; the floor is the same for every LoRA path),
    else None."""
    if not isinstance(meta, Mapping):
        raise TypeError(f"meta: expected the 'meta' dict of a trace, got {type(meta).__name__}")
    if meta.get("copy_tbps"):
        return float(meta["copy_tbps"])
    if not meta.get("floor_us"):
        return None
    shape = MoEShape.from_name(meta["preset"])
    work = bench_workload(shape, meta["M"], meta.get("loras", 4), meta.get("seed", 0))
    return layer_traffic(shape, meta["rank"], work)["floor"].bytes / meta["floor_us"] / 1e6


def case_figure(traces: Mapping, preset: str, M: int, rank: int, *, schedules=DEFAULT_SCHEDULES,
                copy_tbps: float | None = None, title: str | None = None):
    """``timeline_figure`` of one case of ``traces`` (name -> {"meta", "records"}, as ``load_traces``
    gives): every schedule of ``schedules`` (rows of ``layer.SCHEDULES``) traced for it, labelled as in
    ``SCHEDULES`` ("1 stream", "2 streams" for the op's LoRA kernels, else the schedule's name);
    each run's bytes, kernels and tiles from ``profile.timeline.stage_model`` of its meta; the byte floor
    and the copy rate from the meta (``case_copy_tbps``; ``copy_tbps`` overrides it); the title names
    the case and the data's provenance."""
    if not isinstance(traces, Mapping):
        raise TypeError(f"traces: expected a dict name -> trace (load_traces()), got {type(traces).__name__}")
    if isinstance(schedules, str) or any(s not in SCHEDULES for s in schedules):
        raise ValueError(f"schedules: expected a tuple of {list(SCHEDULES)}, got {schedules!r}")
    chosen = [(s, traces[trace_name(preset, M, rank, s)]) for s in schedules
              if trace_name(preset, M, rank, s) in traces]
    if not chosen:
        have = sorted({(t["meta"]["preset"], t["meta"]["M"], t["meta"]["rank"]) for t in traces.values()})
        raise ValueError(f"preset, M, rank: no trace of {preset!r}, M = {M}, rank {rank} for schedules "
                         f"{list(schedules)}; traced (preset, M, rank): {have}")
    meta = chosen[0][1]["meta"]
    if copy_tbps is None:
        copy_tbps = next((c for c in (case_copy_tbps(t["meta"]) for _, t in chosen) if c), None)
    if title is None:
        try:
            source = provenance_label(meta)
        except KeyError:
            source = "measured here"
        how = "torch.profiler (kernels)" if meta.get("source") == "torch.profiler" else "CUDA events (stages)"
        title = f"{preset}, M = {M}, rank {rank}, {meta.get('loras', 4)} adapters, {how}<br><sup>{source}</sup>"
    cases = [(SCHEDULES[s][0], t["records"], SCHEDULES[s][1], stage_model(dict(t["meta"], schedule=s)))
             for s, t in chosen]
    return timeline_figure(cases, copy_tbps=copy_tbps, floor_us=meta.get("floor_us"), title=title)


def trace_file_figure(path, *, cases=None, max_cases: int = 4, title: str | None = None):
    """``timeline_figure`` of a trace-event file (``profile.trace_events.load_trace_events``: this lab's
    exports, ``torch.profiler``'s, Perfetto's): the named ``cases`` (default: the first ``max_cases``),
    two rows where a case has the lanes "main" and "lora", else one; bytes and tiles where a case's meta
    is a benchmark's (``stage_model``)."""
    from ..profile.timeline import MODEL_KEYS
    from ..profile.trace_events import ONE_STREAM, load_trace_events

    traces = load_trace_events(path)
    if cases is None:
        if isinstance(max_cases, bool) or not isinstance(max_cases, int) or max_cases < 1:
            raise ValueError(f"max_cases: expected a positive int, got {max_cases!r}")
        cases = list(traces)[:max_cases]
    missing = [c for c in ([cases] if isinstance(cases, str) else cases) if c not in traces]
    if missing:
        raise ValueError(f"cases: {missing} not in {path}; it holds {list(traces)}")
    runs, rates = [], []
    for case in [cases] if isinstance(cases, str) else cases:
        t = traces[case]
        lanes = {r["stream"] for r in t["records"]}
        model = all(k in t["meta"] for k in MODEL_KEYS)
        two = lanes <= set(LANE_ROWS) and len(lanes) == 2 and t["meta"].get("schedule") not in ONE_STREAM
        runs.append((case, t["records"], 2 if two else 1,
                     stage_model(t["meta"]) if model else {}))
        rates.append(case_copy_tbps(t["meta"]) if model else None)
    return timeline_figure(runs, copy_tbps=next((c for c in rates if c), None),
                           title=title or f"{Path(path).name}: {len(runs)} of {len(traces)} case(s)")


def _config() -> dict:
    return dict(CONFIG, modeBarButtonsToRemove=list(CONFIG["modeBarButtonsToRemove"]))


def mime_bundle(fig, *, html: bool = True) -> dict:
    """What ``IPython.display.display(bundle, raw=True)`` shows: plotly's JSON (JupyterLab's plotly
    renderer, with ``CONFIG``), a short text line and, with ``html``, an HTML view that loads plotly.js
    from its CDN (for viewers without the extension; the notebook stays small). JupyterLab's plotly
    renderer stores a PNG of what it drew into the output, so a notebook saved with this output opens
    as modified: keep such outputs out of committed notebooks (an explorer's ``figure_widget`` is not saved)."""
    spec = json.loads(fig.to_json())
    bundle = {"application/vnd.plotly.v1+json": dict(spec, config=_config()),
              "text/plain": f"interactive timeline ({len(spec.get('data', []))} stages); run the cell in Jupyter"}
    if html:
        bundle["text/html"] = fig.to_html(full_html=False, include_plotlyjs="cdn", config=_config())
    return bundle


def show(fig, *, html: bool = True) -> None:
    """Display ``fig`` in the notebook (or in the ``Output`` widget being written to): see ``mime_bundle``."""
    display(mime_bundle(fig, html=html), raw=True)


def update_widget(widget, fig) -> None:
    """Redraw a ``go.FigureWidget`` in place with the traces and layout of ``fig`` (the widget's view,
    zoom state aside, becomes ``fig``): an explorer keeps one widget and never re-displays it."""
    go = _go()
    if not isinstance(widget, go.FigureWidget):
        raise TypeError(f"widget: expected a plotly FigureWidget (go.FigureWidget()), got {type(widget).__name__}")
    if not isinstance(fig, go.Figure):
        raise TypeError(f"fig: expected a plotly Figure (timeline_figure / case_figure), got {type(fig).__name__}")
    with widget.batch_update():
        widget.data = ()
        widget.add_traces(list(fig.data))
        widget.layout = fig.layout
    if hasattr(type(widget), "_config"):        # the widget's display options (a synced trait of plotly's)
        widget._config = _config()


def figure_widget(fig=None):
    """A ``go.FigureWidget`` showing ``fig`` (or empty), with ``CONFIG``: a view an explorer can own and
    redraw with ``update_widget``; it needs anywidget (pinned beside plotly). Make one and keep it: each
    new FigureWidget sends plotly's 5 MB front-end bundle to the browser again."""
    go = _go()
    try:
        widget = go.FigureWidget()
    except ImportError as exc:
        raise ImportError(f"plotly's FigureWidget needs anywidget (pinned in requirements-cpu.txt): {INSTALL_HINT}, "
                          "or pip install anywidget") from exc
    if fig is not None:
        update_widget(widget, fig)
    elif hasattr(type(widget), "_config"):
        widget._config = _config()
    return widget
