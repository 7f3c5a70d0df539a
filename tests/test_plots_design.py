"""plots.design: the join's bytes and savings, the tile rules against the walks, the memory order of
B, the base GEMMs and the routing plan, one-stream stage strips."""
import math

import matplotlib

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402

import pytest  # noqa: E402

from moelora_lab import MoEShape  # noqa: E402
from moelora_lab.op.dispatch import choose_path, gpu_config  # noqa: E402
from moelora_lab.plots.design import (TILE_FIELDS, draw_base_and_plan, draw_grouped_mm_ratio,  # noqa: E402
                                      draw_join_savings, draw_stage_strips, join_savings, join_traffic,
                                      layout_speedups, lora_rule_table, path_choice_table, tile_name)
from moelora_lab.plots.traffic import sweep_workload  # noqa: E402
from moelora_lab.profile.traffic import Traffic  # noqa: E402
from utils import join_rows  # noqa: E402

SHAPE = MoEShape(64, 32, 8, 2, "t")
QWEN = MoEShape.from_name("qwen3-30b-a3b")


def test_join_savings():
    s = join_savings(join_rows(), preset="p", rank=16)
    assert [(r["M"], r["saved_us"]) for r in s] == [(1, 1.0), (16, 0.0), (256, 30.0)]
    assert s[2]["saved"] == pytest.approx(30 / 130)
    assert [r["saved_us"] for r in join_savings(join_rows(), preset="p", rank=16, schedule="dual_stream")] == [
        0.0, -1.0, 29.0]
    with pytest.raises(ValueError, match="schedule: 'auto'"):
        join_savings(join_rows(), preset="p", rank=16, schedule="auto")


def test_join_traffic_by_hand():
    # M=4, k=2: P=8 pairs; 2I=64, H=64, b=2; 3 tokens with an adapter: P_a=6
    fold = join_traffic(SHAPE, 4, "fold", tokens_with_adapter=3)
    assert isinstance(fold, Traffic) and fold.bytes == 6 * 64 * 2 + 6 * 64 * 2 and fold.launches == 0
    vllm = join_traffic(SHAPE, 4, "vllm", tokens_with_adapter=3)
    assert vllm.bytes == 4 * 8 * 64 * 2 + 4 * 8 * 64 * 2 and vllm.launches == 4
    assert vllm.part("zero_d13") == 8 * 64 * 2 and vllm.part("add_reads_c3_d2") == 2 * 8 * 64 * 2
    # every token with an adapter: vLLM's join moves 3 delta-sized buffers more than ours
    d = 8 * (64 + 64) * 2
    assert join_traffic(SHAPE, 4, "vllm").bytes - join_traffic(SHAPE, 4, "fold").bytes == 3 * d
    with pytest.raises(ValueError, match="join: 'add'"):
        join_traffic(SHAPE, 4, "add")
    with pytest.raises(ValueError, match="tokens_with_adapter"):
        join_traffic(SHAPE, 4, "fold", tokens_with_adapter=5)


def test_draw_join_savings():
    ax = Figure().add_subplot()
    draw_join_savings(ax, join_rows(), preset="p", ranks=[16], predicted=[(1, 0.5), (256, 25.0)])
    lines = {line.get_label(): line for line in ax.get_lines()}
    seq = lines["r=16, one stream"]
    assert list(seq.get_xdata()) == [1, 16, 256]
    y = list(seq.get_ydata())
    assert y[0] == 1.0 and math.isnan(y[1]) and y[2] == 30.0          # 0 saved: a gap on the log axis
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "16", "256"]
    assert "predicted: extra bytes / copy rate" in lines
    assert ax.get_yscale() == "log" and "µs" in ax.get_ylabel()
    assert ax.get_legend().get_texts()[0].get_fontsize() >= 9
    ax = Figure().add_subplot()
    draw_join_savings(ax, join_rows(), preset="p", ranks=[16], share=True)
    two = {line.get_label(): line for line in ax.get_lines()}["r=16, two streams"]
    assert list(two.get_xdata()) == [1, 16, 256]                                          # negative kept
    assert list(two.get_ydata()) == pytest.approx([0.0, -100 / 18, 100 * 29 / 128])
    assert ax.get_yscale() == "linear"


def test_draw_base_and_plan():
    data = [dict(preset="p", M=M, rank=16, variant=v, us_median=t, us_p20=t, us_p80=t)
            for M in (1, 16) for v, t in (("no_lora", 10.0 * M), ("grouped_mm", 5.0 * M), ("plan", 100.0))]
    ax = Figure().add_subplot()
    draw_base_and_plan(ax, data, preset="p", rank=16)
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels == ["whole layer, no LoRA", "torch._grouped_mm (w13 + w2, rows pre-grouped)",
                      "routing plan (plan_layer, device kernels)"]                       # base_gemms absent: no line
    assert list(ax.get_lines()[2].get_ydata()) == [100.0, 100.0] and ax.get_xscale() == "log"
    ax = Figure().add_subplot()
    draw_base_and_plan(ax, data, preset="p", rank=16, torch_plan=[(16, 20.0), (1, 10.0)])
    device = ax.get_lines()[-1]
    assert device.get_label() == "routing plan as PyTorch ops (2 block lists)" and list(device.get_xdata()) == [1, 16]


def test_draw_grouped_mm_ratio():
    data = [dict(preset="p", M=M, rank=16, variant=v, us_median=t, us_p20=t, us_p80=t)
            for M, ours, theirs in ((1, 10.0, 15.0), (16, 20.0, 18.0)) for v, t in (("base_gemms", ours),
                                                                                 ("grouped_mm", theirs))]
    ax = Figure().add_subplot()
    assert draw_grouped_mm_ratio(ax, data, preset="p", rank=16) == [(1, 1.5), (16, 0.9)]
    assert ax.get_yscale() == "linear" and [t.get_text() for t in ax.get_xticklabels()] == ["1", "16"]
    assert ax.texts[0].get_text().strip().startswith("below 1")               # under the line, left: no data there


def tune_rows(M=16, rank=16, op="w2"):
    """Rows of a tile walk at the qwen3 shape: the current rule's tiles and two others."""
    P = M * QWEN.top_k
    groups = min(P, sweep_workload(QWEN, M, 4).touched_adapter_experts)
    n_out, slices = (QWEN.hidden, 1) if op == "w2" else (QWEN.intermediate, 2)
    out = []
    for path, us in (("one_shot", (30.0, 24.0, 40.0)), ("two_kernel", (35.0, 33.0, ""))):
        rule = gpu_config(path, P, groups, n_out, slices, 132, rank=rank)
        tiles = [rule, rule.replace(num_warps=8), rule.replace(block_k=32)]
        for i, (cfg, t) in enumerate(zip(tiles, us)):
            out.append(dict(preset=QWEN.name, op=op, path=path, M=M, rank=rank, loras=4,
                            **{f: getattr(cfg, f) for f in TILE_FIELDS}, rule=str(i == 0), us_median=t))
    return out


def test_lora_rule_table():
    t = lora_rule_table(tune_rows())
    assert [(r["path"], r["rule_us"], r["best_us"]) for r in t] == [("one_shot", 30.0, 24.0),
                                                                     ("two_kernel", 35.0, 33.0)]
    assert t[0]["rule_over_best"] == pytest.approx(1.25) and t[0]["rule_in_data"]
    assert t[0]["best"].split()[4] == "w8"
    stale = tune_rows()
    stale[0]["rule"], stale[1]["rule"] = "False", "True"           # the walk started from another rule
    assert not lora_rule_table(stale)[0]["rule_in_data"]
    assert tile_name((16, 128, 64, 2, 4, 3)) == "m16 n128 k64 c2 w4 s3"


def test_path_choice_table():
    t = path_choice_table(tune_rows(rank=128))
    assert len(t) == 1
    r = t[0]
    assert (r["one_shot_us"], r["two_kernel_us"]) == (24.0, 33.0)
    # one rank tile of 128 with 128 pairs: the rule runs two kernels, here the slower path
    assert r["auto"] == choose_path(16 * QWEN.top_k, QWEN.num_experts, 4, 128, QWEN.hidden) == "two_kernel"
    assert r["auto_over_best"] == pytest.approx(33.0 / 24.0)
    [narrow] = path_choice_table(tune_rows(op="w13"))
    assert narrow["auto"] == choose_path(16 * QWEN.top_k, QWEN.num_experts, 4, 16, QWEN.intermediate) == "one_shot"
    assert narrow["auto_over_best"] == 1.0
    assert path_choice_table([x for x in tune_rows() if x["path"] == "one_shot"]) == []


def test_layout_speedups():
    rows_ = [dict(preset="p", op="w2", path="one_shot", rank=16, M=16, b_layout=lay, us_median=t)
             for lay, t in (("r_fastest", 12.0), ("n_fastest", 10.0))]
    assert layout_speedups(rows_)[0]["speedup"] == pytest.approx(1.2)
    with pytest.raises(ValueError, match="b_layout"):
        layout_speedups([dict(rows_[0], b_layout="k_fastest")])


SEQ = [dict(stream="main", name="base_w13", start_us=5.0, end_us=15.0),
       dict(stream="lora", name="lora_w13", start_us=15.0, end_us=19.0),
       dict(stream="main", name="act", start_us=19.0, end_us=20.0)]
FUSED = [dict(stream="main", name="w13+lora", start_us=0.0, end_us=13.0),
         dict(stream="main", name="act", start_us=13.0, end_us=14.0)]


def test_draw_stage_strips():
    ax = Figure().add_subplot()
    draw_stage_strips(ax, [("one stream", SEQ), ("in the GEMMs", FUSED)])
    assert [t.get_text() for t in ax.get_yticklabels()] == ["one stream", "in the GEMMs"]
    assert ax.get_xlim() == (0.0, pytest.approx(1.16 * 15.0))
    texts = [t.get_text() for t in ax.texts]
    assert "15 µs" in texts and "14 µs" in texts and "base_w13" in texts
    assert len(ax.get_legend().get_texts()) == 4                   # each stage named once
    assert min(t.get_fontsize() for t in ax.texts) >= 9
    overlapping = [dict(SEQ[0]), dict(SEQ[1], start_us=10.0)]
    with pytest.raises(ValueError, match="overlap"):
        draw_stage_strips(Figure().add_subplot(), [("two", overlapping)])
    with pytest.raises(ValueError, match="at least one"):
        draw_stage_strips(Figure().add_subplot(), [])
