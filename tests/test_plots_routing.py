"""Routing pictures: the data functions against hand counts, the artists each draw function makes."""
import matplotlib

matplotlib.use("Agg")

import pytest
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch

import moelora_lab as ml
from moelora_lab.plots import (
    assignment_costs,
    draw_assignment_cost,
    draw_block_layout,
    draw_padding_waste,
    draw_topk_heatmap,
    expert_colors,
    find_crossover,
    padding_by_block_size,
    padding_stats,
)
from moelora_lab.routing import padded_row_length

# M=3 tokens, k=2, E=3 experts, L=2 adapters; pairs p = t*k + j:
#   adapter 0: p0 -> e0, p1 p2 -> e1, p3 -> e2      adapter 1: p4 -> e0, p5 -> e1
TOPK_IDS = torch.tensor([[0, 1], [1, 2], [0, 1]], dtype=torch.int32)
TOKEN_LORA = torch.tensor([0, 0, 1], dtype=torch.int32)
E, L, NUM_PAIRS = 3, 2, 6


def axes():
    return Figure().add_subplot()


def hand_alignment(block_size=2):
    return ml.align_block_size(TOPK_IDS, TOKEN_LORA, E, L, block_size)


def test_hand_alignment_is_what_the_stats_count():
    a = hand_alignment()
    assert a.sorted_token_ids[0, :6].tolist() == [0, 6, 1, 2, 3, 6]
    assert a.sorted_token_ids[1, :4].tolist() == [4, 6, 5, 6]
    assert a.num_tokens_post_padded.tolist() == [6, 4]


def test_padding_stats_hand_counted():
    st = padding_stats(hand_alignment(), NUM_PAIRS)
    assert (st["block_size"], st["num_pairs"]) == (2, 6)
    assert (st["valid_slots"], st["padded_slots"], st["padding_slots"], st["blocks"]) == (6, 10, 4, 5)
    assert st["waste"] == pytest.approx(0.4)
    row0, row1 = st["per_adapter"]
    assert (row0["adapter"], row0["valid_slots"], row0["padded_slots"], row0["blocks"]) == (0, 4, 6, 3)
    assert (row1["adapter"], row1["valid_slots"], row1["padded_slots"], row1["blocks"]) == (1, 2, 4, 2)
    assert row1["waste"] == pytest.approx(0.5)


def test_padding_stats_unused_adapter_row_has_no_waste():
    a = ml.align_block_size(TOPK_IDS, torch.tensor([0, 0, 0], dtype=torch.int32), E, 3, 4)
    rows = padding_stats(a, NUM_PAIRS)["per_adapter"]
    assert [r["padded_slots"] for r in rows] == [12, 0, 0]
    assert [r["waste"] for r in rows] == [pytest.approx(0.5), 0.0, 0.0]


def test_padding_by_block_size_hand_counted():
    rows = padding_by_block_size(TOPK_IDS, TOKEN_LORA, E, L, [1, 2, 4])
    assert [r["block_size"] for r in rows] == [1, 2, 4]
    assert [r["padded_slots"] for r in rows] == [6, 10, 20]
    assert [r["blocks"] for r in rows] == [6, 5, 5]
    assert [r["waste"] for r in rows] == [0.0, pytest.approx(0.4), pytest.approx(0.7)]


@pytest.mark.parametrize("bad, err, msg", [
    ((None, None, None), TypeError, "alignment: expected a moelora_lab.Alignment"),
    ("num_pairs=4", ValueError, "out of range"),
    ("num_pairs=7", ValueError, "num_pairs: 7 is not the padding sentinel"),
    ("num_pairs=-1", ValueError, "num_pairs: must be >= 0"),
])
def test_padding_stats_rejects(bad, err, msg):
    a, n = hand_alignment(), NUM_PAIRS
    if isinstance(bad, tuple):
        a = tuple(a)
    else:
        n = int(bad.split("=")[1])
    with pytest.raises(err, match=msg):
        padding_stats(a, n)


def cost_rows(naive, sorted_):
    return [dict(num_tokens=2 ** i, naive_loads=a, sorted_loads=b) for i, (a, b) in enumerate(zip(naive, sorted_))]


@pytest.mark.parametrize("naive, sorted_, expected", [
    ([8, 16, 32, 64, 128], [8, 15, 32, 50, 60], 8),       # a win at M=2, lost again at M=4: not yet
    ([8, 16, 32], [8, 16, 32], None),                     # never fewer
    ([8, 16, 32], [7, 9, 10], 1),                         # fewer from the first M
    ([8, 16, 32], [8, 15, 33], None),                     # fewer, then more at the last M
])
def test_find_crossover_on_constructed_tables(naive, sorted_, expected):
    assert find_crossover(cost_rows(naive, sorted_)) == expected


def test_find_crossover_rejects():
    with pytest.raises(TypeError, match="rows: expected a non-empty list"):
        find_crossover([])
    with pytest.raises(ValueError, match=r"rows\[1\]: expected a dict with keys"):
        find_crossover([dict(num_tokens=1, naive_loads=1, sorted_loads=1), dict(num_tokens=2)])
    rows = cost_rows([1, 2], [1, 2])[::-1]
    with pytest.raises(ValueError, match="strictly increasing"):
        find_crossover(rows)


def test_assignment_costs_identical_adapter_counted_by_hand():
    ms = [1, 3, 16, 64]
    costs = assignment_costs("tiny", 4, 4, ms, seed=3, popularity="identical")
    assert (costs["num_experts"], costs["top_k"], costs["num_loras"], costs["block_size"]) == (8, 2, 4, 4)
    assert costs["vllm_threshold"] == 2                       # 2*k*8 = 32 <= E*L = 32 < 3*k*8
    for m, row in zip(ms, costs["rows"]):
        prob = ml.make_problem("tiny", ml.LoRAShape(4, 8), m, seed=3, adapter_popularity="identical",
                               with_base=False)
        per_expert = torch.bincount(prob.topk_ids.reshape(-1).long(), minlength=8).tolist()
        blocks = sum(-(-n // 4) for n in per_expert)          # every pair belongs to adapter 0
        assert row["num_tokens"] == m and row["pairs"] == row["naive_loads"] == row["naive_programs"] == 2 * m
        assert row["sorted_loads"] == row["sorted_programs"] == blocks
        assert row["distinct_weights"] == sum(n > 0 for n in per_expert)
        assert row["padded_slots"] == 4 * blocks
        assert row["padding_waste"] == pytest.approx(1 - 2 * m / (4 * blocks))
        assert row["sorted_grid"] == 4 * padded_row_length(2 * m, 8, 4) // 4
        assert row["vllm_naive"] == (2 * m * 8 <= 8 * 4)
    assert costs["rows"][0]["sorted_loads"] == 2                # one token: two experts, one pair each
    assert costs["crossover"] == find_crossover(costs["rows"])


def test_assignment_costs_invariants_and_crossover():
    costs = assignment_costs(ml.PRESETS["tiny"], 4, 16, [1, 2, 4, 8, 32, 128], seed=0, popularity="zipf:1.2")
    for row in costs["rows"]:
        assert row["distinct_weights"] <= row["sorted_loads"] <= row["naive_loads"]
    big = costs["rows"][-1]                                   # 256 pairs over 32 weights: sorting wins
    assert big["sorted_loads"] < big["naive_loads"]
    assert costs["crossover"] is not None and costs["crossover"] <= 128


@pytest.mark.parametrize("kwargs, err, msg", [
    (dict(token_counts=[4, 2]), ValueError, "token_counts: must be strictly increasing"),
    (dict(token_counts=[]), TypeError, "token_counts: expected a non-empty list"),
    (dict(token_counts=[0]), ValueError, r"token_counts\[i\]: must be >= 1"),
    (dict(num_loras=0), ValueError, "num_loras: must be >= 1"),
    (dict(block_size=2.0), TypeError, "block_size: expected an int"),
    (dict(popularity="zipf"), ValueError, "adapter_popularity"),
    (dict(shape="qwen"), ValueError, "preset 'qwen' is unknown"),
    (dict(shape=3), TypeError, "shape: expected a MoEShape"),
])
def test_assignment_costs_rejects(kwargs, err, msg):
    args = dict(shape="tiny", num_loras=2, block_size=4, token_counts=[1, 2]) | kwargs
    with pytest.raises(err, match=msg):
        assignment_costs(**args)


def test_draw_topk_heatmap_cells_and_labels():
    ax = axes()
    weights = torch.tensor([[0.75, 0.25], [0.5, 0.5], [0.9, 0.1]])
    draw_topk_heatmap(ax, TOPK_IDS, weights, E, token_lora=TOKEN_LORA)
    grid = ax.get_images()[0].get_array()
    expected = torch.tensor([[0.75, 0.25, 0.0], [0.0, 0.5, 0.5], [0.9, 0.1, 0.0]])
    assert torch.allclose(torch.as_tensor(grid.data, dtype=torch.float32), expected)
    assert sorted(t.get_text() for t in ax.texts) == sorted(["0.75", "0.25", "0.50", "0.50", "0.90", "0.10"])
    assert [t.get_text() for t in ax.get_yticklabels()] == ["t0 · adapter 0", "t1 · adapter 0", "t2 · adapter 1"]
    assert "top-2" in ax.get_title() and ax.get_xlabel() == "expert e"
    assert len(ax.figure.axes) == 2                           # the colour bar


def test_draw_topk_heatmap_rejects():
    with pytest.raises(TypeError, match="ax: expected a matplotlib Axes"):
        draw_topk_heatmap(None, TOPK_IDS, torch.ones(3, 2), E)
    with pytest.raises(ValueError, match=r"topk_ids: value 2 is out of range; accepted values are 0 \.\. 1"):
        draw_topk_heatmap(axes(), TOPK_IDS, torch.ones(3, 2), 2)
    with pytest.raises(ValueError, match=r"topk_weights: expected shape \(3, 2\)"):
        draw_topk_heatmap(axes(), TOPK_IDS, torch.ones(3, 3), E)
    with pytest.raises(ValueError, match=r"token_lora: expected shape \(3,\)"):
        draw_topk_heatmap(axes(), TOPK_IDS, torch.ones(3, 2), E, token_lora=torch.zeros(2, dtype=torch.int32))


def test_draw_block_layout_artists():
    ax = axes()
    draw_block_layout(ax, hand_alignment(), NUM_PAIRS, num_tokens=3, top_k=2, num_experts=E)
    # row 0: e0 | pad | e1 e1 | e2 | pad ; row 1: e0 | pad | e1 | pad  -> 9 runs
    assert len(ax.patches) == 9
    hatched = [p for p in ax.patches if p.get_hatch()]
    assert sorted(p.get_width() for p in hatched) == [1, 1, 1, 1]
    assert sum(p.get_width() for p in ax.patches) == 10       # = sum(num_tokens_post_padded)
    colours = expert_colors(E)
    solid = sorted((p.get_x(), p.get_y() + p.get_height() / 2, p.get_width(), tuple(p.get_facecolor()[:3]))
                   for p in ax.patches if not p.get_hatch())
    assert solid == sorted([(0, 0, 1, colours[0]), (2, 0, 2, colours[1]), (4, 0, 1, colours[2]),
                            (0, 1, 1, colours[0]), (2, 1, 1, colours[1])])
    labels = {t.get_text() for t in ax.texts}
    assert {"0\n(0,0)", "3\n(1,1)", "5\n(2,1)", "6", "4"} <= labels   # p and (t, j), and the row ends
    assert len(labels & {f"{p}\n({p // 2},{p % 2})" for p in range(6)}) == 6
    assert "40.0% waste" in ax.get_title() and "5 blocks" in ax.get_title()
    assert [t.get_text() for t in ax.get_yticklabels()] == ["adapter 0", "adapter 1"]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["expert 0", "expert 1", "expert 2", "padding (sentinel M*k)", "block boundary",
                      "num_tokens_post_padded"]


def test_draw_block_layout_block_boundaries_and_marks():
    ax = axes()
    draw_block_layout(ax, hand_alignment(), NUM_PAIRS, annotate=False)
    segs = [seg for c in ax.collections for seg in c.get_segments()]
    xs = sorted(round(float(s[0][0]), 3) for s in segs)
    assert xs == sorted([0, 2, 4, 6, 0, 2, 4] + [6, 4])        # 7 block edges + 2 red row ends
    assert not any(t.get_text() in ("0", "1") for t in ax.texts)   # no pair labels


def test_draw_block_layout_rejects():
    with pytest.raises(ValueError, match="num_tokens and top_k: give both"):
        draw_block_layout(axes(), hand_alignment(), NUM_PAIRS, num_tokens=3)
    with pytest.raises(ValueError, match=r"num_tokens \* top_k: 3 \* 3 = 9 but num_pairs is 6"):
        draw_block_layout(axes(), hand_alignment(), NUM_PAIRS, num_tokens=3, top_k=3)
    with pytest.raises(ValueError, match="num_pairs: 8 is not the padding sentinel"):
        draw_block_layout(axes(), hand_alignment(), 8)
    with pytest.raises(ValueError, match="num_experts: 2 but alignment.expert_ids holds expert 2"):
        draw_block_layout(axes(), hand_alignment(), NUM_PAIRS, num_experts=2)
    with pytest.raises(TypeError, match="ax: expected a matplotlib Axes"):
        draw_block_layout("ax", hand_alignment(), NUM_PAIRS)


def test_draw_padding_waste_line():
    ax = axes()
    draw_padding_waste(ax, padding_by_block_size(TOPK_IDS, TOKEN_LORA, E, L, [1, 2, 4]), label="hand")
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [1, 2, 4]
    assert list(line.get_ydata()) == pytest.approx([0.0, 40.0, 70.0])
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["hand"]
    with pytest.raises(ValueError, match="rows: every row needs 'block_size' and 'waste'"):
        draw_padding_waste(axes(), [dict(block_size=1)])


def cost_table(with_extras=True):
    naive, sorted_ = [8, 16, 32, 64, 128], [8, 15, 32, 50, 60]
    rows = cost_rows(naive, sorted_)
    if with_extras:
        for row in rows:
            row.update(sorted_grid=4 * row["sorted_loads"], distinct_weights=row["sorted_loads"] - 1)
    return dict(shape="made-up", num_experts=16, top_k=4, num_loras=4, block_size=16, popularity="uniform",
                rows=rows)


def legend_labels(ax):
    return [t.get_text() for t in ax.get_legend().get_texts()]


def by_gid(ax, gid):
    return [a for a in [*ax.get_lines(), *ax.texts] if a.get_gid() == gid]


def test_draw_assignment_cost_lines_and_marks():
    ax = axes()
    draw_assignment_cost(ax, cost_table())
    labels = legend_labels(ax)                                # the four series, nothing else
    assert [lb.split(":")[0] for lb in labels] == ["floor", "naive", "sorted", "sorted"]
    lines = {line.get_label(): line for line in ax.get_lines()}
    naive = next(v for k, v in lines.items() if k.startswith("naive"))
    sorted_ = next(v for k, v in lines.items() if k.startswith("sorted: one program per block"))
    assert list(naive.get_ydata()) == [8, 16, 32, 64, 128]
    assert list(sorted_.get_ydata()) == [8, 15, 32, 50, 60]
    # where they coincide both stay visible: different markers, the sorted one hollow and larger
    assert naive.get_marker() != sorted_.get_marker() and sorted_.get_markerfacecolor() == "none"
    assert sorted_.get_markersize() > naive.get_markersize()
    (vllm,) = by_gid(ax, "vllm-threshold")
    assert vllm.get_xdata()[0] == 2                           # M*4*8 <= 16*4 up to M = 2
    (note,) = by_gid(ax, "vllm-note")
    assert "M ≤ 2" in note.get_text()
    spans = [p for p in ax.patches if p.get_alpha() is not None and p.get_alpha() < 0.2]
    assert len(spans) == 1                                    # shaded, annotated in place, not in the legend
    assert not any(isinstance(h, Patch) and h.get_facecolor() == spans[0].get_facecolor()
                   for h in ax.get_legend().legend_handles)
    (ring,) = by_gid(ax, "crossover")
    assert (ring.get_xdata()[0], ring.get_ydata()[0]) == (8, 50)
    (cross,) = by_gid(ax, "crossover-note")
    assert "M = 8" in cross.get_text() and "vLLM" not in cross.get_text()
    assert "made-up" in ax.get_title() and "E = 16" in ax.get_title()
    assert ax.get_xscale() == "log" and ax.get_xlabel() == "tokens M"
    assert ax.get_xlim()[0] < 1 and ax.get_xlim()[1] > 16     # cropped to the data, with a margin


def test_draw_assignment_cost_notes_a_crossover_on_the_threshold():
    costs = cost_table() | dict(num_experts=64)               # naive iff M*4*8 <= 64*4: up to M = 8
    ax = axes()
    draw_assignment_cost(ax, costs)
    (cross,) = by_gid(ax, "crossover-note")
    assert "M = 8" in cross.get_text() and "vLLM's last naive M" in cross.get_text()
    assert by_gid(ax, "vllm-threshold")[0].get_xdata()[0] == 8


def test_draw_assignment_cost_minimal_rows_and_no_crossover():
    costs = cost_table(with_extras=False)
    for row in costs["rows"]:
        row["sorted_loads"] = row["naive_loads"]
    ax = axes()
    draw_assignment_cost(ax, costs, legend=False)
    assert ax.get_legend() is None
    labels = [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]
    assert [lb.split(":")[0] for lb in labels] == ["naive", "sorted"]
    assert not by_gid(ax, "crossover") and not by_gid(ax, "crossover-note")


@pytest.mark.parametrize("num_loras, last", [(3, 1), (12, 6)])
def test_draw_assignment_cost_vllm_line_follows_the_rule(num_loras, last):
    costs = cost_table() | dict(num_experts=8, top_k=2, num_loras=num_loras)   # naive iff M*2*8 <= 8*L
    ax = axes()
    draw_assignment_cost(ax, costs)
    assert by_gid(ax, "vllm-threshold")[0].get_xdata()[0] == last
    assert f"M ≤ {last}" in by_gid(ax, "vllm-note")[0].get_text()


def test_draw_assignment_cost_rule_never_naive():
    costs = cost_table() | dict(num_experts=8, top_k=2, num_loras=1)          # 1*2*8 > 8*1: never naive
    ax = axes()
    draw_assignment_cost(ax, costs)
    assert not by_gid(ax, "vllm-threshold")
    assert "sorted at every M shown" in by_gid(ax, "vllm-note")[0].get_text()


def test_text_is_at_least_9_points():
    fig = Figure(figsize=(9.5, 4))
    a, b, c, d = fig.subplots(1, 4)
    draw_topk_heatmap(a, TOPK_IDS, torch.tensor([[0.75, 0.25], [0.5, 0.5], [0.9, 0.1]]), E, token_lora=TOKEN_LORA)
    draw_block_layout(b, hand_alignment(), NUM_PAIRS, num_tokens=3, top_k=2, annotate=True)
    draw_padding_waste(c, padding_by_block_size(TOPK_IDS, TOKEN_LORA, E, L, [1, 2, 4]), label="hand")
    draw_assignment_cost(d, cost_table())
    for ax in (a, b, c, d):
        texts = [*ax.texts, *ax.get_legend().get_texts()] if ax.get_legend() else list(ax.texts)
        assert texts and min(t.get_fontsize() for t in texts) >= 9


def test_draw_block_layout_drops_slot_labels_that_do_not_fit():
    wide = Figure(figsize=(9.5, 2.6)).add_subplot()
    draw_block_layout(wide, hand_alignment(), NUM_PAIRS, num_tokens=3, top_k=2)
    assert "0\n(0,0)" in {t.get_text() for t in wide.texts}
    narrow = Figure(figsize=(4.2, 2.6)).add_subplot()       # 7 slots in about an inch: no room for (t, j)
    draw_block_layout(narrow, hand_alignment(), NUM_PAIRS, num_tokens=3, top_k=2)
    labels = {t.get_text() for t in narrow.texts}
    assert not any("(" in lb for lb in labels)


def test_draw_assignment_cost_rejects():
    with pytest.raises(TypeError, match="costs: expected the dict returned by assignment_costs"):
        draw_assignment_cost(axes(), [1, 2])
    with pytest.raises(TypeError, match="legend: expected True or False"):
        draw_assignment_cost(axes(), cost_table(), legend="below")
    costs = cost_table()
    del costs["top_k"]
    with pytest.raises(ValueError, match="costs: missing 'top_k'"):
        draw_assignment_cost(axes(), costs)


def test_expert_colors():
    for n in (1, 8, 9, 10, 18, 19, 128):
        colours = expert_colors(n)
        assert len(set(colours)) == n
        assert not any(c[0] == c[1] == c[2] for c in colours)   # no grey: grey is padding
    with pytest.raises(ValueError, match="num_experts: must be >= 1"):
        expert_colors(0)


def test_draw_block_layout_without_any_adapter_pair():
    a = ml.align_block_size(TOPK_IDS, torch.full((3,), -1, dtype=torch.int32), E, L, 4)
    ax = axes()
    draw_block_layout(ax, a, NUM_PAIRS)
    assert len(ax.patches) == 0
    assert [t.get_text() for t in ax.texts].count("no pairs") == L
    assert "0.0% waste" in ax.get_title() and "0 blocks" in ax.get_title()
