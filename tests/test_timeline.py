import json

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
    """The committed layer timelines: sequential never overlaps; two streams do; metrics recompute."""
    traces = load_traces()
    assert len(traces) == 10
    assert sorted(t["meta"]["schedule"] for t in traces.values()).count("fused") == 2
    for name, t in traces.items():
        assert t["meta"]["gpu"] == "NVIDIA H200" and t["meta"]["triton"] and t["meta"]["torch"]
        m = overlap_metrics(t["records"])
        assert m == t["metrics"]
        if t["meta"]["schedule"] == "fused":        # the LoRA rides in the GEMMs: one lane, four stages
            assert {r["stream"] for r in t["records"]} == {"main"} and t["meta"]["rank"] == 16
            assert [r["name"] for r in t["records"]] == ["w13+lora", "act", "w2+lora", "sum"]
            assert m["side_busy_us"] == 0 and m["critical_path_us"] >= 0.99 * m["serial_sum_us"]
            continue
        assert {r["stream"] for r in t["records"]} == {"main", "lora"}
        assert {r["name"] for r in t["records"]} == {"base_w13", "lora_w13", "act", "base_w2", "lora_w2", "sum"}
        if t["meta"]["schedule"] == "sequential":
            assert m["overlap"] == 0.0 and m["critical_path_us"] >= 0.99 * m["serial_sum_us"]
        else:
            assert m["overlap"] > 0.5 and m["critical_path_us"] < m["serial_sum_us"]
