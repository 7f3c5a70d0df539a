"""Adapter layout pictures: the indices they draw against PEFT's layout as load_peft reads it, and the
artists draw_fused_layout makes."""
import matplotlib

matplotlib.use("Agg")

import pytest
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

import moelora_lab  # noqa: F401  (first: it decides whether Triton kernels run on the interpreter)
from moelora_lab.adapters import load_peft
from moelora_lab.plots.adapters import draw_fused_layout, fused_index
from moelora_lab.plots.routing import expert_colors

PREFIX = "model.layers.0.mlp.experts"


def axes():
    return Figure().add_subplot()


def test_fused_index_hand_counted():
    # E = 4, r = 3: lora_A rows e*r + i, lora_B columns i*E + e
    assert [fused_index("A", 1, i, 4, 3) for i in range(3)] == [3, 4, 5]
    assert [fused_index("B", 1, i, 4, 3) for i in range(3)] == [1, 5, 9]
    assert fused_index("A", 3, 2, 4, 3) == fused_index("B", 3, 2, 4, 3) == 11
    assert fused_index("A", 0, 0, 1, 1) == fused_index("B", 0, 0, 1, 1) == 0


@pytest.mark.parametrize("E,r", [(4, 3), (3, 5), (6, 1)])
def test_fused_index_is_where_load_peft_reads(E, r):
    """Number every row of lora_A and every column of lora_B; load_peft must put index fused_index(e, i)
    at the lab's A[0, e, i] and B[0, e, :, i]."""
    H, I = 2, 1
    rows = torch.arange(E * r, dtype=torch.float32)
    tensors = {f"{PREFIX}.base_layer.lora_A.weight": rows[:, None].expand(E * r, H).clone(),
               f"{PREFIX}.base_layer.lora_B.weight": rows[None, :].expand(2 * I, E * r).clone(),
               f"{PREFIX}.lora_A.weight": rows[:, None].expand(E * r, I).clone(),
               f"{PREFIX}.lora_B.weight": rows[None, :].expand(H, E * r).clone()}
    config = dict(peft_type="LORA", r=r, lora_alpha=r, target_modules=[],
                  target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    w = load_peft((tensors, config), pack=False)[PREFIX]
    for e in range(E):
        for i in range(r):
            assert w["w2_lora_a"][0][0, e, i, 0] == w["w13_lora_a"][1][0, e, i, 0] == fused_index("A", e, i, E, r)
            assert w["w2_lora_b"][0][0, e, 0, i] == w["w13_lora_b"][0][0, e, 0, i] == fused_index("B", e, i, E, r)


def test_fused_index_rejects_bad_arguments():
    with pytest.raises(ValueError, match="which"):
        fused_index("C", 0, 0, 2, 2)
    with pytest.raises(ValueError, match="expert"):
        fused_index("A", 2, 0, 2, 2)
    with pytest.raises(ValueError, match="rank_index"):
        fused_index("B", 0, 3, 2, 3)
    with pytest.raises(TypeError, match="num_experts"):
        fused_index("A", 0, 0, 2.0, 2)


def _cells(ax):
    """(x, y) -> label of every numbered cell."""
    return {(round(t.get_position()[0], 3), round(t.get_position()[1], 3)): t.get_text() for t in ax.texts
            if t.get_text()[:1].isdigit()}


@pytest.mark.parametrize("which", ["A", "B"])
def test_draw_fused_layout_numbers_both_rows(which):
    E, r = 4, 3
    ax = axes()
    draw_fused_layout(ax, which, E, r, expert=1)
    assert sum(isinstance(p, Rectangle) for p in ax.patches) == 2 * E * r
    cells = _cells(ax)
    assert len(cells) == 2 * E * r
    for e in range(E):
        for i in range(r):
            c = fused_index(which, e, i, E, r)
            assert cells[(c + 0.5, 2.6)] == f"{c}\n({e},{i})"               # PEFT's row / column c
            assert cells[(e * r + i + 0.5, 0.4)] == f"{c}\n({e},{i})"       # the lab's (e, i)
    colour = matplotlib.colors.to_rgba(expert_colors(E)[1])
    lit = [line for line in ax.lines if line.get_linewidth() == 2.0]
    assert len(lit) == r and all(matplotlib.colors.to_rgba(line.get_color()) == colour for line in lit)
    straight = all(line.get_xdata()[0] == line.get_xdata()[1] for line in lit)
    assert straight == (which == "A")                   # A: a reshape; B: a permutation
    assert "expert 1 in colour" in ax.get_title()


def test_draw_fused_layout_without_highlight_and_large():
    ax = axes()
    draw_fused_layout(ax, "B", 8, 8, expert=None)
    assert not [line for line in ax.lines if line.get_linewidth() == 2.0]
    assert all("\n" not in text for text in _cells(ax).values())   # 64 cells: only the index fits


def test_draw_fused_layout_rejects_bad_arguments():
    with pytest.raises(TypeError, match="Axes"):
        draw_fused_layout(None, "A", 2, 2)
    with pytest.raises(ValueError, match="which"):
        draw_fused_layout(axes(), "W", 2, 2)
    with pytest.raises(ValueError, match="do not fit"):
        draw_fused_layout(axes(), "A", 16, 8)
    with pytest.raises(ValueError, match="expert"):
        draw_fused_layout(axes(), "A", 2, 2, expert=2)
