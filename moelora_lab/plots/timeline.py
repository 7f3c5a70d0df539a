"""Two-stream timelines: one lane per stream, one bar per stage."""
from __future__ import annotations

STAGE_COLORS = {"base_w13": "#1f77b4", "base_w2": "#17becf", "act": "#7f7f7f", "sum": "#bcbd22",
                "lora_w13": "#d62728", "lora_w2": "#ff7f0e", "w13+lora": "#8c564b", "w2+lora": "#e377c2"}
LANES = ("main", "lora")


def draw_timeline(ax, records, *, title: str | None = None, metrics: dict | None = None) -> None:
    """Bars of every stage on its stream's lane (µs from the first start); metrics in the title."""
    if not records:
        raise ValueError("records: empty timeline")
    t0 = min(r["start_us"] for r in records)
    for y, lane in enumerate(LANES):
        for r in (r for r in records if r["stream"] == lane):
            ax.broken_barh([(r["start_us"] - t0, r["end_us"] - r["start_us"])], (y - 0.35, 0.7),
                           facecolors=STAGE_COLORS.get(r["name"], "#9467bd"), edgecolor="black", linewidth=0.5,
                           label=r["name"])
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=7, loc="upper right", ncol=3)
    ax.set_yticks(range(len(LANES)))
    ax.set_yticklabels(["main stream (base)", "side stream (LoRA)"])
    ax.set_ylim(-0.6, len(LANES) + 0.2)
    ax.set_xlabel("time (µs)")
    text = title or ""
    if metrics:
        text += (f"\noverlap {100 * metrics['overlap']:.0f}% of LoRA time, critical path "
                 f"{metrics['critical_path_us']:.0f} µs vs serial {metrics['serial_sum_us']:.0f} µs")
    ax.set_title(text.strip(), fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)
