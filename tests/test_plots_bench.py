"""Benchmark plots: what each draw function puts on the Axes, on hand-made rows; the committed H200 CSV."""
import matplotlib

matplotlib.use("Agg")

from pathlib import Path

import pytest
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure

from moelora_lab.results import read_csv, write_csv
from moelora_lab.plots.bench import (PATH_STYLE, draw_roofline, draw_speedup_vs_vllm, draw_time_vs_tokens,
                                     save_kernel_plots, select, vllm_comparison)

DATA = Path(__file__).resolve().parent.parent / "moelora_lab" / "data" / "h200"
PROV = dict(gpu="NVIDIA H200", torch="2.11.0+cu130", triton="3.6.0", python="3.12.3", date="2026-11-29",
            command="hand-made")


def row(path, M, us, *, preset="p", op="w13", rank=16, bytes_=1000, flops=2000, floor=1.0, ran=None):
    return dict(preset=preset, op=op, path=path, ran=ran or path, M=M, rank=rank, loras=4, dtype="bfloat16",
                block_m=16, block_n=128, n_chunks=1, us_median=us, us_p20=0.9 * us, us_p80=1.1 * us,
                bytes=bytes_, flops=flops, floor_us=floor, achieved_tbps=bytes_ / (us * 1e-6) / 1e12,
                copy_tbps=4.0, **PROV)


# two paths at M = 1, 8, 64 for (p, w13, r16); one w2 row and one r64 row that must not leak in
ROWS = [row("two_kernel", m, 10.0 * m ** 0.5 + 5, floor=0.1 * m) for m in (64, 1, 8)] + \
       [row("one_shot", m, 10.0 * m ** 0.5, floor=0.1 * m) for m in (1, 8, 64)] + \
       [row("one_shot", 8, 99.0, op="w2"), row("one_shot", 8, 77.0, rank=64)]
VLLM = [dict(preset="p", op="w13", rank=16, M=m, vllm_dispatch_us=3.0 * m, vllm_best_us=2.0 * m) for m in (8, 1)]


def axes():
    return Figure().add_subplot()


def lines_by_label(ax):
    return {line.get_label(): line for line in ax.get_lines()}


def test_select_filters_on_every_field():
    assert len(select(ROWS, path="one_shot")) == 5
    assert [r["M"] for r in select(ROWS, path="one_shot", op="w13", rank=16)] == [1, 8, 64]
    assert select(ROWS, path="one_shot", M=8, op="w2")[0]["us_median"] == 99.0
    assert select(ROWS, path="nope") == []
    assert select(ROWS) == ROWS


def test_time_vs_tokens_draws_each_path_sorted_by_m_with_bands_and_floor():
    ax = axes()
    draw_time_vs_tokens(ax, ROWS, preset="p", op="w13", rank=16)
    lines = lines_by_label(ax)
    two, one = PATH_STYLE["two_kernel"]["label"], PATH_STYLE["one_shot"]["label"]
    assert set(lines) == {two, one, "byte floor (one-shot bytes / copy rate)"}
    assert list(lines[two].get_xdata()) == [1, 8, 64]                      # sorted although given 64, 1, 8
    assert list(lines[one].get_ydata()) == pytest.approx([10.0, 10.0 * 8 ** 0.5, 80.0])
    assert list(lines["byte floor (one-shot bytes / copy rate)"].get_ydata()) == pytest.approx([0.1, 0.8, 6.4])
    assert lines[two].get_color() == PATH_STYLE["two_kernel"]["color"]
    assert sum(isinstance(c, PolyCollection) for c in ax.collections) == 2  # one p20-p80 band per path
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert ax.get_xlabel() == "tokens M" and "µs" in ax.get_ylabel()
    assert ax.get_title() == "p w13, rank 16"
    assert ax.get_legend() is not None


def test_time_vs_tokens_vllm_line_only_when_rows_match():
    ax = axes()
    draw_time_vs_tokens(ax, ROWS, preset="p", op="w13", rank=16, vllm_rows=VLLM)
    ref = lines_by_label(ax)["vLLM dispatch (H200)"]
    assert list(ref.get_xdata()) == [1, 8] and list(ref.get_ydata()) == [3.0, 24.0]
    for vllm in (None, [], [dict(VLLM[0], rank=64)]):
        ax = axes()
        draw_time_vs_tokens(ax, ROWS, preset="p", op="w13", rank=16, vllm_rows=vllm)
        assert "vLLM dispatch (H200)" not in lines_by_label(ax)


def test_time_vs_tokens_options_and_missing_paths():
    ax = axes()
    draw_time_vs_tokens(ax, ROWS, preset="p", op="w13", rank=16, paths=("small_batch", "one_shot"),
                        show_floor=False)
    assert list(lines_by_label(ax)) == [PATH_STYLE["one_shot"]["label"]]  # no small-batch rows, no floor
    ax = axes()
    draw_time_vs_tokens(ax, ROWS, preset="p", op="w13", rank=16, paths=("two_kernel",))
    assert "byte floor (one-shot bytes / copy rate)" not in lines_by_label(ax)  # the floor comes from one-shot


def test_roofline_ceilings_from_the_rows_and_points_per_rank_and_path():
    rows = [dict(row("one_shot", m, us, bytes_=1000, flops=f), matmul_tflops=100.0)
            for m, us, f in ((8, 2.0, 8000), (1, 10.0, 4000))]
    rows += [dict(row("two_kernel", 1, 5.0, bytes_=2000, flops=1000), matmul_tflops=100.0),
             dict(row("two_kernel", 2, 5.0, bytes_=0, flops=1000), matmul_tflops=100.0)]   # zero bytes: skipped
    rows += [dict(row("one_shot", 1, 4.0, rank=64, bytes_=1000, flops=2000), matmul_tflops=100.0)]
    ax = axes()
    draw_roofline(ax, rows)
    lines = ax.get_lines()
    # per rank: the first path of PATH_STYLE (two-kernel) filled, then one-shot hollow; then the two ceilings
    data_lines, (copy, peak) = lines[:-2], lines[-2:]
    assert [line.get_marker() for line in data_lines] == ["s", "o", "o"]      # r = 64 ran one-shot only
    assert data_lines[1].get_xdata().tolist() == pytest.approx([4.0, 8.0])               # FLOP / byte, M sorted
    assert data_lines[1].get_ydata().tolist() == pytest.approx([4000 / 10e-6 / 1e12, 8000 / 2e-6 / 1e12])
    assert data_lines[1].get_markerfacecolor() == "none" and data_lines[0].get_markerfacecolor() != "none"
    assert data_lines[0].get_color() == data_lines[1].get_color() != data_lines[2].get_color()   # colour = rank
    assert len(data_lines[0].get_xdata()) == 1
    assert copy.get_xdata()[-1] == pytest.approx(25.0)                   # ridge = 100 TFLOP/s / 4 TB/s
    assert copy.get_ydata()[-1] == pytest.approx(100.0) and list(peak.get_ydata()) == [100.0, 100.0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[:2] == ["r = 16", "r = 64"]
    assert "copy bandwidth 4.00 TB/s" in legend and "bfloat16 matmul 100 TFLOP/s" in legend
    assert [t.get_text() for t in ax.texts] == ["1"]                      # M beside the first path's points
    lo, hi = ax.get_xlim()
    assert lo == pytest.approx(0.5 / 1.5) and 25.0 < hi < 100            # cropped: the points and the ridge
    assert ax.get_xscale() == ax.get_yscale() == "log"


def test_roofline_without_a_measured_compute_ceiling_draws_none():
    ax = axes()
    draw_roofline(ax, [r for r in ROWS if r["op"] == "w13" and r["rank"] == 16])   # no matmul_tflops in ROWS
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert not any("TFLOP/s" in t for t in legend) and "copy bandwidth 4.00 TB/s" in legend
    ax = axes()
    draw_roofline(ax, [dict(r, copy_tbps=0) for r in ROWS if r["op"] == "w13" and r["rank"] == 16])
    assert not any("TB/s" in t.get_text() for t in ax.get_legend().get_texts())      # no copy rate: no roof
    ax = axes()
    draw_roofline(ax, [r for r in ROWS if r["rank"] == 16 and r["M"] == 8], color_by="op", bandwidth_tbps=2.0,
                  peak_tflops=50.0, label_m=False)
    assert ax.get_lines()[-2].get_xdata()[-1] == pytest.approx(25.0) and not ax.texts
    assert [t.get_text() for t in ax.get_legend().get_texts()][:2] == ["w13", "w2"]


def test_roofline_rejects_mixed_rows_and_bad_arguments():
    with pytest.raises(ValueError, match="one preset and one op"):
        draw_roofline(axes(), ROWS)                                      # w13 and w2 under one colour per rank
    with pytest.raises(ValueError, match="color_by"):
        draw_roofline(axes(), ROWS, color_by="M")
    with pytest.raises(ValueError, match="peak_tflops"):
        draw_roofline(axes(), ROWS[:3], peak_tflops=-1)
    with pytest.raises(ValueError, match="rows"):
        draw_roofline(axes(), [row("align", 1, 1.0, bytes_=0)])
    with pytest.raises(TypeError, match="ax"):
        draw_roofline(Figure(), ROWS[:3])


@pytest.mark.filterwarnings("ignore:No artists with labels")   # preset p has no (w2, r64) rows: an empty panel
def test_save_kernel_plots_writes_one_png_per_preset_and_a_roofline(tmp_path):
    rows = ROWS + [row("one_shot", 1, 3.0, preset="q"), row("align", 1, 4.0, bytes_=0, flops=0, preset="z")]
    csv_path = tmp_path / "k.csv"
    write_csv(rows, csv_path)
    back = read_csv(csv_path)
    assert back[0]["M"] == 64 and back[0]["us_median"] == pytest.approx(ROWS[0]["us_median"])
    written = save_kernel_plots(back, tmp_path, name="k")
    assert [p.name for p in written] == ["k_p.png", "k_q.png", "k_roofline.png"]   # align rows are not timed
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_committed_h200_sweep_has_provenance_and_every_path():
    rows = read_csv(DATA / "kernels.csv")
    assert len(rows) > 100
    assert {r["gpu"] for r in rows} == {"NVIDIA H200"}
    for key in ("torch", "triton", "python", "date", "command"):
        values = {str(r[key]) for r in rows}
        assert len(values) == 1 and values.pop().strip(), key
    assert str(rows[0]["torch"]).startswith("2.") and str(rows[0]["triton"]).startswith("3.")
    assert rows[0]["command"].startswith("python -m moelora_lab.bench kernels")
    cases = {(r["preset"], r["op"], r["rank"], r["M"]) for r in rows}
    for case in cases:
        got = {r["path"] for r in select(rows, **dict(zip(("preset", "op", "rank", "M"), case)))}
        assert {"two_kernel", "one_shot", "auto", "align"} <= got, case
        if case[3] <= 512:
            assert "small_batch" in got, case
    timed = [r for r in rows if r["path"] != "align"]
    assert all(r["us_p20"] <= r["us_median"] <= r["us_p80"] for r in timed)
    assert all(r["bytes"] > 0 and r["flops"] > 0 and 4.0 < r["copy_tbps"] < 4.5 for r in timed)
    assert all(r["ran"] == r["path"] for r in timed if r["path"] != "auto")
    assert {r["ran"] for r in timed if r["path"] == "auto"} == {"one_shot", "two_kernel"}


def test_gemm_tile_rule_against_the_committed_sweep():
    """The tile rule in moe.gemm_tiles was read off gemm_tune.csv: its tiles ran in the sweep, come
    within 5% of the grid's best for every GEMM but one, and never lose more than 1% to the rule in
    force when the sweep ran. The one: w2 with the in-GEMM LoRA (the ``fused`` and ``epilogue``
    schedules, which ``auto`` never runs) at M = 16, where BLOCK_K 64 beat the rule's 128 by 7.8% and
    8.3% in two sweeps; it is held to 9% here until the rule moves with the next regeneration of the
    data."""
    from moelora_lab.results import DATA_DIR as DEFAULT_OUT, read_csv
    from moelora_lab.plots.bench import gemm_tile_table

    table = gemm_tile_table(read_csv(DEFAULT_OUT / "gemm_tune.csv"))
    assert {(r["op"], r["lora_rank"] > 0) for r in table} == {(o, lo) for o in ("w13", "w2") for lo in (False, True)}
    for r in table:
        assert r["now_us"] is not None, r
        known = (r["op"], r["M"], r["lora_rank"] > 0) == ("w2", 16, True)
        assert r["best_us"] <= r["now_us"] <= (1.09 if known else 1.05) * r["best_us"], r
        assert r["now_us"] <= 1.01 * r["then_us"], r


OURS_VLLM = [dict(row("auto", 1, 10.0), ran="one_shot"), dict(row("auto", 8, 20.0), ran="two_kernel"),
             row("one_shot", 8, 1.0), row("one_shot", 64, 1.0)]
VLLM_REF = [dict(preset="p", op="w13", rank=16, M=m, vllm_dispatch_us=d, vllm_best_us=b)
            for m, d, b in ((1, 30.0, 20.0), (8, 15.0, 15.0), (64, 1.0, 1.0))]


def test_vllm_comparison_uses_auto_rows_only():
    table = vllm_comparison(OURS_VLLM, VLLM_REF, preset="p")
    assert [(r["M"], r["ran"]) for r in table] == [(1, "one_shot"), (8, "two_kernel")]   # M=64: no auto row
    assert [r["speedup"] for r in table] == pytest.approx([3.0, 0.75])
    assert [r["speedup_best"] for r in table] == pytest.approx([2.0, 0.75])
    with pytest.raises(ValueError, match="preset 'q'"):
        vllm_comparison(OURS_VLLM, VLLM_REF, preset="q")
    with pytest.raises(ValueError, match="vllm_dispatch_us"):
        vllm_comparison(OURS_VLLM, [dict(preset="p", op="w13", rank=16, M=1)], preset="p")


def test_draw_speedup_vs_vllm():
    table = [dict(op=op, rank=r, M=m, speedup=s) for op, r in (("w2", 16), ("w13", 64), ("w13", 16))
             for m, s in ((8, 2.0), (1, 3.0))]
    ax = axes()
    draw_speedup_vs_vllm(ax, table)
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels == ["w13, r = 16", "w13, r = 64", "w2, r = 16", "parity"]
    assert list(ax.get_lines()[0].get_xdata()) == [1, 8] and list(ax.get_lines()[0].get_ydata()) == [3.0, 2.0]
    assert ax.get_lines()[2].get_linestyle() == "--"
    assert list(ax.get_lines()[3].get_ydata()) == [1.0, 1.0]
    assert ax.get_ylim()[0] == 0 and "vLLM" in ax.get_ylabel()
    assert all(t.get_fontsize() >= 9 for t in ax.get_legend().get_texts())
    with pytest.raises(TypeError, match="ax"):
        draw_speedup_vs_vllm(Figure(), table)


def test_committed_vllm_comparison_uses_the_auto_rows_of_the_sweep():
    """vLLM's reference (measured with vLLM's code) against the ``auto`` rows of kernels.csv; those
    rows ran what the current rule picks."""
    from moelora_lab.config import MoEShape
    from moelora_lab.op.paths import resolve_path

    sweep = read_csv(DATA / "kernels.csv")
    table = vllm_comparison(sweep, read_csv(DATA / "vllm_reference.csv"))
    assert len(table) == 28 and {(r["op"], r["rank"]) for r in table} == {(o, r) for o in ("w13", "w2")
                                                                          for r in (16, 64)}
    qwen = MoEShape.from_name("qwen3-30b-a3b")
    for r in table:
        assert r["ran"] == resolve_path("auto", num_pairs=r["M"] * qwen.top_k, num_experts=qwen.num_experts,
                                        num_loras=4, rank=r["rank"], add_inputs=True, token_rows=r["op"] == "w13",
                                        n_out=qwen.op_dims(r["op"])[1])
        assert r["speedup"] == pytest.approx(r["vllm_dispatch_us"] / r["ours_us"])
    assert sum(r["speedup"] > 1 for r in table) >= 26                      # faster in all but a few cells


# Gaps the walk found beyond 15%, each the next tile change to measure: none now. (The walk at code 4affdc9bf8
# found BLOCK_K 512 1.16x faster than the rule's 128 for w13 at M = 1, r 16; the rule took it up, DECODE_BLOCK_K.)
KNOWN: dict = {}


def test_lora_tile_rule_against_the_committed_walk():
    """The LoRA op's tile rule (dispatch.gpu_config) against the greedy walk in lora_tune.csv: in every
    case the tiles the walk marked as the rule are what the rule gives today for the same routing on a
    132-SM H200, and for the one-shot path at r = 16 (the narrow-rank rule, the tiles ``auto`` runs
    there) the walk found nothing more than 15% faster around them, but where ``KNOWN`` names a larger gap
    (the next tile change to measure)."""
    from moelora_lab.results import DATA_DIR as DEFAULT_OUT, read_csv
    from moelora_lab.bench.tune_sweep import TILE_FIELDS
    from moelora_lab.config import MoEShape, make_routing
    from moelora_lab.op.dispatch import gpu_config
    from moelora_lab.profile.traffic import count_workload

    rows = [r for r in read_csv(DEFAULT_OUT / "lora_tune.csv") if r["us_median"] != ""]
    cases = {(r["preset"], r["op"], r["path"], r["rank"], r["M"]) for r in rows}
    assert {c[2] for c in cases} == {"one_shot", "two_kernel"} and len(cases) >= 12
    narrow = 0
    for preset, op, path, rank, M in cases:
        mine = [r for r in rows if (r["preset"], r["op"], r["path"], r["rank"], r["M"]) == (preset, op, path, rank, M)]
        (rule,) = [r for r in mine if str(r["rule"]) == "True"]
        shape = MoEShape.from_name(preset)
        rt = make_routing(shape, 4, M, seed=M, num_sequences=min(M, 8))       # the walk's routing (seed 0 + M)
        work = count_workload(rt["topk_ids"], rt["token_lora"], shape.num_experts, 4)
        n_out, slices = (shape.intermediate, 2) if op == "w13" else (shape.hidden, 1)
        P = M * shape.top_k
        cfg = gpu_config(path, P, min(P, work.touched_adapter_experts), n_out, slices, 132, rank=rank)
        assert tuple(getattr(cfg, f) for f in TILE_FIELDS) == tuple(rule[f] for f in TILE_FIELDS), (op, path, M)
        if path == "one_shot" and rank == 16:
            narrow += 1
            best = min(r["us_median"] for r in mine)
            assert rule["us_median"] <= KNOWN.get((preset, op, M), 1.15) * best, (op, M, rule["us_median"], best)
    assert narrow >= 6
