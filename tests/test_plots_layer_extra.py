"""The two-stream functions of plots.layer: stage bytes, trace phases, overlap table, variant table."""
import matplotlib

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402

import pytest  # noqa: E402

from moelora_lab import MoEShape  # noqa: E402
from moelora_lab.plots.layer import (data_label, draw_timelines, overlap_table, stage_pair_bytes, trace_name,  # noqa: E402
                                     trace_phases, variant_table)
from moelora_lab.profile.traffic import Workload, layer_traffic  # noqa: E402
from utils import join_rows  # noqa: E402
from test_timeline import REC  # noqa: E402

SHAPE = MoEShape(64, 32, 8, 2, "t")
META = dict(preset="p", M=16, rank=8, gpu="GPU", torch="2.0", triton="3.0", date="2026-01-01", floor_us=20.0)
SEQ = [
    dict(stream="main", name="base_w13", start_us=0.0, end_us=10.0),
    dict(stream="lora", name="lora_w13", start_us=10.0, end_us=14.0),
    dict(stream="main", name="act", start_us=14.0, end_us=15.0),
    dict(stream="main", name="base_w2", start_us=15.0, end_us=20.0),
    dict(stream="lora", name="lora_w2", start_us=20.0, end_us=24.0),
    dict(stream="main", name="sum", start_us=24.0, end_us=25.0),
]


def traces():
    return {trace_name("p", 16, 8, "sequential"): dict(meta=dict(META, schedule="sequential"), records=SEQ),
            trace_name("p", 16, 8, "dual_stream"): dict(meta=dict(META, schedule="dual_stream"), records=REC),
            trace_name("p", 32, 8, "sequential"): dict(meta=dict(META, M=32, schedule="sequential"), records=SEQ)}


def test_data_label_and_trace_name():
    assert data_label(dict(META, code="abc")) == "GPU, torch 2.0, triton 3.0, 2026-01-01, code abc"
    with pytest.raises(KeyError, match="provenance field"):
        data_label({"gpu": "GPU"})
    assert trace_name("qwen3-30b-a3b", 16, 64, "dual_stream") == "qwen3-30b-a3b_M16_r64_dual_stream"


def test_stage_pair_bytes_by_hand():
    wl = Workload(num_tokens=4, top_k=2, tokens_with_adapter=4, pairs_with_adapter=8, touched_adapter_experts=5,
                  touched_experts=6)
    stages = layer_traffic(SHAPE, 4, wl)
    rows = stage_pair_bytes(stages, 1e6)                       # 1 MB/s: 1 byte = 1 µs
    assert [r["phase"] for r in rows] == ["w13", "w2"]
    w13 = rows[0]
    assert w13["base_bytes"] == stages["base_w13"].bytes and w13["lora_bytes"] == stages["lora_w13"].bytes
    assert w13["base_us"] == pytest.approx(w13["base_bytes"])
    assert w13["hidden_us"] == pytest.approx(max(w13["base_bytes"], w13["lora_bytes"]))
    assert w13["shared_us"] == pytest.approx(w13["base_bytes"] + w13["lora_bytes"])
    with pytest.raises(KeyError, match="with_lora=True"):
        stage_pair_bytes(layer_traffic(SHAPE, 4, wl, with_lora=False), 1e6)
    with pytest.raises(ValueError, match="must be > 0"):
        stage_pair_bytes(stages, 0)


def test_trace_phases():
    ph = trace_phases(REC)       # w13: base [0,10], lora [2,8]; w2: base [12,20], lora [18,26]
    assert ph["w13"] == dict(base_us=10.0, lora_us=6.0, window_us=10.0)
    assert ph["w2"] == dict(base_us=8.0, lora_us=8.0, window_us=14.0)
    with pytest.raises(KeyError, match="records: stages"):
        trace_phases(REC[:1])


def test_overlap_table_pairs_schedules():
    rows = overlap_table(traces())
    assert len(rows) == 1                      # M=32 has no dual-stream trace
    r = rows[0]
    assert (r["preset"], r["M"], r["rank"], r["floor_us"]) == ("p", 16, 8, 20.0)
    assert (r["seq_us"], r["dual_us"], r["lora_seq_us"], r["lora_dual_us"]) == (25.0, 27.0, 8.0, 14.0)
    assert r["alone_us"] == 25.0                # the one-stream stages added up, not the stretched two-stream bars
    assert r["overlap"] == pytest.approx(8 / 14, abs=1e-4)
    assert r["hidden"] == pytest.approx((25 - 27) / 8)


def test_draw_timelines_share_axis_and_floor():
    fig = Figure()
    axes = fig.subplots(2, 1)
    metrics = draw_timelines(axes, [("one", SEQ, 1), ("two", REC, 2)], floor_us=30.0, alone_us=25.0)
    assert axes[0].get_xlim() == axes[1].get_xlim() == (0.0, pytest.approx(30.9))
    assert [m["critical_path_us"] for m in metrics] == [25.0, 27.0]
    assert [t.get_text() for t in axes[0].get_yticklabels()] == ["one stream"]          # no side-stream lane
    assert axes[0].get_title(loc="left") == "one\ncritical path 25 µs"
    assert "LoRA beside the base work for 57%" in axes[1].get_title(loc="left")
    assert axes[1].get_title(loc="left").endswith("alone, back to back: 25 µs")       # alone_us, not 35 µs
    for ax in axes:                                                     # the floor is named in the legend
        assert "byte floor of the fused layer, 30 µs" in [t.get_text() for t in ax.get_legend().get_texts()]
        assert ax.get_legend().get_bbox_to_anchor().x0 > ax.get_window_extent().x1 - 1     # outside the data
    axes = Figure().subplots(2, 1)
    draw_timelines(axes, [("one", SEQ), ("two", REC)])                  # two-field cases: two lanes
    assert len(axes[0].get_yticklabels()) == 2 and axes[0].get_xlim()[1] == pytest.approx(1.03 * 27)
    with pytest.raises(ValueError, match="one Axes per case"):
        draw_timelines(axes, [("one", SEQ)])
    with pytest.raises(TypeError, match="cases: expected"):
        draw_timelines(axes[:1], [SEQ])


def test_variant_table():
    t = variant_table(join_rows(), preset="p", rank=16, variants=("sequential", "sequential_vllm_join"))
    assert [r["M"] for r in t] == [1, 16, 256]          # M=512: the vLLM-join row was not timed
