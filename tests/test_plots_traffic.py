"""HBM-traffic plots: the byte tables against hand counts and the committed sweep, the artists drawn."""
import matplotlib

matplotlib.use("Agg")

from pathlib import Path

import pytest
from matplotlib.container import BarContainer
from matplotlib.figure import Figure

from moelora_lab import MoEShape
from moelora_lab.results import read_csv
from moelora_lab.plots.bench import PATH_STYLE, select
from moelora_lab.plots.traffic import (
    draw_bytes_breakdown,
    draw_intermediate_share,
    draw_measured_vs_predicted,
    draw_ratio_vs_tokens,
    measured_vs_predicted,
    op_dims,
    ratio_points,
    sweep_workload,
    traffic_table,
)
from moelora_lab.profile.traffic import Traffic, Workload, lora_op_traffic

DATA = Path(__file__).resolve().parent.parent / "moelora_lab" / "data" / "h200"
SMALL = MoEShape(64, 32, 8, 2, "small")      # H 64, I 32, E 8, k 2


def axes():
    return Figure().add_subplot()


def timed_row(path, M, us, *, bytes_, preset="p", op="w13", rank=16, copy_tbps=4.0):
    return dict(preset=preset, op=op, rank=rank, path=path, ran=path, M=M, us_median=us, bytes=bytes_,
                copy_tbps=copy_tbps)


def test_op_dims():
    qwen = MoEShape.from_name("qwen3-30b-a3b")
    assert op_dims(qwen, "w13") == dict(in_features=2048, out_features=768, num_slices=2, x_rows="token")
    assert op_dims("qwen3-30b-a3b", "w2") == dict(in_features=768, out_features=2048, num_slices=1, x_rows="pair")
    with pytest.raises(ValueError, match="op"):
        op_dims(qwen, "w3")
    with pytest.raises(TypeError, match="shape"):
        op_dims(42, "w13")


def test_traffic_table_hand_counted_intermediate():
    rows = traffic_table(SMALL, 4, "w13", [3, 16], num_loras=2)
    assert [(r["M"], r["path"]) for r in rows] == [(3, "two_kernel"), (3, "one_shot"), (16, "two_kernel"),
                                                 (16, "one_shot")]
    two, one = rows[0], rows[1]
    # T [S=2, M*k=6, r=4] in bf16, every pair with an adapter (dense): written once by the shrink and read
    # once by the expand, never filled: 2 passes * 2*6*4 elements * 2 B = 192
    assert two["intermediate"] == 2 * 2 * 6 * 4 * 2 == 192
    assert two["traffic"].part("intermediate_write") == two["traffic"].part("intermediate_read") == 96
    assert one["intermediate"] == 0 and one["intermediate_share"] == 0.0
    assert two["bytes"] - one["bytes"] == two["intermediate"]
    assert two["launches"] == 2 and one["launches"] == 1
    # everything else equals the byte model evaluated by hand on the dense workload
    wl = Workload.dense(3, 2, 8, 2)
    ref = lora_op_traffic("one_shot", wl, in_features=64, out_features=32, num_slices=2, rank=4)
    assert one["traffic"] == ref and one["bytes"] == ref.bytes and one["flops"] == ref.flops
    assert one["x"] == 3 * 64 * 2 and one["out"] == 2 * 6 * 2 * 32 * 2
    assert one["weights"] == wl.touched_adapter_experts * 2 * 4 * (64 + 32) * 2
    for r in rows:
        assert sum(r[f"{g}_share"] for g in ("x", "weights", "intermediate", "out")) == pytest.approx(1.0)
        assert r["intermediate_share"] == pytest.approx(r["intermediate"] / r["bytes"])
    assert rows[2]["intermediate_share"] > two["intermediate_share"]          # T grows with M faster than weights


def test_traffic_table_sweep_routing_matches_the_committed_bytes():
    sweep = [r for r in read_csv(DATA / "kernels.csv") if r["preset"] == "qwen3-30b-a3b" and r["rank"] == 64
             and r["M"] in (8, 512) and r["path"] in ("two_kernel", "one_shot")]
    assert len(sweep) == 8
    for op in ("w13", "w2"):
        for r in traffic_table("qwen3-30b-a3b", 64, op, [8, 512], routing="sweep"):
            (csv_row,) = select(sweep, op=op, M=r["M"], path=r["path"])
            assert r["bytes"] == csv_row["bytes"] and r["flops"] == csv_row["flops"]
    wl = sweep_workload("qwen3-30b-a3b", 8)
    assert wl.pairs_with_adapter == 64 and wl.touched_experts <= 64


def test_traffic_table_rejects_bad_arguments():
    with pytest.raises(ValueError, match="routing"):
        traffic_table(SMALL, 4, "w13", [1], routing="zipf")
    with pytest.raises(TypeError, match="tokens"):
        traffic_table(SMALL, 4, "w13", 8)
    with pytest.raises(ValueError, match="tokens"):
        traffic_table(SMALL, 4, "w13", [0])
    with pytest.raises(ValueError, match="rank"):
        traffic_table(SMALL, 0, "w13", [1])
    with pytest.raises(ValueError, match="paths"):
        traffic_table(SMALL, 4, "w13", [1], paths=("fused",))
    with pytest.raises(ValueError, match="preset"):
        traffic_table("no-such-model", 4, "w13", [1])


def test_bytes_breakdown_stacks_the_parts_of_each_path():
    rows = traffic_table(SMALL, 4, "w13", [3])
    traffics = {r["path"]: r["traffic"] for r in rows}
    ax = axes()
    draw_bytes_breakdown(ax, traffics, unit="KB", title="small")
    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    # x, A, B, T write/read, out read, out write: 7 stacked layers over two bars
    assert len(bars) == 7 and all(len(b) == 2 for b in bars)
    tops = [max(p.get_y() + p.get_height() for p in (b[i] for b in bars)) for i in range(2)]
    assert tops == pytest.approx([traffics["two_kernel"].bytes / 1e3, traffics["one_shot"].bytes / 1e3])
    t_layers = bars[3:5]                                       # the one-shot bar has no T
    assert all(b[1].get_height() == 0 for b in t_layers) and all(b[0].get_height() > 0 for b in t_layers)
    texts = [t.get_text() for t in ax.texts]
    assert texts[0].startswith(f"{traffics['two_kernel'].bytes / 1e3:.3g} KB") and "T:" in texts[0]
    assert "T:" not in texts[1]
    assert [t.get_text() for t in ax.get_xticklabels()] == [
        PATH_STYLE["two_kernel"]["label"].replace(" (", "\n("), PATH_STYLE["one_shot"]["label"].replace(" (", "\n(")]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[0] == "out write" and legend[-1] == "x rows" and "T write (shrink)" in legend
    assert ax.get_ylabel() == "HBM bytes per call (KB)" and ax.get_title() == "small"


def test_bytes_breakdown_auto_unit_and_unknown_parts():
    ax = axes()
    odd = Traffic(3_000_000, 0, 0, 1, (("x", 1_000_000), ("scratch", 2_000_000)))
    draw_bytes_breakdown(ax, {"mine": odd})
    assert ax.get_ylabel() == "HBM bytes per call (MB)"
    assert "scratch" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["mine"]


def test_bytes_breakdown_naive_shows_the_weight_copies():
    rows = traffic_table(SMALL, 4, "w2", [3], paths=("gather_bmm", "one_shot"))
    ax = axes()
    draw_bytes_breakdown(ax, {r["path"]: r["traffic"] for r in rows})
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend.count("per-pair weight copies") == 1


@pytest.mark.parametrize("bad, err", [
    ({}, TypeError), ([Traffic(1, 0, 0, 1)], TypeError), ({"a": 5}, TypeError),
])
def test_bytes_breakdown_rejects_bad_traffics(bad, err):
    with pytest.raises(err, match="traffics"):
        draw_bytes_breakdown(axes(), bad)


def test_bytes_breakdown_rejects_bad_unit_and_axes():
    t = {"a": Traffic(10, 0, 0, 1, (("x", 10),))}
    with pytest.raises(ValueError, match="unit"):
        draw_bytes_breakdown(axes(), t, unit="MiB")
    with pytest.raises(TypeError, match="ax"):
        draw_bytes_breakdown(Figure(), t)


def test_intermediate_share_line_per_series():
    ax = axes()
    a = traffic_table(SMALL, 4, "w13", [16, 1, 4])
    b = traffic_table(SMALL, 32, "w13", [1, 4, 16])
    draw_intermediate_share(ax, a, label="r = 4")
    draw_intermediate_share(ax, b, label="r = 32")
    first, second = ax.get_lines()
    assert list(first.get_xdata()) == [1, 4, 16]
    want = [100 * r["intermediate_share"] for r in sorted(select(a, path="two_kernel"), key=lambda r: r["M"])]
    assert list(first.get_ydata()) == pytest.approx(want)
    assert ax.get_ylim()[1] >= max(second.get_ydata())                   # the larger series is not clipped
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["r = 4", "r = 32"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "4", "16"]
    assert ax.get_xlabel() == "tokens M" and "%" in ax.get_ylabel()


def test_intermediate_share_needs_two_kernel_rows():
    with pytest.raises(ValueError, match="two_kernel"):
        draw_intermediate_share(axes(), traffic_table(SMALL, 4, "w13", [1], paths=("one_shot",)))
    with pytest.raises(ValueError, match="intermediate_share"):
        draw_intermediate_share(axes(), [dict(M=1, path="two_kernel")])
    with pytest.raises(TypeError, match="rows"):
        draw_intermediate_share(axes(), [])


ROWS = [timed_row("two_kernel", 8, 20.0, bytes_=8_000_000), timed_row("two_kernel", 1, 12.0, bytes_=4_000_000),
        timed_row("one_shot", 1, 10.0, bytes_=4_000_000), timed_row("one_shot", 8, 30.0, bytes_=8_000_000),
        timed_row("one_shot", 8, 99.0, bytes_=1, op="w2")]


def test_measured_vs_predicted_numbers():
    pts = measured_vs_predicted(ROWS, preset="p", op="w13", rank=16)
    assert [(p["path"], p["M"]) for p in pts] == [("two_kernel", 1), ("two_kernel", 8), ("one_shot", 1),
                                                  ("one_shot", 8)]
    assert [p["predicted_us"] for p in pts] == pytest.approx([1.0, 2.0, 1.0, 2.0])     # bytes / 4 TB/s
    assert [p["ratio"] for p in pts] == pytest.approx([12.0, 10.0, 10.0, 15.0])
    half = measured_vs_predicted(ROWS, preset="p", op="w13", rank=16, paths=("one_shot",), bandwidth_tbps=2.0)
    assert [p["predicted_us"] for p in half] == pytest.approx([2.0, 4.0])
    with pytest.raises(ValueError, match="rank=64"):
        measured_vs_predicted(ROWS, preset="p", op="w13", rank=64)
    with pytest.raises(ValueError, match="bandwidth_tbps"):
        measured_vs_predicted(ROWS, preset="p", op="w13", rank=16, bandwidth_tbps=0)
    with pytest.raises(ValueError, match="copy_tbps"):
        no_copy_rate = {k: v for k, v in ROWS[0].items() if k != "copy_tbps"}
        measured_vs_predicted([no_copy_rate], preset="p", op="w13", rank=16)


def test_draw_measured_vs_predicted_lines():
    ax = axes()
    draw_measured_vs_predicted(ax, ROWS, preset="p", op="w13", rank=16)
    lines = {line.get_label(): line for line in ax.get_lines()}
    two = PATH_STYLE["two_kernel"]["label"]
    assert set(lines) == {f"{PATH_STYLE[p]['label']}: {kind}" for p in ("two_kernel", "one_shot")
                          for kind in ("measured", "bytes / copy bandwidth")}
    assert list(lines[f"{two}: measured"].get_ydata()) == [12.0, 20.0]
    assert list(lines[f"{two}: bytes / copy bandwidth"].get_ydata()) == pytest.approx([1.0, 2.0])
    assert lines[f"{two}: bytes / copy bandwidth"].get_linestyle() == "--"
    assert lines[f"{two}: measured"].get_color() == PATH_STYLE["two_kernel"]["color"]
    assert ax.get_xscale() == ax.get_yscale() == "log" and ax.get_title() == "p w13, rank 16"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "8"]


def test_ratio_points_one_per_case_with_both_paths():
    rows = ROWS + [timed_row("two_kernel", 64, 5.0, bytes_=100), timed_row("one_shot", 8, 1.0, bytes_=1, preset="q")]
    pts = ratio_points(rows, preset="p")
    # (w13, 16, M) for M = 1 and 8 have both paths; M = 64 only two-kernel, the w2 row only one-shot
    assert [(p["op"], p["rank"], p["M"]) for p in pts] == [("w13", 16, 1), ("w13", 16, 8)]
    assert [p["predicted"] for p in pts] == pytest.approx([1.0, 1.0])          # equal bytes in ROWS
    assert [p["measured"] for p in pts] == pytest.approx([12.0 / 10.0, 20.0 / 30.0])
    assert pts[1]["two_kernel_us"] == 20.0 and pts[1]["one_shot_us"] == 30.0
    with pytest.raises(ValueError, match="preset 'z'"):
        ratio_points(rows, preset="z")
    with pytest.raises(ValueError, match="us_median"):
        ratio_points([dict(preset="p", op="w13", rank=16, path="one_shot", M=1, bytes=1)], preset="p")


def test_ratio_points_on_the_committed_sweep_match_the_byte_model():
    rows = [r for r in read_csv(DATA / "kernels.csv") if r["preset"] == "qwen3-30b-a3b"]
    pts = ratio_points(rows, preset="qwen3-30b-a3b")
    assert len(pts) == len({(r["op"], r["rank"], r["M"]) for r in rows})        # every case timed both paths
    for p in pts:
        # the two-kernel path moves T on top of the one-shot bytes: a little more, never less
        assert 1.0 < p["predicted"] < 1.2, p
        (t,) = [r for r in traffic_table("qwen3-30b-a3b", p["rank"], p["op"], [p["M"]], routing="sweep")
                if r["path"] == "two_kernel"]
        assert p["two_kernel_bytes"] - p["one_shot_bytes"] == t["intermediate"]


def test_draw_ratio_vs_tokens_draws_measured_and_predicted_per_rank():
    pts = [dict(op=op, rank=r, M=m, predicted=1 + 0.001 * m, measured=0.8 + 0.1 * m + 0.01 * r)
           for op in ("w13", "w2") for r in (16, 64) for m in (1, 8)]
    ax = axes()
    draw_ratio_vs_tokens(ax, pts, op="w2")
    drawn = [line for line in ax.get_lines() if len(line.get_xdata())]
    solid = [line for line in drawn if line.get_linestyle() == "-"]
    dashed = [line for line in drawn if line.get_linestyle() == "--"]
    assert [list(line.get_ydata()) for line in solid] == [pytest.approx([1.06, 1.76]), pytest.approx([1.54, 2.24])]
    assert [list(line.get_ydata()) for line in dashed] == [pytest.approx([1.001, 1.008])] * 2
    assert [line.get_color() for line in solid] == [line.get_color() for line in dashed]  # a rank's colour
    assert any(line.get_linestyle() == ":" and list(line.get_ydata()) == [1, 1] for line in ax.get_lines())
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[:2] == ["r = 16", "r = 64"] and any("byte model" in t for t in legend)
    texts = [*ax.get_legend().get_texts(), *ax.get_xticklabels(), *ax.get_yticklabels(), ax.xaxis.label, ax.yaxis.label]
    assert all(t.get_fontsize() >= 10 for t in texts)
    assert ax.get_title() == "w2" and ax.get_xscale() == "log"
    with pytest.raises(ValueError, match="none for op"):
        draw_ratio_vs_tokens(axes(), [p for p in pts if p["op"] == "w13"], op="w2")
    with pytest.raises(ValueError, match="op"):
        draw_ratio_vs_tokens(axes(), pts, op="w3")
