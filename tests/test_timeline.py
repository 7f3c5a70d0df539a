import json
import shlex

import pytest

from moelora_lab.profile.timeline import overlap_metrics, save_traces
from moelora_lab.results import load_traces, stamp

REC = [
    dict(stream="main", name="base_w13", start_us=0.0, end_us=10.0),
    dict(stream="lora", name="lora_w13", start_us=2.0, end_us=8.0),
    dict(stream="main", name="act", start_us=10.0, end_us=12.0),
    dict(stream="main", name="base_w2", start_us=12.0, end_us=20.0),
    dict(stream="lora", name="lora_w2", start_us=18.0, end_us=26.0),
    dict(stream="main", name="sum", start_us=26.0, end_us=27.0),
]


def test_overlap_metrics_by_hand():
    m = overlap_metrics(REC)
    # main busy: [0,20] + [26,27] = 21; lora busy: 6 + 8 = 14; both: [2,8] + [18,20] = 8
    assert (m["main_busy_us"], m["side_busy_us"], m["both_busy_us"]) == (21.0, 14.0, 8.0)
    assert m["overlap"] == pytest.approx(8 / 14, abs=1e-4)
    assert m["critical_path_us"] == 27.0 and m["serial_sum_us"] == 35.0


def test_overlap_metrics_sequential_and_errors():
    seq = [dict(stream="main", name="a", start_us=0, end_us=5), dict(stream="lora", name="b", start_us=5, end_us=9)]
    assert overlap_metrics(seq)["overlap"] == 0.0
    with pytest.raises(ValueError, match="records: empty timeline"):
        overlap_metrics([])
    with pytest.raises(ValueError, match="ends before it starts"):
        overlap_metrics([dict(stream="main", name="a", start_us=3, end_us=1)])


def test_traces_round_trip(tmp_path):
    path = tmp_path / "t.json"
    save_traces({"case": dict(meta={"M": 16, **stamp()}, records=REC)}, path)
    assert load_traces("t", tmp_path)["case"]["records"][1]["name"] == "lora_w13"
    path.write_text(json.dumps({"bad": {"records": []}}))
    with pytest.raises(ValueError, match="case 'bad' lacks 'meta' or 'records'"):
        load_traces("t", tmp_path)


def test_committed_h200_traces():
    """The committed layer timelines: every case of layer.csv inside the trace grid of the command that
    took them, once per schedule that fits; sequential never overlaps; two streams do; metrics recompute."""
    from moelora_lab.bench import parse_args
    from moelora_lab.layer import fused_fits
    from moelora_lab.plots.layer import trace_name
    from moelora_lab.results import load

    traces = load_traces()
    commands = {t["meta"]["command"] for t in traces.values()}
    rows = load("layer")
    assert commands == {r["command"] for r in rows}, "the traces and layer.csv come from one run"
    argv = shlex.split(commands.pop())
    assert argv[:4] == ["python", "-m", "moelora_lab.bench", "layer"]
    args = parse_args(argv[3:])
    cases = {(r["preset"], r["M"], r["rank"], r["loras"]) for r in rows if r["variant"] == "sequential"
             and r["M"] in args.trace_tokens and r["rank"] in args.trace_ranks}
    expected = {trace_name(preset, M, rank, s) for preset, M, rank, L in cases
                for s in ("sequential", "dual_stream") + (("fused",) if fused_fits(L, rank) else ())}
    assert len(cases) >= 4 and set(traces) == expected
    assert {t["meta"]["rank"] for t in traces.values() if t["meta"]["schedule"] == "fused"} == {
        rank for _, _, rank, L in cases if fused_fits(L, rank)}
    for name, t in traces.items():
        meta = t["meta"]
        assert name == trace_name(meta["preset"], meta["M"], meta["rank"], meta["schedule"])
        assert meta["gpu"] == "NVIDIA H200" and meta["triton"] and meta["torch"] and meta["floor_us"] > 0
        m = overlap_metrics(t["records"])
        assert m == t["metrics"]
        if meta["schedule"] == "fused":             # the LoRA rides in the GEMMs: one lane, four stages
            assert {r["stream"] for r in t["records"]} == {"main"}
            assert [r["name"] for r in t["records"]] == ["w13+lora", "act", "w2+lora", "sum"]
            assert m["side_busy_us"] == 0 and m["critical_path_us"] >= 0.99 * m["serial_sum_us"]
            continue
        assert {r["stream"] for r in t["records"]} == {"main", "lora"}
        assert [r["name"] for r in t["records"]] == ["base_w13", "lora_w13", "act", "base_w2", "lora_w2", "sum"]
        if meta["schedule"] == "sequential":
            assert m["overlap"] == 0.0 and m["critical_path_us"] >= 0.99 * m["serial_sum_us"]
        else:
            assert m["overlap"] > 0.5 and m["critical_path_us"] < m["serial_sum_us"]
