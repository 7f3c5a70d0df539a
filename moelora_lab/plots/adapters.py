"""Adapter layout pictures: where PEFT keeps each (expert, rank) of a fused-3D MoE LoRA, and where the
lab keeps it.

Shape legend: E experts, r rank, K in, N out; L adapters (slots).

PEFT (``target_parameters`` on ``experts.gate_up_proj`` / ``experts.down_proj``): ``lora_A`` [E*r, K]
holds rank i of expert e in row e*r + i (expert-major); ``lora_B`` [N, r*E] holds it in column
i*E + e (rank-major). The lab: ``A[l, e, i, :]`` of [L, E, r, K] and ``B[l, e, :, i]`` of
[L, E, N, r]. ``draw_*(ax, ...)`` draw on a matplotlib Axes and return None.
"""
from __future__ import annotations

from matplotlib.patches import Rectangle

from ..validate import check_choice, check_int
from .routing import LABEL_PT, _check_ax, expert_colors

WHICH = {
    "A": dict(peft="PEFT lora_A [E·r, K]: row e·r + i", ours="ours A[l, e, i, :]  of [L, E, r, K]",
              order="expert-major: each expert's rows are one run; ours is the same memory, reshaped"),
    "B": dict(peft="PEFT lora_B [N, r·E]: column i·E + e", ours="ours B[l, e, :, i]  of [L, E, N, r]",
              order="rank-major: an expert's columns are E apart; ours gathers them"),
}


def fused_index(which: str, expert: int, rank_index: int, num_experts: int, rank: int) -> int:
    """The row (``which="A"``) or column (``"B"``) of a fused-3D PEFT LoRA holding rank ``rank_index``
    of expert ``expert``: e*r + i for lora_A [E*r, K], i*E + e for lora_B [N, r*E]."""
    check_choice("which", which, WHICH)
    E, r = check_int("num_experts", num_experts, low=1), check_int("rank", rank, low=1)
    e = check_int("expert", expert, low=0, high=E - 1)
    i = check_int("rank_index", rank_index, low=0, high=r - 1)
    return e * r + i if which == "A" else i * E + e


def draw_fused_layout(ax, which: str, num_experts: int, rank: int, *, expert: int | None = 0) -> None:
    """Top: PEFT's E*r rows of lora_A (``which="A"``) or columns of lora_B (``"B"``), numbered and
    coloured by expert. Bottom: the lab's layout, expert by expert, rank i inside each; every cell names
    the PEFT row/column it comes from, and a line joins the two places. Cells show (e, i) too while
    E*r <= 24. ``expert``: the expert whose
    lines are drawn in its colour (the others in grey); None draws every line grey."""
    _check_ax(ax)
    check_choice("which", which, WHICH)
    E, r = check_int("num_experts", num_experts, low=1, high=16), check_int("rank", rank, low=1, high=16)
    if E * r > 64:
        raise ValueError(f"num_experts * rank: {E} * {r} = {E * r} cells do not fit one row; keep it at most 64")
    if expert is not None:
        check_int("expert", expert, low=0, high=E - 1)
    colors = expert_colors(E)
    top, bottom, h = 2.2, 0.0, 0.8
    both = E * r <= 24                                          # room for "(e, i)" under each index
    for e in range(E):
        for i in range(r):
            c = fused_index(which, e, i, E, r)                  # PEFT's row / column
            ours = e * r + i                                    # position in the lab's [E, r]
            lit = expert is None or e == expert
            for x, y in ((c, top), (ours, bottom)):
                ax.add_patch(Rectangle((x, y), 1, h, facecolor=colors[e], alpha=1.0 if lit else 0.35,
                                       edgecolor="white", linewidth=1))
                ax.text(x + 0.5, y + h / 2, f"{c}\n({e},{i})" if both else str(c), ha="center", va="center",
                        fontsize=LABEL_PT, color="white" if lit else "black", linespacing=1.3)
            ax.plot([c + 0.5, ours + 0.5], [top, bottom + h], color=colors[e] if expert == e else "#b0b0b0",
                    linewidth=2.0 if expert == e else 0.8, zorder=3 if expert == e else 1)
        ax.text(e * r + r / 2, bottom - 0.15, f"expert {e}", ha="center", va="top", fontsize=LABEL_PT)
        ax.plot([e * r + 0.05, (e + 1) * r - 0.05], [bottom - 0.08] * 2, color="black", linewidth=1.2)
    ax.text(0, top + h + 0.12, WHICH[which]["peft"] + ("   (cell: index, (e, i))" if both else ""),
            fontsize=LABEL_PT + 1, va="bottom")
    ax.text(0, bottom - 0.75, WHICH[which]["ours"] + "   (cell: the PEFT index it holds)", fontsize=LABEL_PT + 1,
            va="top")
    ax.set_xlim(-0.3, E * r + 0.3)
    ax.set_ylim(bottom - 1.3, top + h + 0.6)
    ax.set_axis_off()
    lit = "" if expert is None else f"; expert {expert} in colour"
    ax.set_title(f"E = {E}, r = {r}: {WHICH[which]['order']}{lit}", fontsize=LABEL_PT + 1)
