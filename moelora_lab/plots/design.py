"""The design choices of the layer, tabulated and drawn from the benchmark CSVs: the join (vLLM's
zero-fill and add passes against the folded join), the tile rules against the tile walks, the
memory order of LoRA B, our base GEMMs against ``torch._grouped_mm`` with the routing plan, and the
layer's stages under one-stream schedules.

Shape legend: M tokens, k top-k, E experts, L adapters, r rank, H hidden, I expert intermediate,
b bytes per element, P = M*k pairs, P_a = pairs of tokens with an adapter, N out, S slices.
"""
from __future__ import annotations

from ..layer.table import JOINS, SCHEDULES
from ..summary import VLLM_JOIN_ROWS, vllm_join_variant
from .bench import log_axes
from .layer import _streams, _variant_lines, variant_table

FONT = 9                      # the smallest text of every figure drawn here (points)
FINGERPRINT_SMS = 132         # an H200's SM count: the tile rules are read for the GPU that ran the data
TILE_FIELDS = ("block_m", "block_n", "block_k", "n_chunks", "num_warps", "num_stages")


def _legend_below(ax, ncol: int = 2) -> None:
    """The legend under the Axes, below the tick labels and the x label (a fixed distance in points,
    whatever the Axes' height), clear of labels and data."""
    from matplotlib.transforms import ScaledTranslation

    handles, labels = ax.get_legend_handles_labels()
    if handles:
        below = ax.transAxes + ScaledTranslation(0, -34 / 72, ax.figure.dpi_scale_trans)
        ax.legend(handles, labels, fontsize=FONT, loc="upper center", bbox_to_anchor=(0.5, 0), bbox_transform=below,
                  ncol=ncol, frameon=False)


def _token_axis(ax, tokens) -> None:
    """x: tokens M on a log2 scale, ticks at the token counts drawn, labelled as plain integers."""
    ax.set_xscale("log", base=2)
    ticks = sorted(set(tokens))
    ax.set_xticks(ticks, [str(m) for m in ticks], fontsize=FONT)
    ax.minorticks_off()
    ax.set_xlabel("tokens M", fontsize=FONT)


# ---------------------------------------------------------------------------------------------
# The join


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

    check_choice("join", join, JOINS)
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


def join_savings(rows, *, preset: str, rank: int, schedule: str = VLLM_JOIN_ROWS[0]) -> list[dict]:
    """Per M: fold_us (our join), vllm_us (vLLM's), saved_us = vllm - fold, saved = saved_us / vllm_us;
    ``schedule``: a row that runs both joins (``summary.VLLM_JOIN_ROWS``)."""
    if schedule not in VLLM_JOIN_ROWS:
        raise ValueError(f"schedule: {schedule!r} is not one of {', '.join(repr(s) for s in VLLM_JOIN_ROWS)}")
    out = []
    for r in variant_table(rows, preset=preset, rank=rank, variants=(schedule, vllm_join_variant(schedule))):
        fold, vllm = r[schedule], r[vllm_join_variant(schedule)]
        out.append(dict(M=r["M"], fold_us=fold, vllm_us=vllm, saved_us=vllm - fold, saved=(vllm - fold) / vllm))
    return out


def draw_join_savings(ax, rows, *, preset: str, ranks, schedules=VLLM_JOIN_ROWS,
                      predicted=None, share: bool = False) -> None:
    """What our join saves against vLLM's per M, one line per (rank, schedule).

    ``share=False``: µs per layer, log-log (savings <= 0 cannot be drawn there and are left out);
    ``predicted``: [(M, µs)] drawn as a dashed line (e.g. join_traffic bytes / copy rate).
    ``share=True``: the saving as a share of the vLLM-join layer (%, linear, negative where vLLM's
    join was faster), ``predicted`` ignored."""
    colors = {name: (SCHEDULES[name].style or {}).get("color") for name in VLLM_JOIN_ROWS}   # the rows' own
    markers = {r: m for r, m in zip(ranks, ("o", "s", "^", "D"))}
    tokens = []
    for rank in ranks:
        for sched in schedules:
            got = join_savings(rows, preset=preset, rank=rank, schedule=sched)
            tokens += [s["M"] for s in got]
            nan = float("nan")                      # a gap in the line where the saving cannot be drawn
            pts = ([(s["M"], 100 * s["saved"]) for s in got] if share else
                   [(s["M"], s["saved_us"] if s["saved_us"] > 0 else nan) for s in got])
            if pts:
                ax.plot(*zip(*pts), color=colors.get(sched), marker=markers[rank],
                        linestyle="-" if rank == ranks[0] else ":",
                        label=f"r={rank}, {_streams(SCHEDULES[sched])}")
    if share:
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_ylabel("saved, % of the vLLM-join layer", fontsize=FONT)
        ax.set_title(f"{preset}: as a share of the layer", fontsize=FONT + 1)
        ax.grid(True, which="both", alpha=0.3)
    else:
        if predicted:
            ax.plot(*zip(*predicted), color="black", linestyle="--", label="predicted: extra bytes / copy rate")
        log_axes(ax, "vLLM join − folded join (µs per layer)", f"{preset}: time saved per layer")
        ax.title.set_fontsize(FONT + 1)
    if tokens:
        _token_axis(ax, tokens)
    _legend_below(ax)


# ---------------------------------------------------------------------------------------------
# Tile rules against the tile walks, and the memory order of B


def _tiles(row_or_cfg) -> tuple:
    get = row_or_cfg.get if isinstance(row_or_cfg, dict) else lambda f: getattr(row_or_cfg, f)
    return tuple(get(f) for f in TILE_FIELDS)


def tile_name(tiles: tuple) -> str:
    """'m16 n128 k128 c3 w2 s3' for (block_m, block_n, block_k, n_chunks, num_warps, num_stages)."""
    return " ".join(f"{p}{v}" for p, v in zip("mnkcws", tiles))


def _op_dims(shape, op: str) -> tuple[int, int]:
    """(N out per slice, S slices) of the w13 (gate | up) or w2 (down) LoRA op."""
    if op not in ("w13", "w2"):
        raise ValueError(f"op: {op!r} is not one of 'w13', 'w2'")
    return (shape.intermediate, 2) if op == "w13" else (shape.hidden, 1)


def sweep_rule_config(path: str, preset, op: str, rank: int, M: int, loras: int, *, sms: int = FINGERPRINT_SMS):
    """The tiles ``dispatch.gpu_config`` gives ``path`` today for one case of the H200 sweeps (the sweep's
    routing of M tokens over ``loras`` adapters, a GPU of ``sms`` SMs)."""
    from ..config import MoEShape
    from ..op.dispatch import gpu_config
    from .traffic import sweep_workload

    shape = MoEShape.from_name(preset) if isinstance(preset, str) else preset
    n_out, slices = _op_dims(shape, op)
    P = M * shape.top_k
    groups = min(P, sweep_workload(shape, M, loras).touched_adapter_experts or 1)
    return gpu_config(path, P, groups, n_out, slices, sms, rank=rank)


def lora_rule_table(rows, *, sms: int = FINGERPRINT_SMS) -> list[dict]:
    """Per case of ``lora_tune.csv`` (preset, op, path, rank, M): the tiles the current rule
    (``dispatch.gpu_config`` for ``sms`` SMs, on the sweep's routing) picks, their time if the walk
    timed them (``rule_us``; None if the walk never tried them), the fastest tiles the walk found
    (``best_us``, ``best``), ``rule_over_best`` = rule_us / best_us and ``rule_in_data``: whether the
    rows the walk marked as the rule's are the current rule's tiles (False: the walk ran another rule)."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["preset"], r["op"], r["path"], r["rank"], r["M"]), []).append(r)
    out = []
    for (preset, op, path, rank, M), rs in sorted(groups.items()):
        timed = [r for r in rs if r.get("us_median") not in ("", None)]
        if not timed:
            continue
        rule = _tiles(sweep_rule_config(path, preset, op, rank, M, rs[0]["loras"], sms=sms))
        at_rule = [r["us_median"] for r in timed if _tiles(r) == rule]
        best = min(timed, key=lambda r: r["us_median"])
        marked = {_tiles(r) for r in rs if str(r.get("rule")) == "True"}
        out.append(dict(preset=preset, op=op, path=path, rank=rank, M=M, rule=tile_name(rule),
                        rule_us=at_rule[0] if at_rule else None, best=tile_name(_tiles(best)),
                        best_us=best["us_median"], rule_over_best=at_rule[0] / best["us_median"] if at_rule else None,
                        rule_in_data=marked == {rule}))
    return out


def path_choice_table(rows) -> list[dict]:
    """Per (preset, op, rank, M) that the walk timed on both paths: the fastest time of each path
    (``one_shot_us``, ``two_kernel_us``), what ``dispatch.choose_path`` picks (``auto``) and
    ``auto_over_best``: the best time of the picked path over the best of both."""
    from ..config import MoEShape
    from ..op.dispatch import choose_path

    best: dict = {}
    for r in rows:
        if r.get("us_median") in ("", None):
            continue
        key = (r["preset"], r["op"], r["rank"], r["M"])
        cur = best.setdefault(key, {})
        cur[r["path"]] = min(cur.get(r["path"], float("inf")), r["us_median"])
        cur["loras"] = r["loras"]
    out = []
    for (preset, op, rank, M), t in sorted(best.items()):
        if not {"one_shot", "two_kernel"} <= set(t):
            continue
        shape = MoEShape.from_name(preset)
        auto = choose_path(M * shape.top_k, shape.num_experts, t["loras"], rank, shape.op_dims(op)[1])
        out.append(dict(preset=preset, op=op, rank=rank, M=M, one_shot_us=t["one_shot"],
                        two_kernel_us=t["two_kernel"], auto=auto,
                        auto_over_best=t[auto] / min(t["one_shot"], t["two_kernel"])))
    return out


def layout_speedups(rows) -> list[dict]:
    """Per case of ``b_layout.csv`` (preset, op, path, rank, M): the op's time with B as given
    (``r_fastest_us``) and packed N-fastest (``n_fastest_us``), and speedup = r_fastest / n_fastest."""
    cases: dict = {}
    for r in rows:
        if r["b_layout"] not in ("r_fastest", "n_fastest"):
            raise ValueError(f"rows: b_layout {r['b_layout']!r} is not 'r_fastest' or 'n_fastest'")
        cases.setdefault((r["preset"], r["op"], r["path"], r["rank"], r["M"]), {})[r["b_layout"]] = r["us_median"]
    return [dict(preset=p, op=op, path=path, rank=rank, M=M, r_fastest_us=t["r_fastest"], n_fastest_us=t["n_fastest"],
                 speedup=t["r_fastest"] / t["n_fastest"])
            for (p, op, path, rank, M), t in sorted(cases.items()) if len(t) == 2]


# ---------------------------------------------------------------------------------------------
# The base GEMMs, torch._grouped_mm and the routing plan

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
    log_axes(ax, "time per call (µs)", f"{preset}: base GEMMs and routing plan")
    ax.title.set_fontsize(FONT + 1)
    tokens = [r["M"] for r in rows if r.get("preset") == preset and r.get("rank") == rank and r.get("variant") in variants]
    if tokens:
        _token_axis(ax, tokens + [m for m, _ in torch_plan or []])
    _legend_below(ax, ncol=1)


def draw_grouped_mm_ratio(ax, rows, *, preset: str, rank: int) -> list[tuple]:
    """torch._grouped_mm time / our grouped GEMMs' time against M (linear, 1 = a tie); returns the
    points [(M, ratio)]."""
    pts = [(r["M"], r["grouped_mm"] / r["base_gemms"])
           for r in variant_table(rows, preset=preset, rank=rank, variants=("base_gemms", "grouped_mm"))]
    if pts:
        ax.plot(*zip(*pts), color=BASE_STYLE["grouped_mm"]["color"], marker="^")
    ax.axhline(1.0, color="black", linewidth=0.8)
    if pts:
        _token_axis(ax, [m for m, _ in pts])
        low = pts[0][1] < 1.0                              # keep the note on the side of the line with no data
        ax.text(pts[0][0], 1.0, " below 1: torch._grouped_mm is faster" if not low else
                " above 1: ours is faster", fontsize=FONT, va="top" if not low else "bottom")
    ax.set_ylabel("torch._grouped_mm / ours (time)", fontsize=FONT)
    ax.set_title(f"{preset}: our base GEMMs against torch._grouped_mm", fontsize=FONT + 1)
    ax.grid(True, which="both", alpha=0.3)
    return pts


# ---------------------------------------------------------------------------------------------
# One-stream timelines: the stages of the layer, one row per schedule


def draw_stage_strips(ax, cases) -> None:
    """One row per (title, records) of ``cases``, top to bottom, on one time axis: each stage a bar at
    its measured start and length (µs from the row's first start), named inside when wide enough,
    and the row's end time printed after it. For runs on one stream, whose stages never overlap
    (two-stream runs: ``plots.layer.draw_timelines``)."""
    from .timeline import STAGE_COLORS

    cases = list(cases)
    if not cases:
        raise ValueError("cases: expected at least one (title, records) pair")
    ends = []
    for title, recs in cases:
        if not recs:
            raise ValueError(f"cases: {title!r} has no records")
        ordered = sorted(recs, key=lambda r: r["start_us"])
        if any(b["start_us"] < a["end_us"] - 1e-3 for a, b in zip(ordered, ordered[1:])):
            raise ValueError(f"cases: stages of {title!r} overlap (a two-stream run); draw it with "
                             "plots.layer.draw_timelines")
        ends.append(max(r["end_us"] for r in recs) - ordered[0]["start_us"])
    right = 1.16 * max(ends)
    seen = set()
    for y, ((title, recs), end) in enumerate(zip(cases, ends)):
        t0 = min(r["start_us"] for r in recs)
        for r in recs:
            left, width = r["start_us"] - t0, r["end_us"] - r["start_us"]
            ax.barh(y, width, left=left, height=0.6, color=STAGE_COLORS.get(r["name"], "#9467bd"),
                    edgecolor="black", linewidth=0.5, label=None if r["name"] in seen else r["name"])
            seen.add(r["name"])
            if width > 0.07 * right:
                ax.text(left + width / 2, y, r["name"], ha="center", va="center", fontsize=FONT, color="white")
        ax.text(end + 0.01 * right, y, f"{end:.0f} µs", va="center", fontsize=FONT)
    ax.set_yticks(range(len(cases)))
    ax.set_yticklabels([t for t, _ in cases], fontsize=FONT)
    ax.set_ylim(len(cases) - 0.5, -0.5)
    ax.set_xlim(0, right)
    ax.set_xlabel("time from the first stage's start (µs)", fontsize=FONT)
    ax.grid(True, axis="x", alpha=0.3)
    _legend_below(ax, ncol=4)
