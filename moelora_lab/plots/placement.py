"""Where the LoRA goes in the layer: every placement (the product schedules and the one-stream experiments)
timed against the layer without LoRA, tabulated and drawn from the layer sweep (notebook 05).

Shape legend: M tokens, r rank, L adapters.
"""
from __future__ import annotations

from ..layer.table import SCHEDULES
from .layer import VARIANT_STYLE

# the schedules a placement table compares: the product rows and the one-stream experiments (the two-stream
# experiment, the LoRA in the joins, belongs to the appendix); the legend reads each row's own label
PLACEMENTS = tuple(name for name, row in SCHEDULES.items() if row.status == "product" or row.streams == 1)
PLACEMENT_LABELS = {name: f"{name}: {SCHEDULES[name].style['label']}" for name in PLACEMENTS}


def placement_table(rows, *, preset: str, rank: int, variants=PLACEMENTS) -> list[dict]:
    """Per M timed with and without LoRA: each placement's layer time over the no-LoRA layer's (keyed by
    variant, for the ``variants`` timed at that M), ``fastest`` (the variant with the lowest ratio),
    ``auto`` (the ratio of the ``auto`` row) and ``auto_ran`` (the schedule it ran), ``floor``: the ratio of
    the two floors (``roofline_us`` of the auto row over the no-LoRA row's: bytes at the copy rate or
    FLOPs at the matmul rate, whichever is larger) and ``base_gemms``: the two base GEMMs alone, over the
    no-LoRA layer."""
    from .bench import select
    from .layer import _timed
    timed = _timed(select(rows, preset=preset, rank=rank))
    per_m: dict = {}
    for r in timed:
        per_m.setdefault(r["M"], {})[r["variant"]] = r
    out = []
    for M, t in sorted(per_m.items()):
        if "no_lora" not in t or "auto" not in t:
            continue
        plain = t["no_lora"]["us_median"]
        ratios = {v: t[v]["us_median"] / plain for v in variants if v in t}
        if not ratios:
            continue
        row = dict(M=M, **ratios, fastest=min(ratios, key=ratios.get), auto=t["auto"]["us_median"] / plain,
                   auto_ran=t["auto"].get("schedule", "auto"),
                   floor=t["auto"]["roofline_us"] / t["no_lora"]["roofline_us"])
        if "base_gemms" in t:
            row["base_gemms"] = t["base_gemms"]["us_median"] / plain
        out.append(row)
    return out


def draw_placements(ax, rows, *, preset: str, rank: int, variants=PLACEMENTS, labels=None, font: int = 10,
                    legend: bool = True) -> list[dict]:
    """Each placement's layer time over the no-LoRA layer against M (linear ratio, M on a log2 axis), the
    ``auto`` row (timed on its own) as open rings, the floor ratio as a dashed black line and the no-LoRA
    layer at 1; ``labels``: {variant: legend text} (default ``PLACEMENT_LABELS``). ``legend`` puts the
    legend under the Axes. Returns ``placement_table``'s rows."""
    table = placement_table(rows, preset=preset, rank=rank, variants=variants)
    for v in variants:
        pts = [(r["M"], r[v]) for r in table if v in r]
        if pts:
            style = dict(VARIANT_STYLE.get(v, {}), label=(PLACEMENT_LABELS if labels is None else labels).get(v, v))
            ax.plot(*zip(*pts), markersize=6, **style)
    if table:
        ax.plot([r["M"] for r in table], [r["auto"] for r in table], linestyle="none", marker="o", markersize=12,
                markerfacecolor="none", markeredgecolor="black", label="auto, timed on its own")
        ax.plot([r["M"] for r in table], [r["floor"] for r in table], color="black", linestyle="--", linewidth=1.2,
                label="floor ratio (LoRA floor / no-LoRA floor)")
    ax.axhline(1.0, color="gray", linewidth=1.0)
    ax.text(0.01, 1.0, " no LoRA", transform=ax.get_yaxis_transform(), fontsize=font, va="bottom", color="gray")
    ax.set_xscale("log", base=2)
    ticks = [r["M"] for r in table]
    if ticks:
        ax.set_xticks(ticks, [str(m) for m in ticks])
        ax.minorticks_off()
    ax.set_xlabel("tokens M", fontsize=font)
    ax.set_ylabel("layer time / no-LoRA layer time", fontsize=font)
    ax.set_title(f"{preset}, rank {rank}", fontsize=font + 1)
    ax.tick_params(labelsize=font)
    ax.grid(True, alpha=0.3)
    if legend:
        ax.legend(fontsize=font, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, frameon=False)
    return table
