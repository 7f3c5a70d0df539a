"""Drawing the layer benchmark (rows of ``layer.csv`` from ``python -m moelora_lab.bench layer``)."""
from __future__ import annotations

from pathlib import Path

from .bench import log_axes, plot_band, select
from ..layer.table import AUTO, AUTO_GPU, SCHEDULES
from ..results import label
from ..summary import KERNEL_ROWS, SIDE_PLAN_ROWS, VLLM_JOIN_ROWS, side_plan_variant, vllm_join_variant

SIDE_PLAN_COLORS = ("#17becf",)            # the side-plan variants, in row order
VLLM_JOIN_COLORS = ("#9467bd", "#d62728")   # the vLLM-join variants, in row order


def _streams(row) -> str:
    return {1: "one stream", 2: "two streams"}.get(row.streams, f"{row.streams} streams")


def _variant_styles() -> dict:
    """Every layer variant's style: no LoRA, each row's own (``style``), its side-plan variant beside it,
    then the vLLM-join variants (the row's marker, dashed)."""
    styles = {"no_lora": dict(color="black", marker="o", label="no LoRA")}
    for name, row in SCHEDULES.items():
        styles[name] = dict(row.style or dict(label=name))
        if name in SIDE_PLAN_ROWS:
            i = SIDE_PLAN_ROWS.index(name)
            styles[side_plan_variant(name)] = dict(
                color=SIDE_PLAN_COLORS[i % len(SIDE_PLAN_COLORS)], marker=styles[name].get("marker"), linestyle=":",
                label=f"{_streams(row)}, the LoRA path by the side stream's rule")
    for i, name in enumerate(VLLM_JOIN_ROWS):
        row = SCHEDULES[name]
        styles[vllm_join_variant(name)] = dict(
            color=VLLM_JOIN_COLORS[i % len(VLLM_JOIN_COLORS)], marker=(row.style or {}).get("marker"), linestyle="--",
            label=f"{_streams(row)}, vLLM join")
    return styles


VARIANT_STYLE = _variant_styles()
# what draw_layer_times draws by default: every variant on the weights as given (no pack_in_k copy)
LAYER_VARIANTS = tuple(v for v in VARIANT_STYLE if v not in SCHEDULES or not SCHEDULES[v].needs_pack)


def _timed(rows):
    return [r for r in rows if r.get("us_median") not in ("", None)]


def _variant_lines(ax, rows, *, preset, rank, variants, styles):
    """One line with its p20-p80 band per timed variant, against M."""
    for v in variants:
        sel = select(_timed(rows), preset=preset, rank=rank, variant=v)
        if sel:
            plot_band(ax, sel, dict(styles.get(v, dict(label=v))))


def draw_layer_times(ax, rows, *, preset, rank, variants=LAYER_VARIANTS):
    """Layer time against M for each variant (log-log, spanning four decades of M), with the p20-p80
    band. Differences of a few percent vanish on these axes: for what LoRA costs, draw
    ``draw_lora_overhead`` (linear ratios)."""
    _variant_lines(ax, rows, preset=preset, rank=rank, variants=variants, styles=VARIANT_STYLE)
    log_axes(ax, "layer time (µs)", f"{preset}, rank {rank}")
    ax.legend(fontsize=9)


def lora_overhead(rows, *, preset, rank, variant=AUTO_GPU):
    """[(M, variant time / no-LoRA time)] for the cases where both were timed."""
    timed = _timed(rows)
    base = {r["M"]: r["us_median"] for r in select(timed, preset=preset, rank=rank, variant="no_lora")}
    return [(r["M"], r["us_median"] / base[r["M"]])
            for r in sorted(select(timed, preset=preset, rank=rank, variant=variant), key=lambda r: r["M"])
            if r["M"] in base]


def draw_lora_overhead(ax, rows, *, preset, ranks, variants=(*KERNEL_ROWS.values(), AUTO), band=True,
                       legend=True):
    """LoRA layer time / no-LoRA layer time against M (linear ratio, M on a log2 axis), one line per
    (rank, variant) with, given ``band``, the variant's p20-p80 over the no-LoRA median shaded.
    ``auto`` is drawn as open rings only, so it sits on the schedule it ran. ``legend`` puts the
    legend outside the axes, on the right. Returns the number of lines drawn."""
    styles = dict(VARIANT_STYLE, **{AUTO: dict(color="black", marker="o", markersize=9, markerfacecolor="none",
                                               linestyle="none", label=f"LoRA, schedule={AUTO!r}")})
    timed, drawn, ms = _timed(rows), 0, set()
    for rank in ranks:
        base = {r["M"]: r["us_median"] for r in select(timed, preset=preset, rank=rank, variant="no_lora")}
        for v in variants:
            sel = sorted((r for r in select(timed, preset=preset, rank=rank, variant=v) if r["M"] in base),
                         key=lambda r: r["M"])
            if not sel:
                continue
            style = dict(styles.get(v, dict(label=v)))
            style["label"] = f"r={rank}: {style.get('label', v)}" if len(ranks) > 1 else style.get("label", v)
            style["alpha"] = 1.0 if rank == ranks[0] else 0.6
            xs = [r["M"] for r in sel]
            ax.plot(xs, [r["us_median"] / base[r["M"]] for r in sel], **style)
            if band and v != AUTO and all(r.get("us_p20") not in ("", None) for r in sel):
                ax.fill_between(xs, [r["us_p20"] / base[r["M"]] for r in sel],
                                [r["us_p80"] / base[r["M"]] for r in sel], color=style.get("color", "gray"),
                                alpha=0.15, linewidth=0)
            drawn, ms = drawn + 1, ms | set(xs)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xscale("log", base=2)
    if ms:
        ax.set_xticks(sorted(ms), [str(m) for m in sorted(ms)])
        ax.minorticks_off()
    ax.set_xlabel("tokens M", fontsize=9)
    ax.set_ylabel("LoRA layer time / no-LoRA layer time", fontsize=9)
    ax.set_title(f"{preset}: cost of LoRA" + (f", rank {ranks[0]}" if len(ranks) == 1 else ""), fontsize=10)
    ax.tick_params(labelsize=9)
    ax.grid(True, alpha=0.3)
    if legend and drawn:
        ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)
    return drawn


def save_layer_plots(rows, out_dir, name="layer"):
    """One PNG per preset: per rank, the layer times (log-log) above what LoRA costs (linear ratio)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for preset in sorted({r["preset"] for r in rows}):
        ranks = sorted({r["rank"] for r in rows if r["preset"] == preset})
        fig, axes = plt.subplots(2, len(ranks), figsize=(4.8 * len(ranks) + 2.6, 7.6), squeeze=False,
                                 layout="constrained")
        for j, rank in enumerate(ranks):
            draw_layer_times(axes[0][j], rows, preset=preset, rank=rank)
            draw_lora_overhead(axes[1][j], rows, preset=preset, ranks=[rank], legend=j == len(ranks) - 1)
        runs = label([r for r in rows if r["preset"] == preset])          # a file may join two runs' cases
        fig.suptitle(f"MoE layer with LoRA (bf16, {rows[0]['loras']} adapters): {runs}", fontsize=10)
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
    paths; alone_us: the stages' stand-alone times added up (one stream); lora_seq_us: LoRA busy
    time alone; lora_dual_us: the same kernels beside the base GEMMs; hidden: LoRA time taken off
    the critical path, (seq_us - dual_us) / lora_seq_us; floor_us: the fully fused layer's bytes at
    the copy rate (from the trace's meta).
    """
    from ..profile.timeline import overlap_metrics

    cases = {}
    for t in traces.values():
        m = t["meta"]
        cases.setdefault((m["preset"], m["M"], m["rank"]), {})[m["schedule"]] = t
    rows = []
    one, two = KERNEL_ROWS[1], KERNEL_ROWS[2]                  # the op's LoRA kernels on one stream and on two
    for (preset, M, rank), both in sorted(cases.items()):
        if not {one, two} <= set(both):
            continue
        seq = overlap_metrics(both[one]["records"])
        dual = overlap_metrics(both[two]["records"])
        rows.append(dict(preset=preset, M=M, rank=rank, lora_path=both[two]["meta"].get("lora_path", ""),
                         overlap=dual["overlap"], seq_us=seq["critical_path_us"], dual_us=dual["critical_path_us"],
                         alone_us=seq["serial_sum_us"],
                         lora_seq_us=seq["side_busy_us"], lora_dual_us=dual["side_busy_us"],
                         hidden=(seq["critical_path_us"] - dual["critical_path_us"]) / seq["side_busy_us"],
                         floor_us=both[two]["meta"].get("floor_us")))
    return rows


def draw_timelines(axes, cases, *, floor_us: float | None = None, alone_us: float | None = None) -> list[dict]:
    """``draw_timeline`` for each case on its Axes, one shared time axis; returns their overlap metrics.

    A case is (title, records) or (title, records, streams): ``streams`` 1 draws one lane (a one-stream
    run), 2 (the default) a lane per stream. ``alone_us``: the stand-alone stage times of the same
    case added up (the one-stream trace's ``serial_sum_us``), quoted in the two-stream titles.
    ``floor_us``: a dashed line where the fully fused layer's byte floor ends, named in the legend.
    """
    from .timeline import draw_timeline

    axes, cases = list(axes), list(cases)
    if len(axes) != len(cases) or not cases:
        raise ValueError(f"axes, cases: expected one Axes per case and at least one case, got {len(axes)} and "
                         f"{len(cases)}")
    for case in cases:
        if not (isinstance(case, (tuple, list)) and len(case) in (2, 3)):
            raise TypeError(f"cases: expected (title, records) or (title, records, streams), got {case!r:.80}")
    end = max(r["end_us"] - min(q["start_us"] for q in case[1]) for case in cases for r in case[1])
    right = 1.03 * max(end, floor_us or 0)
    metrics = []
    for ax, (title, recs, *streams) in zip(axes, cases):
        if floor_us:
            ax.axvline(floor_us, color="black", linestyle="--", linewidth=1.2,
                       label=f"byte floor of the fused layer, {floor_us:.0f} µs")
        metrics.append(draw_timeline(ax, recs, title=title, streams=streams[0] if streams else 2,
                                     alone_us=alone_us))
        ax.set_xlim(0, right)
    return metrics


def variant_table(rows, *, preset: str, rank: int, variants) -> list[dict]:
    """{'M': M, variant: median µs, ...} for every M where all ``variants`` were timed, sorted by M."""
    timed = _timed(select(rows, preset=preset, rank=rank))
    per_m: dict = {}
    for r in timed:
        per_m.setdefault(r["M"], {})[r["variant"]] = r["us_median"]
    return [dict(M=M, **{v: t[v] for v in variants}) for M, t in sorted(per_m.items())
            if all(v in t for v in variants)]
