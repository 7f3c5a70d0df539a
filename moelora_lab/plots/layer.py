"""Drawing the layer benchmark (rows of ``layer.csv`` from ``python -m moelora_lab.bench layer``)."""
from __future__ import annotations

from pathlib import Path

from .bench import log_axes, plot_band, select
from ..results import label

VARIANT_STYLE = {
    "no_lora": dict(color="black", marker="o", label="no LoRA"),
    "sequential": dict(color="#1f77b4", marker="s", label="LoRA, one stream"),
    "dual_stream": dict(color="#2ca02c", marker="^", label="LoRA, two streams (folded join)"),
    "fused": dict(color="#ff7f0e", marker="D", label="LoRA inside the base GEMMs"),
    "sequential_vllm_join": dict(color="#9467bd", marker="s", linestyle="--", label="one stream, vLLM join"),
    "dual_stream_vllm_join": dict(color="#d62728", marker="^", linestyle="--", label="two streams, vLLM join"),
}


def _timed(rows):
    return [r for r in rows if r.get("us_median") not in ("", None)]


def _variant_lines(ax, rows, *, preset, rank, variants, styles):
    """One line with its p20-p80 band per timed variant, against M."""
    for v in variants:
        sel = select(_timed(rows), preset=preset, rank=rank, variant=v)
        if sel:
            plot_band(ax, sel, dict(styles.get(v, dict(label=v))))


def draw_layer_times(ax, rows, *, preset, rank, variants=tuple(VARIANT_STYLE)):
    """Layer time against M for each variant (log-log), with the p20-p80 band."""
    _variant_lines(ax, rows, preset=preset, rank=rank, variants=variants, styles=VARIANT_STYLE)
    log_axes(ax, "layer time (µs)", f"{preset}, rank {rank}")


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


# ---------------------------------------------------------------------------------------------
# Two streams on one memory bus: per-stage bytes, phases of a timeline, the cost of the join.
# Shape legend: M tokens, k top-k, H hidden, I expert intermediate, b bytes per element,
# P = M*k pairs, P_a = pairs of tokens with an adapter.

STAGE_PAIRS = (("w13", "base_w13", "lora_w13"), ("w2", "base_w2", "lora_w2"))


data_label = label   # provenance line of a committed row or trace meta (moelora_lab.results.label)


def trace_name(preset: str, M: int, rank: int, schedule: str) -> str:
    """Key of one case in ``layer_traces.json``, as ``python -m moelora_lab.bench layer`` writes it."""
    return f"{preset}_M{M}_r{rank}_{schedule}"


def stage_pair_bytes(stages, bandwidth_bytes_per_s: float) -> list[dict]:
    """The two overlapped pairs of a ``layer_traffic`` result, as memory-bound times.

    One row per pair (w13: base_w13 beside lora_w13; w2: base_w2 beside lora_w2) with base_bytes,
    lora_bytes and, at ``bandwidth_bytes_per_s``: base_us, lora_us, hidden_us = max(base, lora)
    (the LoRA fully hidden, as if it had a bus of its own) and shared_us = (base + lora) bytes /
    bandwidth (one bus for both streams: the best two streams can do when both are memory-bound).
    """
    if not bandwidth_bytes_per_s > 0:
        raise ValueError(f"bandwidth_bytes_per_s: must be > 0, got {bandwidth_bytes_per_s}")
    rows = []
    for phase, base, lora in STAGE_PAIRS:
        if base not in stages or lora not in stages:
            raise KeyError(f"stages: {base!r} and {lora!r} needed; pass layer_traffic(..., with_lora=True)")
        b, l = stages[base].bytes, stages[lora].bytes
        us = lambda n: n / bandwidth_bytes_per_s * 1e6
        rows.append(dict(phase=phase, base_bytes=b, lora_bytes=l, base_us=us(b), lora_us=us(l),
                         hidden_us=max(us(b), us(l)), shared_us=us(b + l)))
    return rows


def trace_phases(records) -> dict:
    """Per overlapped pair of one timeline: base_us and lora_us (stage lengths) and window_us, from the
    pair's first start to its last end (what the pair adds to the critical path)."""
    by_name = {r["name"]: r for r in records}
    out = {}
    for phase, base, lora in STAGE_PAIRS:
        if base not in by_name or lora not in by_name:
            raise KeyError(f"records: stages {base!r} and {lora!r} needed, got {sorted(by_name)}")
        b, l = by_name[base], by_name[lora]
        out[phase] = dict(base_us=b["end_us"] - b["start_us"], lora_us=l["end_us"] - l["start_us"],
                          window_us=max(b["end_us"], l["end_us"]) - min(b["start_us"], l["start_us"]))
    return out


def overlap_table(traces) -> list[dict]:
    """One row per (preset, M, rank) traced with both schedules, sorted by those keys.

    overlap: time both streams are busy / LoRA busy time (two streams); seq_us, dual_us: critical
    paths; lora_seq_us: LoRA busy time alone; lora_dual_us: the same kernels beside the base GEMMs;
    hidden: LoRA time taken off the critical path, (seq_us - dual_us) / lora_seq_us; floor_us: the
    fully fused layer's bytes at the copy rate (from the trace's meta).
    """
    from ..profile.timeline import overlap_metrics

    cases = {}
    for t in traces.values():
        m = t["meta"]
        cases.setdefault((m["preset"], m["M"], m["rank"]), {})[m["schedule"]] = t
    rows = []
    for (preset, M, rank), both in sorted(cases.items()):
        if not {"sequential", "dual_stream"} <= set(both):
            continue
        seq = overlap_metrics(both["sequential"]["records"])
        dual = overlap_metrics(both["dual_stream"]["records"])
        rows.append(dict(preset=preset, M=M, rank=rank, lora_path=both["dual_stream"]["meta"].get("lora_path", ""),
                         overlap=dual["overlap"], seq_us=seq["critical_path_us"], dual_us=dual["critical_path_us"],
                         lora_seq_us=seq["side_busy_us"], lora_dual_us=dual["side_busy_us"],
                         hidden=(seq["critical_path_us"] - dual["critical_path_us"]) / seq["side_busy_us"],
                         floor_us=both["dual_stream"]["meta"].get("floor_us")))
    return rows


def draw_timelines(axes, cases, *, floor_us: float | None = None) -> None:
    """``draw_timeline`` for each (title, records) of ``cases`` on its Axes, one shared time axis,
    overlap metrics in the titles and, given ``floor_us``, a dashed line where the byte floor ends."""
    from ..profile.timeline import overlap_metrics
    from .timeline import draw_timeline

    axes, cases = list(axes), list(cases)
    if len(axes) != len(cases) or not cases:
        raise ValueError(f"axes, cases: expected one Axes per case and at least one case, got {len(axes)} and "
                         f"{len(cases)}")
    end = max(r["end_us"] - min(q["start_us"] for q in recs) for _, recs in cases for r in recs)
    right = 1.04 * max(end, floor_us or 0)
    for ax, (title, recs) in zip(axes, cases):
        draw_timeline(ax, recs, title=title, metrics=overlap_metrics(recs))
        if floor_us:
            ax.axvline(floor_us, color="black", linestyle="--", linewidth=1)
            left_of_line = floor_us > 0.15 * right           # the legend sits in the upper right corner
            text = f"byte floor {floor_us:.0f} µs"
            ax.text(floor_us, 1.75, f"{text} " if left_of_line else f" {text}", fontsize=7, va="center",
                    ha="right" if left_of_line else "left")
        ax.set_xlim(0, right)


def variant_table(rows, *, preset: str, rank: int, variants) -> list[dict]:
    """{'M': M, variant: median µs, ...} for every M where all ``variants`` were timed, sorted by M."""
    timed = _timed(select(rows, preset=preset, rank=rank))
    per_m: dict = {}
    for r in timed:
        per_m.setdefault(r["M"], {})[r["variant"]] = r["us_median"]
    return [dict(M=M, **{v: t[v] for v in variants}) for M, t in sorted(per_m.items())
            if all(v in t for v in variants)]


def join_traffic(shape, num_tokens: int, join: str, *, tokens_with_adapter: int | None = None,
                 dtype_bytes: int = 2):
    """HBM traffic of a join beyond the kernels both joins share (the LoRA kernels writing their delta
    rows, the activation and the top-k sum doing their base work).

    vllm   zero-fill both delta buffers (write P*2I*b and P*H*b), then ``c1 += d13`` and ``c3 += d2``
           (read c, read d, write c: 3*P*2I*b and 3*P*H*b); 4 launches. Every pair row is touched.
    fold   the activation reads d13 and the top-k sum reads d2 for the P_a pairs with an adapter
           (P_a*2I*b + P_a*H*b); no launch of its own.
    """
    from ..validate import check_choice, check_int
    from ..profile.traffic import Traffic

    check_choice("join", join, ("fold", "vllm"))
    m = check_int("num_tokens", num_tokens, low=0)
    with_adapter = m if tokens_with_adapter is None else check_int("tokens_with_adapter", tokens_with_adapter,
                                                                   low=0, high=m)
    b = check_int("dtype_bytes", dtype_bytes, low=1)
    k, i2, h = shape.top_k, 2 * shape.intermediate, shape.hidden
    if join == "fold":
        pa = with_adapter * k
        reads = (("act_reads_d13", pa * i2 * b), ("sum_reads_d2", pa * h * b))
        return Traffic(sum(n for _, n in reads), 0, 0, 0, reads)
    p = m * k
    reads = (("add_reads_c1_d13", 2 * p * i2 * b), ("add_reads_c3_d2", 2 * p * h * b))
    writes = (("zero_d13", p * i2 * b), ("zero_d2", p * h * b), ("add_writes_c1", p * i2 * b),
              ("add_writes_c3", p * h * b))
    return Traffic(sum(n for _, n in reads), sum(n for _, n in writes), p * (i2 + h), 4, reads + writes)


def join_savings(rows, *, preset: str, rank: int, schedule: str = "sequential") -> list[dict]:
    """Per M: fold_us (our join), vllm_us (vLLM's), saved_us = vllm - fold, saved = saved_us / vllm_us."""
    if schedule not in ("sequential", "dual_stream"):
        raise ValueError(f"schedule: {schedule!r} is not one of 'sequential', 'dual_stream'")
    out = []
    for r in variant_table(rows, preset=preset, rank=rank, variants=(schedule, f"{schedule}_vllm_join")):
        fold, vllm = r[schedule], r[f"{schedule}_vllm_join"]
        out.append(dict(M=r["M"], fold_us=fold, vllm_us=vllm, saved_us=vllm - fold, saved=(vllm - fold) / vllm))
    return out


def draw_join_savings(ax, rows, *, preset: str, ranks, schedules=("sequential", "dual_stream"),
                      predicted=None) -> None:
    """Layer time our join saves against vLLM's (µs, log-log) per M, one line per (rank, schedule);
    ``predicted``: [(M, µs)] drawn as a dashed line (e.g. join_traffic bytes / copy rate).
    Savings <= 0 cannot be drawn on a log axis and are left out."""
    colors = {"sequential": "#1f77b4", "dual_stream": "#2ca02c"}
    markers = {r: m for r, m in zip(ranks, ("o", "s", "^", "D"))}
    for rank in ranks:
        for sched in schedules:
            pts = [(s["M"], s["saved_us"]) for s in join_savings(rows, preset=preset, rank=rank, schedule=sched)
                   if s["saved_us"] > 0]
            if pts:
                ax.plot(*zip(*pts), color=colors.get(sched), marker=markers[rank],
                        alpha=1.0 if rank == ranks[0] else 0.6,
                        label=f"measured, r={rank}, {'two streams' if sched == 'dual_stream' else 'one stream'}")
    if predicted:
        ax.plot(*zip(*predicted), color="black", linestyle="--", label="predicted: extra bytes / copy rate")
    log_axes(ax, "vLLM join − folded join (µs per layer)", f"{preset}: what the folded join saves")


BASE_STYLE = {
    "no_lora": dict(color="black", marker="o", label="whole layer, no LoRA"),
    "base_gemms": dict(color="#1f77b4", marker="s", label="our grouped GEMMs (w13 + w2)"),
    "grouped_mm": dict(color="#ff7f0e", marker="^", label="torch._grouped_mm (w13 + w2, rows pre-grouped)"),
    "plan": dict(color="#d62728", marker="x", linestyle="--", label="routing plan (plan_layer, device kernels)"),
}


def draw_base_and_plan(ax, rows, *, preset: str, rank: int, variants=tuple(BASE_STYLE),
                       torch_plan=None) -> None:
    """Time against M (log-log, p20-p80 band) of the no-LoRA layer, its two grouped GEMMs, the same
    GEMMs through torch._grouped_mm, and the routing plan; ``torch_plan``: [(M, µs)] of the same plan
    built from PyTorch ops, drawn as a dotted line."""
    _variant_lines(ax, rows, preset=preset, rank=rank, variants=variants, styles=BASE_STYLE)
    if torch_plan:
        ax.plot(*zip(*sorted(torch_plan)), color=BASE_STYLE["plan"]["color"], marker="+", linestyle=":",
                label="routing plan as PyTorch ops (2 block lists)")
    log_axes(ax, "time per call (µs)", f"{preset}: the base GEMMs and the routing plan")
