"""Drawing the layer benchmark (rows of ``layer.csv`` from ``python -m moelora_lab.bench layer``)."""
from __future__ import annotations

from pathlib import Path

from .bench import select

VARIANT_STYLE = {
    "no_lora": dict(color="black", marker="o", label="no LoRA"),
    "sequential": dict(color="#1f77b4", marker="s", label="LoRA, one stream"),
    "dual_stream": dict(color="#2ca02c", marker="^", label="LoRA, two streams (folded join)"),
    "sequential_vllm_join": dict(color="#9467bd", marker="s", linestyle="--", label="one stream, vLLM join"),
    "dual_stream_vllm_join": dict(color="#d62728", marker="^", linestyle="--", label="two streams, vLLM join"),
}


def _timed(rows):
    return [r for r in rows if r.get("us_median") not in ("", None)]


def draw_layer_times(ax, rows, *, preset, rank, variants=tuple(VARIANT_STYLE)):
    """Layer time against M for each variant (log-log), with the p20-p80 band."""
    for v in variants:
        sel = sorted(select(_timed(rows), preset=preset, rank=rank, variant=v), key=lambda r: r["M"])
        if not sel:
            continue
        style = VARIANT_STYLE.get(v, dict(label=v))
        ms = [r["M"] for r in sel]
        ax.plot(ms, [r["us_median"] for r in sel], **style)
        ax.fill_between(ms, [r["us_p20"] for r in sel], [r["us_p80"] for r in sel], color=style.get("color"),
                        alpha=0.12, linewidth=0)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens M")
    ax.set_ylabel("layer time (µs)")
    ax.set_title(f"{preset}, rank {rank}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def lora_overhead(rows, *, preset, rank, variant="dual_stream"):
    """[(M, variant time / no-LoRA time)] for the cases where both were timed."""
    timed = _timed(rows)
    base = {r["M"]: r["us_median"] for r in select(timed, preset=preset, rank=rank, variant="no_lora")}
    return [(r["M"], r["us_median"] / base[r["M"]])
            for r in sorted(select(timed, preset=preset, rank=rank, variant=variant), key=lambda r: r["M"])
            if r["M"] in base]


def draw_lora_overhead(ax, rows, *, preset, ranks, variants=("sequential", "dual_stream", "dual_stream_vllm_join")):
    """LoRA layer time / no-LoRA layer time against M, one line per (rank, variant)."""
    for rank in ranks:
        for v in variants:
            pts = lora_overhead(rows, preset=preset, rank=rank, variant=v)
            if pts:
                style = dict(VARIANT_STYLE.get(v, {}))
                style["label"] = f"r={rank}: {style.get('label', v)}"
                style["alpha"] = 1.0 if rank == ranks[0] else 0.6
                ax.plot(*zip(*pts), **style)
    ax.axhline(1.15, color="gray", linestyle=":", label="1.15x of no LoRA")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens M")
    ax.set_ylabel("time / no-LoRA time")
    ax.set_title(f"{preset}: cost of LoRA")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def save_layer_plots(rows, out_dir, name="layer"):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for preset in sorted({r["preset"] for r in rows}):
        ranks = sorted({r["rank"] for r in rows if r["preset"] == preset})
        fig, axes = plt.subplots(1, len(ranks) + 1, figsize=(4.6 * (len(ranks) + 1), 3.8), squeeze=False)
        for j, rank in enumerate(ranks):
            draw_layer_times(axes[0][j], rows, preset=preset, rank=rank)
        draw_lora_overhead(axes[0][-1], rows, preset=preset, ranks=ranks)
        fig.suptitle(f"MoE layer with LoRA on {rows[0]['gpu']} (bf16, {rows[0]['loras']} adapters)")
        fig.tight_layout()
        path = Path(out_dir) / f"{name}_{preset}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
