import json
import subprocess
import sys

import pytest

go = pytest.importorskip("plotly.graph_objects")   # the lab extra (absent from a bare GPU image)

from moelora_lab.plots import timeline_interactive as ti
from moelora_lab.plots.timeline import STAGE_COLORS
from moelora_lab.profile.timeline import stage_model
from moelora_lab.results import load, load_traces

# one stream: every stage after the other; two streams: the LoRA stages beside the base GEMMs (µs)
SEQ = [dict(stream="main", name="base_w13", start_us=5.0, end_us=15.0),
       dict(stream="lora", name="lora_w13", start_us=15.0, end_us=19.0),
       dict(stream="main", name="act", start_us=19.0, end_us=21.0),
       dict(stream="main", name="base_w2", start_us=21.0, end_us=29.0),
       dict(stream="lora", name="lora_w2", start_us=29.0, end_us=33.0),
       dict(stream="main", name="sum", start_us=33.0, end_us=35.0)]
DUAL = [dict(stream="main", name="base_w13", start_us=1.0, end_us=12.0),
        dict(stream="lora", name="lora_w13", start_us=2.0, end_us=8.0),
        dict(stream="main", name="act", start_us=12.0, end_us=14.0),
        dict(stream="main", name="base_w2", start_us=14.0, end_us=23.0),
        dict(stream="lora", name="lora_w2", start_us=15.0, end_us=25.0),
        dict(stream="main", name="sum", start_us=25.0, end_us=27.0)]
BYTES = {"base_w13": 40_000_000, "lora_w13": 3_000_000, "act": 500_000, "base_w2": 20_000_000,
         "lora_w2": 2_500_000}                                      # no "sum": not in the model
CASES = [("1 stream", SEQ, 1), ("2 streams", DUAL, 2)]
PRESET = "qwen3-30b-a3b"


def by_name(fig):
    return {t.name: t for t in fig.data}


def test_rows_bars_and_colours():
    fig = ti.timeline_figure(CASES, stage_bytes=BYTES, copy_tbps=4.0)
    assert list(fig.layout.yaxis.categoryarray) == ["1 stream: main", "2 streams: main", "2 streams: side"]
    assert fig.layout.barmode == "overlay"
    # one trace per stage, in the order the stages first ran, coloured as in the static plot
    assert [t.name for t in fig.data] == ["base_w13", "lora_w13", "act", "base_w2", "lora_w2", "sum"]
    for t in fig.data:
        assert t.marker.color == STAGE_COLORS[t.name] and t.legendgroup == t.name and t.orientation == "h"
    # time from each run's first start: 5 µs (one stream) and 1 µs (two streams)
    lora = by_name(fig)["lora_w13"]
    assert list(lora.y) == ["1 stream: main", "2 streams: side"]        # one stream: no side row
    assert list(lora.base) == [10.0, 1.0] and list(lora.x) == [4.0, 6.0]
    assert list(by_name(fig)["base_w2"].y) == ["1 stream: main", "2 streams: main"]


def test_one_stream_has_no_side_row():
    fig = ti.timeline_figure([("alone", DUAL, 1)])
    assert list(fig.layout.yaxis.categoryarray) == ["alone: main"]
    assert {y for t in fig.data for y in t.y} == {"alone: main"}


def test_hover_bytes_and_bandwidth():
    fig = ti.timeline_figure(CASES, stage_bytes=BYTES, copy_tbps=4.0)
    for run, records in (("1 stream", SEQ), ("2 streams", DUAL)):
        for r in records:
            t = by_name(fig)[r["name"]]
            i = [j for j, y in enumerate(t.y) if y.startswith(run)][0]
            text, dur = t.hovertext[i], r["end_us"] - r["start_us"]
            assert f"<b>{r['name']}</b>" in text and f"duration: {dur:.1f} µs" in text
            assert f"({run})" in text
            if r["name"] not in BYTES:
                assert "not in the byte model" in text and "TB/s" not in text
                continue
            tbps = BYTES[r["name"]] / (dur * 1e-6) / 1e12                 # bytes / duration
            assert f"({BYTES[r['name']]:,} B)" in text
            assert f"achieved: {tbps:.2f} TB/s = {tbps / 4.0:.0%} of the copy rate 4.00 TB/s" in text
    # the two-stream lora_w13: 3 MB in 6 µs = 0.5 TB/s, 12% of 4 TB/s, from 1 µs after the run's start
    text = by_name(fig)["lora_w13"].hovertext[1]
    assert "0.50 TB/s = 12%" in text and "stream: side (2 streams)" in text and "start: 1.0 µs" in text


def test_per_run_stages_kernels_and_tiles():
    own = {"act": {"bytes": 1_000_000, "kernel": "silu_and_mul_kernel", "tiles": {"BLOCK": 8}}}
    fig = ti.timeline_figure([("1 stream", SEQ, 1), ("2 streams", DUAL, 2, own)], stage_bytes=BYTES)
    seq_act, dual_act = by_name(fig)["act"].hovertext
    assert "(500,000 B)" in seq_act and "kernel" not in seq_act
    assert "(1,000,000 B)" in dual_act and "kernel: silu_and_mul_kernel" in dual_act and "tiles: BLOCK=8" in dual_act
    assert "of the copy rate" not in dual_act                          # no copy rate given
    rec = [dict(SEQ[0], kernel="moe_gemm_kernel", args={"BLOCK_M": 64})]
    text = ti.timeline_figure([("k", rec, 1)]).data[0].hovertext[0]
    assert "kernel: moe_gemm_kernel" in text and "BLOCK_M: 64" in text


def test_critical_path_marks_and_floor():
    fig = ti.timeline_figure(CASES, floor_us=20.0)
    marks = {s.name: s for s in fig.layout.shapes if s.name.startswith("critical path")}
    # the span of each run, by hand: one stream 35 - 5, two streams 27 - 1
    one, two = marks["critical path: 1 stream"], marks["critical path: 2 streams"]
    assert one.x0 == one.x1 == 30.0 and two.x0 == two.x1 == 26.0
    assert (one.y0, one.y1) == (-0.45, 0.45) and (two.y0, two.y1) == (0.55, 2.45)   # rows 0 and 1..2
    assert {a.text for a in fig.layout.annotations} == {"30 µs", "26 µs"}
    floor = [s for s in fig.layout.shapes if s.name.startswith("byte floor")]
    assert len(floor) == 1 and floor[0].x0 == floor[0].x1 == 20.0 and floor[0].yref == "paper"
    assert floor[0].showlegend
    assert not [s for s in ti.timeline_figure(CASES).layout.shapes if s.name.startswith("byte floor")]


def test_zoom_along_time_only():
    fig = ti.timeline_figure(CASES)
    assert fig.layout.yaxis.fixedrange and not fig.layout.xaxis.fixedrange and fig.layout.dragmode == "zoom"
    assert list(fig.layout.xaxis.range) == [0, pytest.approx(1.12 * 30.0)]
    assert ti.mime_bundle(fig)["application/vnd.plotly.v1+json"]["config"]["scrollZoom"] is True


@pytest.mark.parametrize("cases, kwargs, error, match", [
    ([], {}, TypeError, "non-empty list"),
    ({"a": SEQ}, {}, TypeError, "non-empty list"),
    ([("a",)], {}, TypeError, r"\(label, records\)"),
    ([("a", SEQ, 3)], {}, ValueError, "streams must be 1 or 2"),
    ([("a", [])], {}, ValueError, "non-empty list of timeline records"),
    ([("a", [dict(name="x")])], {}, ValueError, "stream, name, start_us, end_us"),
    ([("a", [dict(SEQ[0], stream="gpu7")])], {}, ValueError, "pass streams=1"),
    ([("a", SEQ, 1), ("a", DUAL)], {}, ValueError, "labels must differ"),
    ([("a", [dict(SEQ[0], end_us=1.0)])], {}, ValueError, "ends before it starts"),
    ([("a", [dict(SEQ[0], args=[1])], 1)], {}, ValueError, "args must be a dict"),
    (CASES, dict(stage_bytes=[1, 2]), TypeError, "stage_bytes"),
    (CASES, dict(stage_bytes={"act": -1}), ValueError, r"stage_bytes\['act'\]"),
    (CASES, dict(stage_bytes={"act": {"kernel": "k"}}), ValueError, "under 'bytes'"),
    ([("a", SEQ, 1, {"act": {"bytes": 1, "tiles": 3}})], {}, ValueError, r"\['tiles'\]"),
    (CASES, dict(copy_tbps=0), ValueError, "copy_tbps"),
    (CASES, dict(copy_tbps=True), ValueError, "copy_tbps"),
    (CASES, dict(floor_us=-3.0), ValueError, "floor_us"),
    (CASES, dict(title=3), TypeError, "title"),
])
def test_bad_input(cases, kwargs, error, match):
    with pytest.raises(error, match=match):
        ti.timeline_figure(cases, **kwargs)


@pytest.fixture(scope="module")
def traces():
    return load_traces()


def test_case_figure_of_committed_traces(traces):
    fig = ti.case_figure(traces, PRESET, 16, 16)
    assert list(fig.layout.yaxis.categoryarray) == ["1 stream: main", "2 streams: main", "2 streams: side",
                                                    "fused: main"]
    assert "NVIDIA H200" in fig.layout.title.text and "M = 16, rank 16" in fig.layout.title.text
    for s, label in (("sequential", "1 stream"), ("dual_stream", "2 streams"), ("fused", "fused")):
        recs = traces[f"{PRESET}_M16_r16_{s}"]["records"]
        span = max(r["end_us"] for r in recs) - min(r["start_us"] for r in recs)
        mark = [m for m in fig.layout.shapes if m.name == f"critical path: {label}"][0]
        assert mark.x0 == pytest.approx(span)
    # act moves fewer bytes in the fused run (no LoRA delta to read): each run has its own bytes
    model = {s: stage_model(traces[f"{PRESET}_M16_r16_{s}"]["meta"]) for s in ("sequential", "fused")}
    assert model["fused"]["act"]["bytes"] < model["sequential"]["act"]["bytes"]
    act = by_name(fig)["act"]
    for label, s in (("1 stream", "sequential"), ("fused", "fused")):
        text = act.hovertext[[i for i, y in enumerate(act.y) if y.startswith(label)][0]]
        assert f"({model[s]['act']['bytes']:,} B)" in text and "kernel: silu_and_mul_kernel" in text
    floor = [s for s in fig.layout.shapes if s.name.startswith("byte floor")][0]
    assert floor.x0 == traces[f"{PRESET}_M16_r16_dual_stream"]["meta"]["floor_us"]
    # rank 64 has no fused trace (L*r too wide): no fused row
    rows = list(ti.case_figure(traces, PRESET, 16, 64).layout.yaxis.categoryarray)
    assert rows == ["1 stream: main", "2 streams: main", "2 streams: side"]
    rows = list(ti.case_figure(traces, PRESET, 1, 16, schedules=("sequential",)).layout.yaxis.categoryarray)
    assert rows == ["1 stream: main"]


def test_copy_rate_of_a_trace_matches_layer_csv(traces):
    rows = load("layer")
    meta = traces[f"{PRESET}_M2048_r64_dual_stream"]["meta"]
    csv_rate = [r["copy_tbps"] for r in rows if r["M"] == 2048 and r["rank"] == 64 and r["variant"] == "dual_stream"]
    assert ti.case_copy_tbps(meta) == pytest.approx(csv_rate[0], rel=1e-3)
    assert ti.case_copy_tbps(dict(meta, copy_tbps=3.5)) == 3.5
    older = {k: v for k, v in meta.items() if k != "copy_tbps"}      # traces recorded before copy_tbps
    assert ti.case_copy_tbps(older) == pytest.approx(csv_rate[0], rel=1e-3)   # derived from the floor
    assert ti.case_copy_tbps(dict(older, floor_us=None)) is None


def test_case_figure_errors(traces):
    with pytest.raises(ValueError, match="traced \\(preset, M, rank\\)"):
        ti.case_figure(traces, PRESET, 3, 16)
    with pytest.raises(ValueError, match="schedules"):
        ti.case_figure(traces, PRESET, 16, 16, schedules="fused")
    with pytest.raises(ValueError, match="schedules"):
        ti.case_figure(traces, PRESET, 16, 16, schedules=("both",))
    with pytest.raises(TypeError, match="traces"):
        ti.case_figure([1], PRESET, 16, 16)
    with pytest.raises(TypeError, match="meta"):
        ti.case_copy_tbps(None)


def test_mime_bundle_and_show(monkeypatch, tmp_path):
    fig = ti.timeline_figure(CASES, stage_bytes=BYTES)
    bundle = ti.mime_bundle(fig)
    spec = bundle["application/vnd.plotly.v1+json"]
    assert json.loads(json.dumps(spec))["layout"]["height"] == fig.layout.height      # plain JSON
    assert "responsive" not in spec["config"] and "responsive" not in ti.CONFIG       # collapses in JupyterLab
    assert "cdn.plot.ly" in bundle["text/html"] and len(bundle["text/html"]) < 200_000  # no 4 MB plotly.js
    assert "text/html" not in ti.mime_bundle(fig, html=False)
    shown = []
    monkeypatch.setattr(ti, "display", lambda obj, raw: shown.append((obj, raw)))
    ti.show(fig, html=False)
    assert shown[0][1] is True and set(shown[0][0]) == {"application/vnd.plotly.v1+json", "text/plain"}
    path = tmp_path / "timeline.html"
    fig.write_html(path, include_plotlyjs=True, config=dict(ti.CONFIG))
    assert "Plotly.newPlot" in path.read_text() and "2 streams: side" in path.read_text()


def test_figure_widget_redrawn_in_place(traces):
    widget = ti.figure_widget(ti.timeline_figure(CASES))
    assert isinstance(widget, go.FigureWidget) and len(widget.data) == 6
    fig = ti.case_figure(traces, PRESET, 8192, 64)
    ti.update_widget(widget, fig)
    assert [t.name for t in widget.data] == [t.name for t in fig.data]
    assert [s.name for s in widget.layout.shapes] == [s.name for s in fig.layout.shapes]
    assert widget.layout.title.text == fig.layout.title.text
    assert widget._config["scrollZoom"] is True
    with pytest.raises(TypeError, match="FigureWidget"):
        ti.update_widget(fig, fig)
    with pytest.raises(TypeError, match="plotly Figure"):
        ti.update_widget(widget, {"data": []})


def test_clear_error_without_plotly(monkeypatch):
    for name in ("plotly", "plotly.graph_objects"):
        monkeypatch.setitem(sys.modules, name, None)                   # import plotly -> ImportError
    with pytest.raises(ImportError, match=r"needs plotly.*make venv.*pip install plotly"):
        ti.timeline_figure(CASES)


def test_package_imports_without_loading_plotly():
    code = ("import sys, moelora_lab, moelora_lab.plots, moelora_lab.plots.timeline_interactive; "
            "print('plotly' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_trace_file_figure_reads_exports_and_profiler_files(tmp_path):
    """A file the lab wrote comes back with bytes in the hover; a raw torch.profiler export by stage."""
    from pathlib import Path

    from moelora_lab.plots.timeline_interactive import trace_file_figure
    from moelora_lab.profile.trace_events import save_trace_events
    from moelora_lab.results import load_traces

    profiled = load_traces("layer_profiler_traces")
    case = {k: v for k, v in profiled.items() if "_M2048_r16_" in k}
    path = save_trace_events(tmp_path / "case.trace.json", case)
    fig = trace_file_figure(path)
    rows = {y for d in fig.data for y in d.y}
    assert {r.split(": ")[0] for r in rows} == set(case)
    assert any(r.endswith(": side") for r in rows if "dual_stream" in r)
    assert not any(r.endswith(": side") for r in rows if "sequential" in r or "fused" in r)   # one stream, one row
    hover = next(d for d in fig.data if d.name == "base_w13").hovertext[0]
    assert "bytes moved" in hover and "TB/s" in hover
    kineto = Path(__file__).parent / "data" / "kineto_layer_M16_r16_dual_stream.json"
    fig = trace_file_figure(kineto)
    assert "kernel: one_shot_kernel" in next(d for d in fig.data if d.name == "lora_w13").hovertext[0]
    with pytest.raises(ValueError, match="not in"):
        trace_file_figure(kineto, cases=["nope"])
    with pytest.raises(ValueError, match="max_cases"):
        trace_file_figure(kineto, max_cases=0)


def test_kernel_label_shortens_profiler_names():
    from moelora_lab.profile.profiler import kernel_label
    fill = ("void at::native::vectorized_elementwise_kernel<8, at::native::FillFunctor<c10::BFloat16>, "
            "std::array<char*, 1ul> >(int, at::native::FillFunctor<c10::BFloat16>, std::array<char*, 1ul>)")
    assert kernel_label(fill) == "vectorized_elementwise_kernel [fill]"
    assert kernel_label("at::cuda::(anonymous namespace)::spin_kernel(long)") == "spin_kernel"
    assert kernel_label("one_shot_kernel") == "one_shot_kernel"
