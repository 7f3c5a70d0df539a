"""profile.profiler: kernels tied to stages from a real torch.profiler export, the comparison with the event
tracer, HTA-style metrics, the committed H200 profiler traces, and the ``bench profiler`` pipeline on the CPU."""
import json
from pathlib import Path

import pytest
import torch

import moelora_lab.profile.timing as timing
from moelora_lab import LoRAShape, MoEShape, make_problem
from moelora_lab.bench import cli, common, profiler_sweep
from moelora_lab.layer import moe_lora_layer
from moelora_lab.profile.profiler import (TOLERANCE_US, Annotator, capture_profiler_timeline, compare_timelines,
                                          kineto_cases, stage_kernels, stage_records, stream_metrics)
from moelora_lab.profile.trace_events import load_trace_events
from moelora_lab.results import load, load_traces, read_csv

# torch.profiler's export of one dual-stream layer run (qwen3-30b-a3b, M 16, r 16) on an NVIDIA H200,
# torch 2.11.0+cu130, the stages marked by Annotator: the format as the profiler writes it
KINETO = Path(__file__).parent / "data" / "kineto_layer_M16_r16_dual_stream.json"
STAGES = ["base_w13", "lora_w13", "act", "base_w2", "lora_w2", "sum"]


def _events():
    return json.loads(KINETO.read_text())["traceEvents"]


def test_real_profiler_export_ties_every_kernel_to_its_stage():
    (case,) = kineto_cases(_events()).values()
    kernels = {k["stage"]: k for k in case["kernels"]}
    assert sorted(kernels) == sorted(STAGES) and len(case["kernels"]) == 6        # the sleep kernel is dropped
    assert {kernels[s]["name"] for s in ("base_w13", "base_w2")} == {"moe_gemm_kernel"}
    assert kernels["lora_w13"]["name"] == "one_shot_kernel" and kernels["act"]["name"] == "silu_and_mul_kernel"
    assert {k["stream"] for k in case["kernels"] if k["stage"].startswith("lora")} == {"lora"}
    assert kernels["base_w13"]["grid"] == [1632, 1, 1] and kernels["base_w13"]["registers"] == 108
    # times from the end of the sleep kernel: the base GEMM starts about a microsecond later
    assert 0 < kernels["base_w13"]["start_us"] < 5
    # the side stream's kernel starts well after its stream got there: it waits for SMs the base GEMM holds
    assert kernels["lora_w13"]["start_us"] > kernels["base_w13"]["start_us"] + 10
    assert [r["name"] for r in case["records"]] == ["base_w13", "lora_w13", "act", "base_w2", "lora_w2", "sum"]


def test_load_trace_events_reads_a_profiler_export_by_stage():
    (name, case), = load_trace_events(KINETO).items()
    assert name == KINETO.stem and case["meta"]["profiler"] == "torch.profiler"
    assert {(r["stream"], r["name"]) for r in case["records"]} == {
        ("main", "base_w13"), ("lora", "lora_w13"), ("main", "act"), ("main", "base_w2"), ("lora", "lora_w2"),
        ("main", "sum")}


def _kernel(name, ts, dur, tid=7, cat="kernel"):
    return dict(ph="X", cat=cat, name=name, pid=0, tid=tid, ts=ts, dur=dur, args={"stream": tid})


def _note(stage, lane, ts, dur, tid=7):
    return dict(ph="X", cat="gpu_user_annotation", name=f"moelora:{lane}:{stage}", pid=0, tid=tid, ts=ts, dur=dur)


def test_two_kernels_make_one_stage_and_unmarked_kernels_are_other():
    events = [_kernel("moe_gemm_kernel", 10, 5),                               # before the sleep: ignored
              _kernel("at::cuda::spin_kernel(long)", 100, 50),
              _note("lora_w13", "lora", 151, 20), _kernel("shrink_kernel", 151, 8), _kernel("expand_kernel", 161, 10),
              _kernel("Memset (Device)", 175, 1, cat="gpu_memset")]
    (case,) = kineto_cases(events).values()
    (rec, other) = case["records"]
    assert rec == dict(stream="lora", name="lora_w13", start_us=1, end_us=21, kernels=["shrink_kernel", "expand_kernel"],
                       busy_us=18)
    assert other["name"] == "other" and other["stream"] == "stream 7" and other["kernels"] == ["Memset (Device)"]
    m = stream_metrics(case["records"], case["kernels"])
    assert m["kernel_count"] == 3 and m["streams"]["lora"] == dict(busy_us=18, idle_us=7, idle=0.28,
                                                                   kernels=2)
    assert kineto_cases([_note("act", "main", 0, 1)]) == {}                       # no activity: no case


def test_stage_records_from_kernels():
    ks = [dict(stream="main", stage="act", name="a", start_us=5.0, end_us=6.0),
          dict(stream="main", stage="base_w13", name="g", start_us=0.0, end_us=4.0)]
    assert [r["name"] for r in stage_records(ks)] == ["base_w13", "act"]


FILL = ("void at::native::vectorized_elementwise_kernel<8, at::native::FillFunctor<c10::BFloat16>, "
        "std::array<char*, 1ul> >(int, at::native::FillFunctor<c10::BFloat16>, std::array<char*, 1ul>)")


@pytest.mark.parametrize("lora_kernels, want", [
    ([FILL, "shrink_kernel", "expand_kernel"], ("fill", "shrink", "expand")),   # a launcher that fills T first
    (["shrink_kernel", "expand_kernel"], ("shrink", "expand")),                 # T allocated uninitialised
    (["one_shot_kernel"], ("one_shot",)),
])
def test_stage_kernels_names_what_the_profiler_saw(lora_kernels, want):
    records = [dict(stream="main", name="base_w13", start_us=0.0, end_us=9.0, kernels=["moe_gemm_kernel"]),
               dict(stream="lora", name="lora_w13", start_us=1.0, end_us=8.0, kernels=lora_kernels)]
    assert stage_kernels(records, "lora_w13") == want
    assert stage_kernels(records, "base_w13") == ("moe_gemm",)
    assert stage_kernels(records, "act") == ()


def test_stage_kernels_from_an_export_and_bad_input():
    (case,) = kineto_cases(_events()).values()
    assert stage_kernels(case["records"], "lora_w13") == ("one_shot",)
    assert stage_kernels(case["records"], "act") == ("silu_and_mul",)
    with pytest.raises(TypeError, match="stage: expected a stage name"):
        stage_kernels(case["records"], 3)
    with pytest.raises(TypeError, match="records: expected a list of stage records"):
        stage_kernels({"name": "act"}, "act")
    with pytest.raises(TypeError, match=r"records\[0\]: expected a stage record"):
        stage_kernels([["act"]], "act")


def _timeline(shift=0.0, side_start=10.0):
    return [dict(stream="main", name="base_w13", start_us=1.0, end_us=100.0),
            dict(stream="lora", name="lora_w13", start_us=side_start, end_us=60.0 + shift),
            dict(stream="main", name="act", start_us=101.0, end_us=104.0)]


def test_compare_timelines_agrees_and_reports_the_side_wait():
    a = compare_timelines(_timeline(), _timeline(side_start=40.0))
    assert a["agrees"] and a["side_start_wait_us"] == [30.0] and a["tolerance_us"] == TOLERANCE_US
    assert [s["stage"] for s in a["stages"]] == ["base_w13", "lora_w13", "act"] and a["both_busy_tracer_us"] == 50.0


def test_compare_timelines_fails_beyond_the_tolerance():
    assert not compare_timelines(_timeline(), _timeline(shift=TOLERANCE_US + 1))["agrees"]
    late = _timeline()
    late[0] = dict(late[0], start_us=1.0 + TOLERANCE_US + 1)                     # a main stage shorter by > tol
    assert not compare_timelines(_timeline(), late)["agrees"]
    with pytest.raises(ValueError, match="no kernels for stage.*lora:lora_w13"):
        compare_timelines(_timeline(), [r for r in _timeline() if r["stream"] == "main"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through the interpreter; the GPU suite checks the kernels")
@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events:UserWarning")
def test_annotator_marks_every_stage_of_the_layer():
    """On the CPU the profiler sees the annotations (no kernels): one per stage, named lane:stage."""
    p = make_problem(MoEShape(32, 24, 4, 2, "t"), LoRAShape(2, 4), 6, seed=0, device="cpu")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        moe_lora_layer(**p.layer_inputs(), schedule="sequential", tracer=Annotator())
    names = [e.name for e in prof.events() if e.name.startswith("moelora:")]
    assert names == ["moelora:main:base_w13", "moelora:lora:lora_w13", "moelora:main:act", "moelora:main:base_w2",
                     "moelora:lora:lora_w2", "moelora:main:sum"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_capture_needs_a_gpu():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        capture_profiler_timeline(lambda tracer: None)


def test_committed_profiler_traces_agree_with_the_event_tracer():
    """The H200 data: 12 (M, r) cases, every schedule, each kernel tied to a stage, both views agree."""
    traces, rows = load_traces("layer_profiler_traces"), load("layer_profiler")
    cases = {(t["meta"]["M"], t["meta"]["rank"]) for t in traces.values()}
    assert cases == {(M, r) for M in (1, 16, 128, 512, 2048, 8192) for r in (16, 64)}
    assert len(rows) == len(traces)
    for M, r in cases:
        scheds = {t["meta"]["schedule"] for t in traces.values() if (t["meta"]["M"], t["meta"]["rank"]) == (M, r)}
        assert scheds == {"sequential", "dual_stream"} | ({"fused"} if r == 16 else set()), (M, r)
    for name, t in traces.items():
        assert not [k for k in t["kernels"] if k["stage"] == "other"], name
        assert compare_timelines(t["events"], t["records"])["agrees"], name
        assert t["metrics"] == stream_metrics(t["records"], t["kernels"])
    assert all(r["agrees"] == 1 for r in rows)


def test_profiler_pipeline_on_the_cpu(monkeypatch, tmp_path):
    """``bench profiler`` end to end with the capture replaced by a clock-free stand-in."""
    if torch.cuda.is_available():
        pytest.skip("checks the CPU run of the pipeline")
    monkeypatch.setattr(common, "DEVICE", "cpu")
    monkeypatch.setattr(timing, "copy_bandwidth", lambda *a, **k: 4.0e12)

    def fake_capture(run):
        order = []

        class Order:
            def stage(self, name, lane):
                order.append((lane, name))
                return torch.profiler.record_function(name)

        run(Order())
        recs = [dict(stream=lane, name=name, start_us=10.0 * i, end_us=10.0 * i + 8) for i, (lane, name) in
                enumerate(order)]
        kernels = [dict(r, stage=r["name"], name=f"{r['name']}_kernel") for r in recs]
        return dict(records=stage_records(kernels), kernels=kernels, events=recs)

    monkeypatch.setattr(profiler_sweep, "capture_profiler_timeline", fake_capture)
    with pytest.warns(RuntimeWarning, match="on the CPU the layer runs 'sequential'"):   # the dual_stream case
        assert cli.main(["profiler", "--presets", "tiny", "--tokens", "3", "--ranks", "8", "--dtype", "float32",
                         "--trace-events", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "layer_profiler.csv")
    assert {r["schedule"] for r in rows} == {"sequential", "dual_stream", "fused"} and all(r["agrees"] == 1 for r in rows)
    traces = json.loads((tmp_path / "layer_profiler_traces.json").read_text())
    assert {t["meta"]["source"] for t in traces.values()} == {"torch.profiler"}
    assert (tmp_path / "layer_profiler_traces.trace.json").exists()
