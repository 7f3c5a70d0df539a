import gzip
import json

import pytest

from moelora_lab.config import MoEShape
from moelora_lab.op.dispatch import gpu_config
from moelora_lab.base_moe import gpu_gemm_tiles
from moelora_lab.plots.traffic import sweep_workload
from moelora_lab.profile.timeline import overlap_metrics
from moelora_lab.profile.trace_events import (check_trace_events, export_trace_files, load_trace_events, main,
                                              save_trace_events, to_trace_events)
from moelora_lab.profile.traffic import layer_traffic
from moelora_lab.results import DATA_DIR

TRACES = json.loads((DATA_DIR / "layer_traces.json").read_text())


def _structure(doc):
    """The format checked here, independently of check_trace_events: {pid: name}, {(pid, tid): name}."""
    assert list(doc) == ["displayTimeUnit", "traceEvents", "otherData"] and doc["displayTimeUnit"] in ("ms", "ns")
    procs = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
               if e["ph"] == "M" and e["name"] == "thread_name"}
    for e in doc["traceEvents"]:
        assert e["ph"] in ("X", "M") and isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "X":
            assert isinstance(e["name"], str) and isinstance(e["cat"], str) and isinstance(e["args"], dict)
            for key in ("ts", "dur"):
                assert isinstance(e[key], (int, float)) and not isinstance(e[key], bool) and e[key] >= 0
            assert e["pid"] in procs and (e["pid"], e["tid"]) in threads, f"{e['name']}: pid/tid without a name"
    return procs, threads


def test_export_is_trace_event_json():
    """Every committed case becomes a process, each CUDA stream it ran on a named thread."""
    doc = to_trace_events(TRACES)
    procs, threads = _structure(doc)
    assert sorted(procs.values()) == sorted(TRACES)
    assert check_trace_events(doc) == sum(len(t["records"]) for t in TRACES.values())
    assert json.dumps(doc).isascii()                 # some readers reject \u escapes: nothing to escape
    for pid, case in procs.items():
        names = {name for (p, _), name in threads.items() if p == pid}
        two = TRACES[case]["meta"]["schedule"] == "dual_stream"
        assert names == ({"main stream", "side stream"} if two else {"main stream"}), case
        xs = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == pid]
        assert [(e["name"], e["ts"], e["args"]["lane"]) for e in xs] == [
            (r["name"], r["start_us"], r["stream"]) for r in TRACES[case]["records"]]
        side = {e["tid"] for e in xs if e["args"]["lane"] == "lora"}
        assert two == bool(side and side != {e["tid"] for e in xs if e["args"]["lane"] == "main"})
    other = doc["otherData"]
    assert other["gpu"] == "NVIDIA H200" and other["sms"] == 132 and set(other["cases"]) == set(TRACES)
    assert other["cases"]["qwen3-30b-a3b_M16_r16_fused"]["lora_path"] == "in_gemm"


def test_args_carry_bytes_and_tiles():
    """Bytes from the layer byte model of the benchmark's routing, GB/s = bytes / dur, the rule's tiles."""
    name = "qwen3-30b-a3b_M128_r64_dual_stream"
    meta = TRACES[name]["meta"]
    shape = MoEShape.from_name(meta["preset"])
    stages = layer_traffic(shape, 64, sweep_workload(shape, 128), lora_path=meta["lora_path"])
    P = 128 * shape.top_k
    doc = to_trace_events(TRACES[name])
    xs = {e["name"]: e for e in doc["traceEvents"] if e["ph"] == "X"}
    for stage, e in xs.items():
        assert e["args"]["bytes"] == stages[stage].bytes > 0
        assert e["args"]["achieved_GBps"] == pytest.approx(stages[stage].bytes / e["dur"] / 1e3, rel=1e-3)
    assert xs["base_w2"]["args"]["tiles"] == gpu_gemm_tiles(P / shape.num_experts)
    cfg = gpu_config(meta["lora_path"], P, min(P, 4 * shape.num_experts), shape.hidden, 1, 132, rank=64)
    kernels = {"one_shot": "one_shot_kernel", "two_kernel": "shrink_kernel, expand_kernel"}
    assert xs["lora_w2"]["args"]["kernel"] == kernels[meta["lora_path"]]
    assert {k: v for k, v in xs["lora_w2"]["args"]["tiles"].items() if k.islower()} == {
        k: v for k, v in vars(cfg).items() if v is not None}
    assert "tiles" not in xs["act"]["args"]             # the row-wise kernels have no tile rule
    fused = {e["name"]: e for e in to_trace_events(TRACES["qwen3-30b-a3b_M128_r16_fused"])["traceEvents"]
             if e["ph"] == "X"}                             # L*r = 4*16 stacked shrink columns: BLOCK_LR 64
    lora = layer_traffic(shape, 16, sweep_workload(shape, 128))["lora_w13"]
    base = layer_traffic(shape, 16, sweep_workload(shape, 128), with_lora=False)
    assert fused["w13+lora"]["args"]["bytes"] == base["base_w13"].bytes + lora.part("lora_a") + lora.part("lora_b")
    assert fused["act"]["args"]["bytes"] == base["act"].bytes and fused["w13+lora"]["args"]["tiles"]["BLOCK_LR"] == 64
    epi = {e["name"]: e for e in to_trace_events(TRACES["qwen3-30b-a3b_M128_r16_epilogue"])["traceEvents"]
           if e["ph"] == "X"}                               # the shrink's bytes apart, the expand's in the GEMM
    two = layer_traffic(shape, 16, sweep_workload(shape, 128), lora_path="two_kernel")["lora_w13"]
    assert epi["shrink_w13"]["args"]["bytes"] == two.part("x") + two.part("lora_a") + two.part("intermediate_write")
    assert epi["w13+lora"]["args"]["bytes"] == (base["base_w13"].bytes + two.part("lora_b")
                                                + two.part("intermediate_read"))
    assert epi["shrink_w13"]["args"]["kernel"] == "shrink_kernel" and epi["w13+lora"]["args"]["tiles"]["BLOCK_LR"] == 64


def test_round_trip_committed_traces(tmp_path):
    """Our traces -> file -> load: the same records and meta, for one file, gzip, and one file per case."""
    loaded = load_trace_events(save_trace_events(tmp_path / "all.json", TRACES))
    gz = load_trace_events(save_trace_events(tmp_path / "all.json.gz", TRACES))
    assert gzip.decompress((tmp_path / "all.json.gz").read_bytes()).startswith(b"{")
    assert loaded.keys() == gz.keys() == TRACES.keys()
    for case, t in TRACES.items():
        assert loaded[case]["meta"] == gz[case]["meta"] == t["meta"]
        for got, want in zip(loaded[case]["records"], t["records"], strict=True):
            assert got.keys() == want.keys() and got["stream"] == want["stream"] and got["name"] == want["name"]
            assert got["start_us"] == pytest.approx(want["start_us"], abs=1e-6)
            assert got["end_us"] == pytest.approx(want["end_us"], abs=1e-6)
        assert overlap_metrics(loaded[case]["records"]) == t["metrics"]
    paths = export_trace_files(TRACES, tmp_path / "per_case")
    assert len(paths) == len(TRACES)
    one = load_trace_events(tmp_path / "per_case" / "qwen3-30b-a3b_M1_r16_sequential.trace.json")
    assert one["qwen3-30b-a3b_M1_r16_sequential"]["records"] == TRACES["qwen3-30b-a3b_M1_r16_sequential"]["records"]


def _kernel(name, ts, dur, stream, tid=None):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream if tid is None else tid, "ts": ts,
            "dur": dur, "args": {"External id": 7, "device": 0, "stream": stream, "correlation": 9, "grid": [8, 2, 1],
                                 "block": [128, 1, 1], "registers per thread": 96}}


def _profiler_file(path, *, tid=None):
    """What torch.profiler's export_chrome_trace writes for a GPU run (trimmed): CPU ops and runtime calls on
    the host process, kernels on the device process with one thread per CUDA stream, flows, spans."""
    t0 = 5_192_417_860_000.0
    events = [
        {"ph": "M", "name": "process_name", "pid": 4242, "tid": 0, "args": {"name": "python"}},
        {"ph": "M", "name": "thread_name", "pid": 4242, "tid": 4242, "args": {"name": "thread 4242 (python)"}},
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "python"}},
        {"ph": "M", "name": "process_labels", "pid": 0, "tid": 0, "args": {"labels": "GPU 0"}},
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 7, "args": {"name": "stream 7 "}},
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 21, "args": {"name": "stream 21 "}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::empty", "pid": 4242, "tid": 4242, "ts": t0, "dur": 3.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cuLaunchKernel", "pid": 4242, "tid": 4242, "ts": t0 + 4,
         "dur": 2.5, "args": {"correlation": 9}},
        {"ph": "s", "id": 9, "pid": 4242, "tid": 4242, "ts": t0 + 4, "cat": "ac2g", "name": "ac2g"},
        _kernel("moe_gemm_kernel", t0 + 10, 20.0, 7, tid),
        _kernel("one_shot_kernel", t0 + 12, 15.5, 21, tid),
        {"ph": "f", "id": 9, "pid": 0, "tid": 7, "ts": t0 + 10, "cat": "ac2g", "name": "ac2g", "bp": "e"},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "lora", "pid": 0, "tid": 21, "ts": t0 + 12, "dur": 16},
        _kernel("silu_and_mul_kernel", t0 + 31, 2.0, 7, tid),
        {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": "PyTorch Profiler",
         "ts": t0, "dur": 40.0, "args": {"Op count": 0}},
        {"ph": "i", "s": "t", "cat": "cpu_instant_event", "name": "mark", "pid": 4242, "tid": 4242, "ts": t0 + 1},
    ]
    path.write_text(json.dumps({"schemaVersion": 1, "deviceProperties": [], "displayTimeUnit": "ms",
                                "baseTimeNanoseconds": 1_790_000_000_000_000_000, "traceEvents": events}))
    return path


@pytest.mark.parametrize("tid", [None, 0])
def test_load_torch_profiler_file(tmp_path, tid):
    """Kernels only, one lane per CUDA stream (args.stream, also where tid says nothing), renamed main/lora."""
    traces = load_trace_events(_profiler_file(tmp_path / "prof.json", tid=tid))
    assert list(traces) == ["python (GPU 0)"]
    case = traces["python (GPU 0)"]
    assert case["meta"] == {"source": "prof.json", "pid": 0, "labels": "GPU 0", "lanes": {"main": "stream 7",
                                                                                        "lora": "stream 21"}}
    assert [(r["stream"], r["name"]) for r in case["records"]] == [
        ("main", "moe_gemm_kernel"), ("lora", "one_shot_kernel"), ("main", "silu_and_mul_kernel")]
    assert case["records"][1]["end_us"] - case["records"][1]["start_us"] == pytest.approx(15.5)
    assert overlap_metrics(case["records"])["both_busy_us"] == pytest.approx(15.5)
    raw = load_trace_events(tmp_path / "prof.json", lanes=None, details=True)["python (GPU 0)"]["records"]
    assert [r["stream"] for r in raw] == ["stream 7", "stream 21", "stream 7"] and raw[0]["args"]["grid"] == [8, 2, 1]
    everything = load_trace_events(tmp_path / "prof.json", categories=None, lanes=None)
    assert set(everything) == {"python", "python (GPU 0)", "pid Spans"}
    assert [r["name"] for r in everything["python"]["records"]] == ["aten::empty", "cuLaunchKernel"]
    assert len(everything["python (GPU 0)"]["records"]) == 4             # the GPU annotation too
    renamed = load_trace_events(tmp_path / "prof.json", lanes={"stream 21": "lora", "stream 7": "main"})
    assert renamed == traces


@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events:UserWarning")
def test_load_real_cpu_profiler_export(tmp_path):
    """A file torch.profiler really writes (CPU activity here): without kernels every complete event counts."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(8, 8) @ torch.ones(8, 8)
    prof.export_chrome_trace(str(tmp_path / "cpu.json"))
    traces = load_trace_events(tmp_path / "cpu.json")
    names = [r["name"] for t in traces.values() for r in t["records"]]
    assert "aten::matmul" in names and all(r["end_us"] >= r["start_us"] for t in traces.values()
                                           for r in t["records"])


def test_load_array_form_and_foreign_threads(tmp_path):
    """The bare array form (its closing ] may be missing), thread names as lanes, B/E events skipped."""
    events = [{"ph": "M", "name": "thread_name", "pid": 3, "tid": 1, "args": {"name": "copy engine"}},
              {"ph": "X", "name": "a", "pid": 3, "tid": 1, "ts": 5, "dur": 2},
              {"ph": "B", "name": "b", "pid": 3, "tid": 2, "ts": 6}, {"ph": "E", "pid": 3, "tid": 2, "ts": 8},
              {"ph": "X", "name": "c", "pid": 3, "tid": 2, "ts": 1, "dur": 1},
              {"ph": "X", "name": "d", "pid": 3, "tid": 4, "ts": 2, "dur": 1}]
    (tmp_path / "a.json").write_text(json.dumps(events)[:-1] + ",\n")
    traces = load_trace_events(tmp_path / "a.json")
    assert list(traces) == ["pid 3"]
    assert [(r["stream"], r["name"]) for r in traces["pid 3"]["records"]] == [
        ("tid 2", "c"), ("tid 4", "d"), ("copy engine", "a")]          # three lanes: not renamed
    assert "lanes" not in traces["pid 3"]["meta"]
    # re-exported without the model (its meta is no benchmark's): one thread per lane, loads back the same
    doc = to_trace_events(traces, model=False)
    assert {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"} == {
        "tid 2", "tid 4", "copy engine"}
    again = load_trace_events(save_trace_events(tmp_path / "b.json", doc))
    assert again["pid 3"]["records"] == traces["pid 3"]["records"]


def test_load_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json: not JSON"):
        load_trace_events(bad)
    bad.write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="not JSON"):
        load_trace_events(bad)
    bad.write_text(json.dumps({"events": []}))
    with pytest.raises(ValueError, match="not a trace-event file"):
        load_trace_events(bad)
    bad.write_text(json.dumps({"traceEvents": [{"ph": "B", "name": "a", "pid": 1, "tid": 1, "ts": 0}]}))
    with pytest.raises(ValueError, match=r"no complete events \('ph': 'X'\) among its 1 events"):
        load_trace_events(bad)
    bad.write_text(json.dumps([{"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": "0", "dur": 1}]))
    with pytest.raises(ValueError, match="complete event 0 \\('a'\\) needs numbers ts and dur"):
        load_trace_events(bad)
    bad.write_text(json.dumps([{"ph": "X", "cat": "cpu_op", "name": "a", "pid": 1, "tid": 1, "ts": 0, "dur": 1}]))
    with pytest.raises(ValueError, match="no complete event has a category in \\['kernel'\\]"):
        load_trace_events(bad, categories=["kernel"])
    with pytest.raises(TypeError, match="lanes: expected 'auto', None or a dict"):
        load_trace_events(bad, lanes="main")
    with pytest.raises(FileNotFoundError):
        load_trace_events(tmp_path / "missing.json")


def test_check_trace_events_finds_defects():
    good = to_trace_events(TRACES["qwen3-30b-a3b_M1_r64_dual_stream"])
    assert check_trace_events(good) == 6 and check_trace_events(good["traceEvents"]) == 6

    def broken(edit):
        doc = json.loads(json.dumps(good))
        edit(doc)
        return doc

    x = next(i for i, e in enumerate(good["traceEvents"]) if e["ph"] == "X")
    cases = [
        (lambda d: d["traceEvents"].__setitem__(x, {**d["traceEvents"][x], "dur": -1.0}), "bad or missing dur"),
        (lambda d: d["traceEvents"][x].pop("name"), "bad or missing name"),
        (lambda d: d["traceEvents"][x].__setitem__("ts", float("nan")), "bad or missing ts"),
        (lambda d: d["traceEvents"][x].__setitem__("pid", True), "pid and tid must be ints or strings"),
        (lambda d: d["traceEvents"][x].__setitem__("tid", 9), "pid 1 tid 9 has no thread_name"),
        (lambda d: d.__setitem__("traceEvents", [e for e in d["traceEvents"] if e["name"] != "process_name"]),
         "pid 1 has no process_name"),
        (lambda d: d.__setitem__("displayTimeUnit", "us"), "displayTimeUnit must be 'ms' or 'ns'"),
        (lambda d: d["traceEvents"].append({"ph": "M", "name": "thread_colour", "pid": 1, "tid": 1, "args": {}}),
         "expected one of process_name"),
        (lambda d: d.__setitem__("traceEvents", [e for e in d["traceEvents"] if e["ph"] == "M"]), "no complete events"),
    ]
    for edit, message in cases:
        with pytest.raises(ValueError, match=message):
            check_trace_events(broken(edit))
    with pytest.raises(ValueError, match="expected a JSON array of events"):
        check_trace_events({"events": []})


def test_to_trace_events_inputs():
    one = TRACES["qwen3-30b-a3b_M1_r16_fused"]
    doc = to_trace_events(one)
    assert [e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"] == [
        "qwen3-30b-a3b_M1_r16_fused"]
    assert to_trace_events(one, name="x")["traceEvents"][0]["args"]["name"] == "x"
    plain = {"meta": {"source": "elsewhere"}, "records": one["records"]}
    with pytest.raises(ValueError, match="case 'trace': meta: preset, M, rank, loras, schedule, lora_path missing.*"
                                         "pass model=False"):
        to_trace_events(plain)
    assert all(set(e["args"]) == {"lane"} for e in to_trace_events(plain, model=False)["traceEvents"] if e["ph"] == "X")
    # stages that overlap cannot share one thread, whatever the schedule says
    overlapping = {"meta": {**one["meta"], "schedule": "sequential"},
                   "records": [dict(stream="main", name="base_w13", start_us=0.0, end_us=5.0),
                               dict(stream="lora", name="lora_w13", start_us=1.0, end_us=2.0)]}
    doc = to_trace_events(overlapping, model=False)
    assert len({e["tid"] for e in doc["traceEvents"] if e["ph"] == "X"}) == 2
    with pytest.raises(TypeError, match="traces: expected a case"):
        to_trace_events([])
    with pytest.raises(ValueError, match="case 'a' lacks a dict 'meta' or a non-empty list of 'records'"):
        to_trace_events({"a": {"meta": {}, "records": []}})
    with pytest.raises(ValueError, match="record 0 \\('x'\\) needs numbers start_us <= end_us, got 2, 1"):
        to_trace_events({"a": {"meta": {}, "records": [dict(stream="main", name="x", start_us=2, end_us=1)]}})
    with pytest.raises(ValueError, match="needs numbers start_us <= end_us, got '0', '1'"):
        to_trace_events({"a": {"meta": {}, "records": [dict(stream="main", name="x", start_us="0", end_us="1")]}})


def test_command_line(tmp_path, capsys):
    paths = main([str(DATA_DIR / "layer_traces.json"), str(tmp_path / "out")])
    assert len(paths) == len(TRACES) and f"wrote {len(TRACES)} trace file(s)" in capsys.readouterr().out
    assert {p.name for p in paths} == {f"{case}.trace.json" for case in TRACES}
    (combined,) = main([str(DATA_DIR / "layer_traces.json"), str(tmp_path / "out"), "--combined"])
    assert combined.name == "layer_traces.trace.json" and load_trace_events(combined).keys() == TRACES.keys()
    (tmp_path / "broken.json").write_text("[")
    with pytest.raises(SystemExit):
        main([str(tmp_path / "broken.json"), str(tmp_path / "out")])
    assert "cannot read" in capsys.readouterr().err
