"""The one-shot kernel built each way (``bench expand``, ``one_shot_build.csv``): per case the time of
every build against the kernel as it was, and which build the rule picks; and the one-shot kernel's N
chunks (``chunk_table``: the probe the chunk rule came from, in ``data/history``).

Shape legend: M tokens, r rank, k top-k, E experts; a case is (op, r, M, B layout) or (preset, op, r, M).
"""
from __future__ import annotations

from matplotlib.patches import Patch

from .. import rules
from ..op.dispatch import one_shot_build_rule
from .design import FINGERPRINT_SMS, sweep_rule_config

FONT = 9
BUILD_STYLE = {     # variant: (colour, label); "before" is the reference every bar divides
    "contiguous": ("#1f77b4", "contiguous rank offsets"),
    "contiguous_unpipelined": ("#aec7e8", "contiguous, expand not pipelined"),
    "prefetch": ("#2ca02c", "contiguous + next output tile prefetched"),
    "prefetch_unpipelined": ("#98df8a", "prefetched, expand not pipelined"),
    "both_slices": ("#d62728", "prefetched, both w13 slices per program"),
}


def rule_variant(rank: int) -> str:
    """The variant of ``bench expand`` that is the build the rule launches at rank ``rank``
    (``dispatch.one_shot_build_rule`` for the rule's rank tile; the sweep's ranks have one tile)."""
    prefetch, stages = one_shot_build_rule(rules.CONFIGS["prefill"].rank_tiling(rank)[0])
    if stages is not None:
        raise ValueError(f"rank: {rank} takes the unpipelined expand, which `bench expand` times only "
                         "under its own name; pass a rank of at most 64")
    return "prefetch" if prefetch else "contiguous"


def build_speedups(rows) -> list[dict]:
    """One dict per case of ``one_shot_build.csv``: op, rank, M, b_layout, ``before_us``, the
    speed-up of every other build over "before" (keyed by variant), the rule's variant (``rule``) and
    its time over the best build's (``rule_over_best``)."""
    cases: dict = {}
    for r in rows:
        cases.setdefault((r["op"], r["rank"], r["M"], r["b_layout"]), {})[r["variant"]] = r["us_median"]
    out = []
    for (op, rank, M, layout), t in sorted(cases.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][3] != "r_fastest",
                                                                            kv[0][2])):
        if "before" not in t:
            raise ValueError(f"rows: {op} r={rank} M={M} {layout} has no 'before' row to compare with")
        rule = rule_variant(rank)
        out.append(dict(op=op, rank=rank, M=M, b_layout=layout, before_us=t["before"], rule=rule,
                        rule_over_best=t[rule] / min(t.values()),
                        **{v: t["before"] / us for v, us in t.items() if v != "before"}))
    return out


def draw_build_speedups(ax, rows, *, ops=None, font: int = FONT, rule_legend: bool = False,
                        legend: bool = True) -> list[dict]:
    """Grouped bars: per case, every build's speed-up over the kernel as it was (1 = no change); the
    rule's build is outlined. ``ops``: the ops to draw (default: all); ``font``: the size of every text
    (points); ``rule_legend``: a legend entry for the outline too; ``legend``: the legend under the Axes.
    Returns the cases drawn (``build_speedups``)."""
    cases = [c for c in build_speedups(rows) if ops is None or c["op"] in ops]
    names = [v for v in BUILD_STYLE if any(v in c for c in cases)]
    width = 0.8 / len(names)
    for i, v in enumerate(names):
        colour, label = BUILD_STYLE[v]
        for x, c in enumerate(cases):
            if v in c:
                ax.bar(x - 0.4 + (i + 0.5) * width, c[v], width, color=colour,
                       edgecolor="black" if c["rule"] == v else "none", linewidth=1.2)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cases)))
    small = font - 1 if font == FONT else font
    ax.set_xticklabels([f"{c['op']}\nr{c['rank']}\n{c['M']}" + ("\npacked" if c["b_layout"] == "n_fastest" else "")
                        for c in cases], fontsize=small)
    ax.set_xlabel("op, rank, M (B as given unless packed)", fontsize=font)
    ax.set_ylabel("speed-up over the kernel as it was", fontsize=font)
    ax.set_ylim(min(0.7, min(c[v] for c in cases for v in names if v in c) - 0.05), None)
    ax.tick_params(labelsize=font)
    if legend:
        handles = [Patch(color=BUILD_STYLE[v][0], label=BUILD_STYLE[v][1]) for v in names]
        if rule_legend:
            handles.append(Patch(facecolor="white", edgecolor="black", linewidth=1.2,
                                 label="outlined: the build the rule launches"))
        ax.legend(handles=handles, fontsize=font, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3,
                  frameon=False)
    ax.set_title("One-shot builds (outlined: the one the rule launches)", fontsize=font + 1)
    return cases


def chunk_table(rows, *, sms: int = FINGERPRINT_SMS) -> list[dict]:
    """One dict per case of a chunk probe (``bench kernels`` rows of one-shot at several (n_chunks,
    block_n), the first one-shot row of a case being the rule's tiles when it ran, and one two-kernel
    row): preset, op, rank, M, pairs, ``before`` (n_chunks, block_n) and ``before_us``; ``now``, what
    ``dispatch.gpu_config`` gives the same routing today on ``sms`` SMs, and ``now_us`` (None where the
    probe did not time it); ``best_us``, the fastest one-shot row; ``two_kernel_us``."""
    from ..config import MoEShape

    cases: dict = {}
    for r in rows:
        cases.setdefault((r["preset"], r["op"], r["rank"], r["M"]), []).append(r)
    out = []
    for (preset, op, rank, M), rs in sorted(cases.items()):
        one = [r for r in rs if r["path"] == "one_shot"]
        two = [r["us_median"] for r in rs if r["path"] == "two_kernel"]
        if not one or len(two) != 1:
            raise ValueError(f"rows: {preset} {op} r={rank} M={M} needs one-shot rows and one two_kernel row")
        cfg = sweep_rule_config("one_shot", preset, op, rank, M, one[0]["loras"], sms=sms)
        timed = {(r["n_chunks"], r["block_n"]): r["us_median"] for r in reversed(one)}    # the first row wins
        now = (cfg.n_chunks, cfg.block_n)
        out.append(dict(preset=preset, op=op, rank=rank, M=M, pairs=M * MoEShape.from_name(preset).top_k,
                        before=(one[0]["n_chunks"], one[0]["block_n"]), before_us=one[0]["us_median"],
                        now=now, now_us=timed.get(now),
                        best_us=min(timed.values()), two_kernel_us=two[0]))
    return out


def draw_chunk_table(ax, rows, *, font: int = FONT, legend_font: int | None = None) -> list[dict]:
    """Per case of a chunk probe, the time of today's chunks (filled; hollow where the probe did not
    time them: the best it timed) and of the two-kernel path (crosses), over the time of the chunks
    before (1 = no change), against the pairs; ``font``: the size of the labels (points), ``legend_font``: of
    the legend (default one point less). Returns ``chunk_table(rows)``."""
    table = chunk_table(rows)
    colours = {64: "#1f77b4", 128: "#d62728"}
    for c in table:
        colour = colours.get(c["rank"], "gray")
        timed = c["now_us"] is not None
        ax.scatter(c["pairs"], (c["now_us"] if timed else c["best_us"]) / c["before_us"], s=28,
                   facecolor=colour if timed else "none", edgecolor=colour, zorder=3)
        ax.scatter(c["pairs"], c["two_kernel_us"] / c["before_us"], marker="x", s=22, color=colour, alpha=0.7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("pairs (M · k)", fontsize=font)
    ax.set_ylabel("time / the chunks before", fontsize=font)
    ax.tick_params(labelsize=font)
    handles = [ax.scatter([], [], color=colours[r], s=28, label=f"r = {r}: one-shot, chunks now") for r in colours]
    handles.append(ax.scatter([], [], facecolor="none", edgecolor="gray", s=28,
                              label="hollow: chunks now not timed, best timed (rank's colour)"))
    handles.append(ax.scatter([], [], marker="x", color="gray", s=22, label="two kernels (rank's colour)"))
    ax.legend(handles=handles, fontsize=font - 1 if legend_font is None else legend_font, loc="upper left")
    ax.set_title("One-shot N chunks: fewer programs, each re-reading A once", fontsize=font + 1)
    return table
