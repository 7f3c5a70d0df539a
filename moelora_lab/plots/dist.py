"""Pictures of one MoE-LoRA layer over several GPUs (``moelora_lab.dist``), drawn from the committed
two-GPU data (``dist_steps.csv``, ``dist_collectives.csv``, ``dist_trace.json``).

Shape legend: M tokens per rank, W ranks, r rank. A stage row is a dict of ``dist_steps.csv``
(layer, lora, micro_batches, M_per_rank, stage, us_median, model_bytes, rank, ...); a collective row
one of ``dist_collectives.csv`` (op, bytes_per_rank, us_median, us_min, rank). ``draw_*(ax, ...)``
draw on a matplotlib Axes and return None.
"""
from __future__ import annotations

from matplotlib.patches import FancyArrowPatch, Rectangle

from ..validate import check_choice, check_int
from .routing import _check_ax

COMM_STAGES = ("dispatch", "combine", "all_gather_T13", "all_reduce_T2", "all_reduce_y")
KIND_COLORS = {"communication": "#d62728", "experts": "#1f77b4", "other": "#bbbbbb"}
EXPERT_KERNELS = ("moe_gemm", "one_shot", "shrink", "expand", "silu_and_mul", "topk_sum", "count_kernel",
                  "scan_kernel", "place_kernel", "small_batch")
LAYERS = ("single_gpu", "ep", "tp", "tp_fully_sharded")
STAGE_ORDER = ("dispatch", "experts", "experts[0]", "experts[1]", "combine", "base_w13", "lora_w13", "shrink_w13",
               "all_gather_T13", "expand_w13", "act", "base_w2", "lora_w2", "shrink_w2", "all_reduce_T2", "expand_w2",
               "sum", "all_reduce_y")
FONT = 9
READ_FONT = 10                     # points: the smallest text of the stage bars, timelines and dataflow
BAR_FONT = READ_FONT               # points: every text of draw_stage_bars
KIND_LABELS = {"communication": "communication (NCCL)", "experts": "expert kernels (the lab's Triton)",
               "other": "other (PyTorch glue)"}
TIMELINE_EDGE = dict(edgecolor="black", linewidth=0.3)        # the outline of a kernel bar and of its legend key
COMPUTE_SHADES = ("#1f77b4", "#9ecae1")       # compute stages, alternating so that neighbours differ


def _rows(name: str, rows, keys) -> list:
    if not isinstance(rows, (list, tuple)) or not rows:
        raise ValueError(f"{name}: expected a non-empty list of rows (dicts of a dist_*.csv), got {rows!r:.80}")
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not set(keys) <= set(row):
            raise ValueError(f"{name}: row {i} lacks the columns {sorted(set(keys) - set(row or {}))}; expected "
                             f"rows with {list(keys)}")
    return list(rows)


def stage_times(rows, layer: str, *, lora: str, M_per_rank: int, micro_batches: int = 1, rank: int = 0) -> dict:
    """{stage: µs (median)} of one layer's run on one rank, ``total`` included; ValueError if absent."""
    rows = _rows("rows", rows, ("layer", "lora", "micro_batches", "M_per_rank", "stage", "us_median", "rank"))
    out = {r["stage"]: float(r["us_median"]) for r in rows
           if (r["layer"], r["lora"], r["micro_batches"], r["M_per_rank"], r["rank"]) ==
           (layer, lora, micro_batches, M_per_rank, rank)}
    if not out:
        have = sorted({(r["layer"], r["lora"], r["micro_batches"], r["M_per_rank"]) for r in rows})
        raise ValueError(f"no rows for layer={layer!r}, lora={lora!r}, micro_batches={micro_batches}, "
                         f"M_per_rank={M_per_rank}, rank={rank}; the data holds {have}")
    return out


def split_time(stages: dict) -> dict:
    """{"communication": µs of the collective stages, "compute": µs of the others} (``total`` left out)."""
    if not isinstance(stages, dict):
        raise TypeError(f"stages: expected a dict {{stage: µs}}, got {type(stages).__name__}")
    comm = sum(v for k, v in stages.items() if k in COMM_STAGES)
    return {"communication": comm, "compute": sum(v for k, v in stages.items() if k != "total") - comm}


def draw_stage_bars(ax, rows, *, lora: str, M_per_rank: int, layers=LAYERS, rank: int = 0) -> None:
    """One horizontal bar per layer: its stages end to end (communication red, compute blue shades),
    with the measured total as a black tick (stages of one rank, medians; ``tokens_layer`` in the label).
    A stage is named inside its bar where the name fits; ``stage_legend`` gives the key."""
    _check_ax(ax)
    if not layers:
        raise ValueError("layers: expected at least one of " + ", ".join(LAYERS))
    names = []                                    # (x centre, y, stage, width in µs, on a dark bar?)
    for y, layer in enumerate(layers):
        check_choice("layers", layer, LAYERS)
        stages = stage_times(rows, layer, lora=lora, M_per_rank=M_per_rank, rank=rank)
        x = 0.0
        ordered = sorted((k for k in stages if k != "total"),
                         key=lambda k: STAGE_ORDER.index(k) if k in STAGE_ORDER else len(STAGE_ORDER))
        for i, (name, us) in enumerate((k, stages[k]) for k in ordered):
            comm = name in COMM_STAGES
            ax.barh(y, us, left=x, color=KIND_COLORS["communication"] if comm else COMPUTE_SHADES[i % 2],
                    edgecolor="black", linewidth=0.4)
            names.append((x + us / 2, y, name, us, comm or i % 2 == 0))
            x += us
        ax.plot([stages["total"]] * 2, [y - 0.4, y + 0.4], color="black", linewidth=2)
    ax.set_yticks(range(len(layers)))
    ax.set_yticklabels(layers, fontsize=BAR_FONT)
    ax.tick_params(axis="x", labelsize=BAR_FONT)
    ax.invert_yaxis()
    ax.set_xlabel("µs, stages end to end", fontsize=BAR_FONT)
    ax.set_title(f"M = {M_per_rank} tokens per rank, LoRA {lora}", fontsize=BAR_FONT + 1)
    # a name goes inside its bar only where it fits: its width in points against the bar's
    x0, x1 = ax.get_xlim()
    axis_pt = ax.get_position().width * ax.figure.get_figwidth() * 72 * 0.95     # the layout takes a little
    for xc, y, name, us, dark in names:
        if us / (x1 - x0) * axis_pt > 0.58 * BAR_FONT * (len(name) + 1):
            ax.text(xc, y, name, ha="center", va="center", fontsize=BAR_FONT, color="white" if dark else "black",
                    clip_on=True)


def stage_legend() -> dict:
    """The key of ``draw_stage_bars`` (a collective, the compute stages in their two alternating shades,
    the measured total) as keyword arguments: ``fig.legend(**stage_legend(), loc=...)``."""
    from matplotlib.legend_handler import HandlerTuple
    from matplotlib.lines import Line2D
    box = lambda color: Rectangle((0, 0), 1, 1, facecolor=color, edgecolor="black", linewidth=0.4)
    return dict(handles=[box(KIND_COLORS["communication"]), tuple(box(c) for c in COMPUTE_SHADES),
                         Line2D([], [], color="black", linewidth=2)],
                labels=["collective (NCCL)", "compute stages (two shades: one stage, the next)", "measured total"],
                handler_map={tuple: HandlerTuple(ndivide=None, pad=0)})


def fit_link(rows, *, op: str = "all_to_all") -> tuple[float, float]:
    """(alpha_us, gbps) of ``op`` from ``dist_collectives.csv``: alpha is the fastest time of the smallest
    size (a latency), gbps what the largest size moves per second once alpha is taken off (best rank)."""
    rows = _rows("rows", rows, ("op", "bytes_per_rank", "us_median", "us_min"))
    mine = [r for r in rows if r["op"] == op]
    if not mine:
        raise ValueError(f"op: {op!r} is not in the rows; they hold {sorted({r['op'] for r in rows})}")
    small, large = min(r["bytes_per_rank"] for r in mine), max(r["bytes_per_rank"] for r in mine)
    alpha = min(float(r["us_min"]) for r in mine if r["bytes_per_rank"] == small)
    t_large = min(float(r["us_median"]) for r in mine if r["bytes_per_rank"] == large)
    if t_large <= alpha:
        raise ValueError(f"{op}: the largest size ({large} bytes) took no longer than the smallest; cannot fit a rate")
    return alpha, large / (t_large - alpha) / 1e3


def draw_collective_model(ax, rows, *, alpha_us: float, gbps: float, op: str = "all_to_all", stages=None) -> None:
    """Measured time of ``op`` by bytes per rank (median of each rank, dots) against the model
    alpha + bytes / rate (line), log-log. ``stages``: optional [(label, bytes, µs)] points to add."""
    _check_ax(ax)
    rows = _rows("rows", rows, ("op", "bytes_per_rank", "us_median", "rank"))
    for name, v in (("alpha_us", alpha_us), ("gbps", gbps)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"{name}: expected a positive number, got {v!r}")
    mine = sorted((r for r in rows if r["op"] == op), key=lambda r: r["bytes_per_rank"])
    if not mine:
        raise ValueError(f"op: {op!r} is not in the rows; they hold {sorted({r['op'] for r in rows})}")
    for rank in sorted({r["rank"] for r in mine}):
        pts = [(r["bytes_per_rank"], r["us_median"]) for r in mine if r["rank"] == rank]
        ax.plot(*zip(*pts), "o", markersize=4, label=f"{op} measured, rank {rank}")
    sizes = sorted({r["bytes_per_rank"] for r in mine})
    ax.plot(sizes, [alpha_us + b / (gbps * 1e3) for b in sizes], "-", color="black",
            label=f"model: {alpha_us:.1f} µs + bytes / {gbps:.0f} GB/s")
    for label, nbytes, us in stages or ():
        ax.plot([nbytes], [us], "s", markersize=7, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes sent per rank", fontsize=FONT)
    ax.set_ylabel("µs", fontsize=FONT)
    ax.legend(fontsize=FONT - 2)
    ax.grid(True, which="both", alpha=0.3)


def kernel_kind(name: str) -> str:
    """"communication" (NCCL), "experts" (the lab's Triton kernels) or "other" (PyTorch's glue)."""
    if not isinstance(name, str):
        raise TypeError(f"name: expected a kernel name (str), got {type(name).__name__}")
    if name.startswith("nccl"):
        return "communication"
    return "experts" if any(name.startswith(k) for k in EXPERT_KERNELS) else "other"


def gpu_lanes(traces, micro_batches: int) -> list[tuple[str, list]]:
    """[(row label, kernel records)] of every GPU's streams in one micro-batch setting of the traces
    ``profile.trace_events.load_trace_events`` reads from ``dist_trace.json`` (cases "GPU g, n micro-
    batch(es)"); the GPU sleep that parked the stream is left out."""
    check_int("micro_batches", micro_batches, low=1)
    if not isinstance(traces, dict) or not traces:
        raise ValueError(f"traces: expected load_trace_events' dict of cases, got {traces!r:.80}")
    suffix = f", {micro_batches} micro-batch" + ("es" if micro_batches > 1 else "")
    cases = sorted(c for c in traces if c.endswith(suffix))
    if not cases:
        raise ValueError(f"micro_batches: no case ending in {suffix!r}; the traces hold {sorted(traces)}")
    out = []
    for case in cases:
        t = traces[case]
        lanes = t["meta"].get("lanes", {})
        for lane in dict.fromkeys(r["stream"] for r in t["records"]):
            recs = [r for r in t["records"] if r["stream"] == lane and "spin_kernel" not in r["name"]
                    and "sleep" not in r["name"]]
            out.append((f"{case.split(',')[0]}, {lanes.get(lane, lane)}", recs))
    return out


def overlap_us(lanes: list) -> float:
    """µs during which an NCCL kernel of one lane runs while an expert kernel runs on another lane of the
    same GPU (lanes as ``gpu_lanes`` returns them), summed over GPUs."""
    total = 0.0
    by_gpu: dict = {}
    for label, recs in lanes:
        by_gpu.setdefault(label.split(",")[0], []).append(recs)
    for groups in by_gpu.values():
        for i, a_recs in enumerate(groups):
            for j, b_recs in enumerate(groups):
                if i == j:
                    continue
                for a in (r for r in a_recs if kernel_kind(r["name"]) == "communication"):
                    for b in (r for r in b_recs if kernel_kind(r["name"]) == "experts"):
                        total += max(0.0, min(a["end_us"], b["end_us"]) - max(a["start_us"], b["start_us"]))
    return total


def draw_gpu_timeline(ax, lanes: list, *, title: str | None = None, from_last_start: bool = False) -> None:
    """One row per (GPU, CUDA stream), kernels as bars coloured by ``kernel_kind``, µs from the first
    kernel of any row (the GPUs share the host's clock). ``from_last_start``: time counts, and the
    view starts, from when the last GPU started (before that, the first GPU's NCCL kernel only waits
    for its peer). The key is drawn apart, below or beside the axes: ``timeline_legend``."""
    _check_ax(ax)
    if not isinstance(lanes, list) or not lanes or not all(isinstance(x, tuple) and len(x) == 2 for x in lanes):
        raise ValueError("lanes: expected gpu_lanes' non-empty list of (label, records)")
    starts = [r["start_us"] for _, recs in lanes for r in recs]
    if not starts:
        raise ValueError("lanes: no kernel records to draw")
    t0, end = min(starts), max(r["end_us"] for _, recs in lanes for r in recs)
    lo = 0.0
    if from_last_start:                   # the origin moves to the last GPU's first kernel
        firsts: dict = {}
        for label, recs in lanes:
            gpu = label.split(",")[0]
            firsts[gpu] = min([firsts.get(gpu, float("inf"))] + [r["start_us"] for r in recs])
        t0 = max(firsts.values())
        lo = -0.02 * (end - t0)
    for y, (label, recs) in enumerate(lanes):
        for kind, color in KIND_COLORS.items():
            bars = [(r["start_us"] - t0, r["end_us"] - r["start_us"]) for r in recs if kernel_kind(r["name"]) == kind]
            if bars:
                ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=color, **TIMELINE_EDGE)
    if from_last_start:
        ax.set_xlim(lo, (end - t0) * 1.02)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([label for label, _ in lanes], fontsize=READ_FONT)
    ax.tick_params(axis="x", labelsize=READ_FONT)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlabel("µs from the last GPU's first kernel" if from_last_start else "µs from the first kernel",
                  fontsize=READ_FONT)
    if title:
        ax.set_title(title, fontsize=READ_FONT + 1)


def timeline_legend(*lane_lists) -> dict:
    """The key of ``draw_gpu_timeline``: one entry per kernel kind drawn in any of ``lane_lists`` (each
    as ``gpu_lanes`` returns it), in the order of ``KIND_COLORS``, as keyword arguments:
    ``fig.legend(**timeline_legend(lanes), loc="outside lower center")`` (below the axes, covering nothing)."""
    if not lane_lists:
        raise ValueError("lane_lists: expected at least one list of lanes (gpu_lanes' output)")
    drawn = {kernel_kind(r["name"]) for lanes in lane_lists for _, recs in lanes for r in recs}
    kinds = [k for k in KIND_COLORS if k in drawn]
    if not kinds:
        raise ValueError("lane_lists: no kernel records, so nothing to key")
    return dict(handles=[Rectangle((0, 0), 1, 1, facecolor=KIND_COLORS[k], **TIMELINE_EDGE) for k in kinds],
                labels=[KIND_LABELS[k] for k in kinds], fontsize=READ_FONT)


def draw_parallel_dataflow(ax, kind: str, *, experts: int = 4, tokens: int = 3) -> None:
    """Two GPUs, each with its ``tokens`` tokens. ``kind="ep"``: each GPU owns half the experts; every
    token goes to its two experts' owner (dispatch, solid) and comes back (combine, dashed).
    ``kind="tp"``: each GPU holds half of every expert and all tokens; the halves' outputs are summed
    over the GPUs (all-reduce)."""
    _check_ax(ax)
    check_choice("kind", kind, ("ep", "tp"))
    E, T = check_int("experts", experts, low=2, high=8), check_int("tokens", tokens, low=1, high=6)
    if E % 2:
        raise ValueError(f"experts: {E} does not split over 2 GPUs evenly; use an even number")
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]
    ax.set_xlim(-0.5, 10.5)
    ax.set_ylim(-0.6, 2 * T + 2.2)
    ax.axis("off")
    for g in range(2):
        y0 = g * (T + 1.4)
        ax.add_patch(Rectangle((-0.3, y0 - 0.5), 10.6, T + 0.8, fill=False, linestyle=":", edgecolor="grey"))
        ax.text(-0.2, y0 + T + 0.05, f"GPU {g}", fontsize=READ_FONT + 1, fontweight="bold")
        for t in range(T):
            ax.add_patch(Rectangle((0, y0 + t - 0.3), 1.4, 0.6, facecolor="#eeeeee", edgecolor="black"))
            ax.text(0.7, y0 + t, f"token {g * T + t}", ha="center", va="center", fontsize=READ_FONT)
        own = range(g * E // 2, (g + 1) * E // 2) if kind == "ep" else range(E)
        for i, e in enumerate(own):
            n = len(own)
            ey = y0 + (T - 1) * (i + 0.5) / n
            label = f"expert {e}" if kind == "ep" else f"expert {e}, half {g}"
            ax.add_patch(Rectangle((5, ey - 0.25), 2.2, 0.5, facecolor=colors[e % 8], alpha=0.6, edgecolor="black"))
            ax.text(6.1, ey, label, ha="center", va="center", fontsize=READ_FONT)
    if kind == "ep":
        for g in range(2):
            for t in range(T):
                gid = g * T + t
                for e in ((gid % E), (gid * 3 + 1) % E):
                    owner = e // (E // 2)
                    ey = owner * (T + 1.4) + (T - 1) * ((e % (E // 2)) + 0.5) / (E // 2)
                    y = g * (T + 1.4) + t
                    ax.add_patch(FancyArrowPatch((1.4, y), (5, ey), arrowstyle="->", mutation_scale=8,
                                                 color=colors[e % 8], linewidth=1.4 if owner != g else 0.6))
                    ax.add_patch(FancyArrowPatch((7.2, ey), (8.6, y), arrowstyle="->", mutation_scale=8,
                                                 color=colors[e % 8], linestyle="--", linewidth=0.6,
                                                 connectionstyle="arc3,rad=-0.2"))
        ax.set_title("expert parallel: each token to its experts' owner (dispatch; bold: crosses GPUs)\n"
                     "and back home (combine, dashed): two all-to-alls", fontsize=READ_FONT + 1)
    else:
        for g in range(2):
            y = g * (T + 1.4) + (T - 1) / 2
            ax.add_patch(FancyArrowPatch((1.4, y), (5, y), arrowstyle="->", mutation_scale=10, color="black"))
            ax.text(8.9, y, "partial y", ha="center", va="center", fontsize=READ_FONT)
        ax.add_patch(FancyArrowPatch((9.6, (T - 1) / 2), (9.6, T + 1.4 + (T - 1) / 2), arrowstyle="<->",
                                     mutation_scale=10, color="#d62728", linewidth=2))
        ax.text(9.9, T + 0.2, "all-reduce", rotation=90, va="center", fontsize=READ_FONT, color="#d62728")
        ax.set_title("tensor parallel: every GPU runs every token on its half of every expert;\n"
                     "the partial outputs are summed (all-reduce)", fontsize=READ_FONT + 1)
    for g in range(2):
        ax.text(9.0 if kind == "ep" else 8.9, g * (T + 1.4) - 0.45, "home" if kind == "ep" else "",
                fontsize=READ_FONT, ha="center")
