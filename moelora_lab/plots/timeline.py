"""Layer timelines: one lane per CUDA stream the run used, one bar per stage.

A record is ``{"stream": lane, "name": stage, "start_us": float, "end_us": float}`` (see
``moelora_lab.profile.timeline``). The layer's tracer names the lane a stage belongs to ("main" for
the base GEMMs and the joins, "lora" for the LoRA ops) even when everything ran on one stream, so
the number of streams a run used is given, not read from the records.
"""
from __future__ import annotations

STAGE_COLORS = {"base_w13": "#1f77b4", "base_w2": "#17becf", "act": "#7f7f7f", "sum": "#bcbd22",
                "lora_w13": "#d62728", "lora_w2": "#ff7f0e", "w13+lora": "#8c564b", "w2+lora": "#e377c2",
                "w13+lora+act": "#aec7e8"}
LANES = ("main", "lora")
LANE_LABELS = {1: ("one stream",), 2: ("main stream (base)", "side stream (LoRA)")}
FONT = 9                                    # points: the smallest text of a timeline


def draw_timeline(ax, records, *, title: str | None = None, streams: int = 2, alone_us: float | None = None,
                  legend: bool = True) -> dict:
    """Bars of every stage (µs from the first start) on ``streams`` lanes: 2 puts each stage on its
    stream's lane, 1 puts every stage on one lane (a one-stream run has no side stream to show).

    The title gets the run's critical path and, with two streams, how much of the LoRA time ran
    beside the base work (overlap) and ``alone_us``: the same kernels' stand-alone times added up
    (take them from the one-stream trace of the same case; bars stretched by contention are not
    stand-alone times). ``legend`` puts the stage legend outside the axes, on the right.
    Returns ``overlap_metrics`` of the records.
    """
    from ..profile.timeline import overlap_metrics

    if not records:
        raise ValueError("records: empty timeline")
    if streams not in LANE_LABELS:
        raise ValueError(f"streams: expected 1 or 2, got {streams!r}")
    if alone_us is not None and not alone_us > 0:
        raise ValueError(f"alone_us: expected a positive time in µs or None, got {alone_us!r}")
    metrics = overlap_metrics(records)
    t0 = min(r["start_us"] for r in records)
    for r in records:
        y = LANES.index(r["stream"]) if streams == 2 and r["stream"] in LANES else 0
        ax.broken_barh([(r["start_us"] - t0, r["end_us"] - r["start_us"])], (y - 0.35, 0.7),
                       facecolors=STAGE_COLORS.get(r["name"], "#9467bd"), edgecolor="black", linewidth=0.5,
                       label=r["name"])
    ax.set_yticks(range(streams))
    ax.set_yticklabels(LANE_LABELS[streams], fontsize=FONT)
    ax.set_ylim(streams - 0.5, -0.5)                    # the main stream on top
    ax.set_xlabel("time (µs)", fontsize=FONT)
    ax.tick_params(labelsize=FONT)
    text = f"critical path {metrics['critical_path_us']:.0f} µs"
    if streams == 2:
        text += f"; LoRA beside the base work for {100 * metrics['overlap']:.0f}% of its time"
        if alone_us is not None:
            text += f"; the same kernels alone, back to back: {alone_us:.0f} µs"
    ax.set_title(f"{title}\n{text}" if title else text, fontsize=FONT, loc="left")
    ax.grid(True, axis="x", alpha=0.3)
    if legend:
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        ax.legend(unique.values(), unique.keys(), fontsize=FONT, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  borderaxespad=0.0, frameon=False)
    return metrics
