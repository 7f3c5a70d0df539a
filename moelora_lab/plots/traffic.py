"""HBM-traffic pictures: where the bytes of a LoRA op go, and how the byte model compares with time.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, K in, N out, S slices, T the rank
intermediate [S, M*k, r] of the two-kernel path.

``traffic_table`` evaluates the byte model (``profile.traffic``) per M and path;
``measured_vs_predicted`` and ``ratio_points`` set a kernels sweep's times next to it; the ``draw_*``
functions draw on the Axes they are given and return None. Measured rows are dicts as read by
``moelora_lab.results.load`` from the committed H200 CSVs (or measured live, ``lesson.data``).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from matplotlib.patches import Patch

from ..validate import check_choice, check_int, check_rows
from ..config import MoEShape
from ..profile.timeline import bench_workload
from ..profile.traffic import LORA_PATHS, Traffic, Workload, lora_op_traffic
from .bench import PATH_STYLE, check_ax, select, tokens_axis

OPS = ("w13", "w2")
ROUTINGS = ("dense", "sweep")
UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}
# byte parts of lora_op_traffic, bottom to top: (name, colour, hatch, legend label)
PARTS = (
    ("x", "#9ecae1", "", "x rows"),
    ("lora_a", "#a1d99b", "", "A weights"),
    ("lora_b", "#41ab5d", "", "B weights"),
    ("lora_a_copy_write", "#e5f5e0", "..", "per-pair weight copies"),
    ("lora_b_copy_write", "#e5f5e0", "..", None),
    ("lora_a_copy_read", "#e5f5e0", "..", None),
    ("lora_b_copy_read", "#e5f5e0", "..", None),
    ("intermediate_write", "#fb6a4a", "//", "T write (shrink)"),
    ("intermediate_read", "#a50f15", "//", "T read (expand)"),
    ("out_read", "#cbc9e2", "", "out read"),
    ("out_write", "#6a51a3", "", "out write"),
)
GROUPS = {"x": ("x",), "weights": ("lora_a", "lora_b"), "intermediate": ("intermediate_write", "intermediate_read"),
          "out": ("out_read", "out_write")}


def _shape(shape) -> MoEShape:
    if isinstance(shape, str):
        return MoEShape.from_name(shape)
    if not isinstance(shape, MoEShape):
        raise TypeError(f"shape: expected a MoEShape or a preset name, got {type(shape).__name__}")
    return shape


def op_dims(shape, op: str) -> dict:
    """in_features K, out_features N, num_slices S and x_rows of the w13 or w2 LoRA op of a layer."""
    shape = _shape(shape)
    check_choice("op", op, OPS)
    if op == "w13":
        return dict(in_features=shape.hidden, out_features=shape.intermediate, num_slices=2, x_rows="token")
    return dict(in_features=shape.intermediate, out_features=shape.hidden, num_slices=1, x_rows="pair")


def sweep_workload(shape, num_tokens: int, num_loras: int = 4, seed: int = 0) -> Workload:
    """The counted workload of the H200 sweep's routing for M tokens (``python -m moelora_lab.bench``:
    :func:`moelora_lab.config.benchmark_routing`), so bytes match its CSV."""
    shape = _shape(shape)
    m = check_int("num_tokens", num_tokens, low=1)
    return bench_workload(shape, m, num_loras, seed)


def traffic_table(shape, rank: int, op: str, tokens, *, num_loras: int = 4, paths=("two_kernel", "one_shot"),
                  routing: str = "dense", dtype_bytes: int = 2) -> list[dict]:
    """Byte-model rows, one per (M, path): bytes, flops, launches, the byte groups x / weights /
    intermediate / out with their shares of the total, and the ``Traffic`` itself (the naive path's
    per-pair weight copies belong to no group, so its shares sum to less than 1).

    routing 'dense': Workload.dense (every token its own random adapter, expected counts);
    'sweep': the exact routing of the committed H200 sweep (see ``sweep_workload``).
    """
    shape = _shape(shape)
    check_int("rank", rank, low=1)
    check_choice("routing", routing, ROUTINGS)
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence) or not tokens:
        raise TypeError(f"tokens: expected a non-empty list of ints, got {tokens!r}")
    for p in paths:
        check_choice("paths[i]", p, LORA_PATHS)
    dims = op_dims(shape, op)
    rows = []
    for m in tokens:
        check_int("tokens[i]", m, low=1)
        wl = (Workload.dense(m, shape.top_k, shape.num_experts, num_loras) if routing == "dense"
              else sweep_workload(shape, m, num_loras))
        for path in paths:
            t = lora_op_traffic(path, wl, rank=rank, dtype_bytes=dtype_bytes, add_inputs=True, **dims)
            groups = {g: sum(t.part(p) for p in names) for g, names in GROUPS.items()}
            rows.append(dict(preset=shape.name, op=op, rank=rank, M=m, path=path, bytes=t.bytes, flops=t.flops,
                             launches=t.launches, **groups,
                             **{f"{g}_share": groups[g] / t.bytes for g in GROUPS}, traffic=t))
    return rows


def _scale(unit: str, largest: float) -> tuple[str, float]:
    if unit == "auto":
        unit = next((u for u in ("GB", "MB", "KB") if largest >= UNITS[u]), "B")
    check_choice("unit", unit, (*UNITS, "auto"))
    return unit, UNITS[unit]


def draw_bytes_breakdown(ax, traffics: Mapping[str, Traffic], *, unit: str = "auto", title: str | None = None,
                         legend: bool = True) -> None:
    """One stacked bar per entry of ``traffics`` ({label: Traffic}), split into the byte parts;
    the total and the rank intermediate's share are written above each bar; the legend of the
    parts sits outside the Axes, on the right (``legend=False``: none, e.g. for a left panel)."""
    check_ax(ax)
    if not isinstance(traffics, Mapping) or not traffics:
        raise TypeError(f"traffics: expected a non-empty dict {{label: Traffic}}, got {type(traffics).__name__}")
    for label, t in traffics.items():
        if not isinstance(t, Traffic):
            raise TypeError(f"traffics[{label!r}]: expected a Traffic (lora_op_traffic(...)), got {type(t).__name__}")
    unit, div = _scale(unit, max(t.bytes for t in traffics.values()))
    names = list(traffics)
    known = {p[0] for p in PARTS}
    extra = sorted({n for t in traffics.values() for n, _ in t.parts if n not in known})
    handles, bottom = {}, [0.0] * len(names)
    for part, color, hatch, label in PARTS + tuple((n, "#bdbdbd", "xx", n) for n in extra):
        heights = [traffics[n].part(part) / div for n in names]
        if not any(heights):
            continue
        ax.bar(range(len(names)), heights, bottom=bottom, color=color, hatch=hatch, edgecolor="white",
               linewidth=0.5, width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights)]
        if label is not None:
            handles.setdefault(label, Patch(facecolor=color, hatch=hatch, edgecolor="white", label=label))
    for i, n in enumerate(names):
        t = traffics[n]
        share = sum(t.part(p) for p in GROUPS["intermediate"]) / t.bytes if t.bytes else 0.0
        note = f"{t.bytes / div:.3g} {unit}" + (f"\nT: {100 * share:.2g} %" if share else "")
        ax.annotate(note, (i, bottom[i]), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
                    fontsize=9)
    ax.set_xticks(range(len(names)), [PATH_STYLE.get(n, {}).get("label", n).replace(" (", "\n(") for n in names],
                  fontsize=9)
    ax.set_ylabel(f"HBM bytes per call ({unit})")
    ax.set_ylim(0, max(bottom) * 1.2 or 1)
    if legend:
        ax.legend(handles=list(handles.values())[::-1], fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.grid(True, axis="y", alpha=0.3)
    if title:
        ax.set_title(title)


def draw_intermediate_share(ax, rows, *, label: str | None = None, color=None, marker: str = "o") -> None:
    """Share of the rank intermediate T (shrink's write + expand's read) in the two-kernel path's bytes against M
    (two-kernel rows of ``traffic_table``; call once per series)."""
    check_ax(ax)
    rows = check_rows("rows", rows, ("M", "path", "intermediate_share"))
    sel = sorted((r for r in rows if r["path"] == "two_kernel"), key=lambda r: r["M"])
    if not sel:
        raise ValueError("rows: no two_kernel rows; build them with traffic_table(..., paths=('two_kernel', ...))")
    ax.plot([r["M"] for r in sel], [100 * r["intermediate_share"] for r in sel], marker=marker, color=color,
            label=label)
    tokens_axis(ax)
    ax.set_ylabel("T's share of the two-kernel bytes (%)")
    ax.set_ylim(0, 1.1 * max(max(line.get_ydata(), default=0) for line in ax.get_lines()) or 1)
    ax.grid(True, which="both", alpha=0.3)
    if label is not None:
        ax.legend(fontsize=9)


def measured_vs_predicted(rows, *, preset: str, op: str, rank: int, paths=("two_kernel", "one_shot"),
                          bandwidth_tbps: float | None = None) -> list[dict]:
    """Per (M, path) of a sweep CSV: measured median µs and the byte model's prediction
    bytes / copy bandwidth (the row's copy_tbps unless ``bandwidth_tbps`` is given), and their ratio."""
    rows = check_rows("rows", rows, ("preset", "op", "rank", "path", "M", "us_median", "bytes", "copy_tbps"))
    if bandwidth_tbps is not None and not (isinstance(bandwidth_tbps, (int, float)) and bandwidth_tbps > 0):
        raise ValueError(f"bandwidth_tbps: expected a positive number of TB/s, got {bandwidth_tbps!r}")
    out = []
    for path in paths:
        for r in sorted(select(rows, preset=preset, op=op, rank=rank, path=path), key=lambda r: r["M"]):
            predicted = r["bytes"] / ((bandwidth_tbps or r["copy_tbps"]) * 1e12) * 1e6
            out.append(dict(M=r["M"], path=path, measured_us=r["us_median"], predicted_us=predicted,
                            ratio=r["us_median"] / predicted, bytes=r["bytes"]))
    if not out:
        have = sorted({(r["preset"], r["op"], r["rank"]) for r in rows})
        raise ValueError(f"rows: nothing for preset={preset!r}, op={op!r}, rank={rank} and paths {list(paths)}; "
                         f"the rows hold {have}")
    return out


def draw_measured_vs_predicted(ax, rows, *, preset: str, op: str, rank: int, paths=("two_kernel", "one_shot"),
                               bandwidth_tbps: float | None = None) -> None:
    """Measured median time (solid) and the byte-model prediction (dashed) against M, per path, log-log;
    the legend sits outside the Axes, on the right."""
    check_ax(ax)
    pts = measured_vs_predicted(rows, preset=preset, op=op, rank=rank, paths=paths, bandwidth_tbps=bandwidth_tbps)
    for path in paths:
        sel = [p for p in pts if p["path"] == path]
        if not sel:
            continue
        style = PATH_STYLE.get(path, dict(color=None, marker="o", label=path))
        ms = [p["M"] for p in sel]
        ax.plot(ms, [p["measured_us"] for p in sel], color=style["color"], marker=style["marker"] or "o",
                label=f"{style['label']}: measured")
        ax.plot(ms, [p["predicted_us"] for p in sel], color=style["color"], linestyle="--", marker=".",
                label=f"{style['label']}: bytes / copy bandwidth")
    tokens_axis(ax)
    ax.set_yscale("log")
    ax.set_ylabel("time per call (µs)")
    ax.set_title(f"{preset} {op}, rank {rank}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1))


def ratio_points(rows, *, preset: str) -> list[dict]:
    """One point per (op, rank, M) of a sweep CSV that timed both the two-kernel and the one-shot path:
    ``predicted`` = two-kernel bytes / one-shot bytes (the byte model: time = bytes / bandwidth),
    ``measured`` = two-kernel median µs / one-shot median µs; > 1: the fused kernel is faster."""
    rows = check_rows("rows", rows, ("preset", "op", "rank", "path", "M", "us_median", "bytes"))
    by = {path: {(r["op"], r["rank"], r["M"]): r for r in select(rows, preset=preset, path=path)}
          for path in ("two_kernel", "one_shot")}
    out = []
    for key in sorted(by["two_kernel"].keys() & by["one_shot"].keys(), key=lambda k: (k[0] != "w13", k[1], k[2])):
        two, one = by["two_kernel"][key], by["one_shot"][key]
        out.append(dict(op=key[0], rank=key[1], M=key[2], predicted=two["bytes"] / one["bytes"],
                        measured=two["us_median"] / one["us_median"], two_kernel_us=two["us_median"],
                        one_shot_us=one["us_median"], two_kernel_bytes=two["bytes"], one_shot_bytes=one["bytes"]))
    if not out:
        raise ValueError(f"rows: no (op, rank, M) of preset {preset!r} has both a two_kernel and a one_shot row; "
                         f"the rows hold presets {sorted({r['preset'] for r in rows})}")
    return out


RANK_MARKERS = "osD^vP"


RANK_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2")


def draw_ratio_vs_tokens(ax, points, *, op: str, legend: bool = True, fontsize: int = 10) -> None:
    """Two-kernel / one-shot ratio against M for one op (``ratio_points``): per rank (one colour) the
    measured time ratio (solid, markers) and the byte model's ratio (dashed: time = bytes / bandwidth);
    y = 1 (equal time) dotted; above 1 the fused kernel is faster. Every text is at least ``fontsize``
    points; with ``legend`` the legend sits outside the Axes, on the right (without it,
    ``ax.get_legend_handles_labels()`` gives its entries: the ranks, the two line styles, equal time)."""
    check_ax(ax)
    check_choice("op", op, OPS)
    size = check_int("fontsize", fontsize, low=6)
    points = [p for p in check_rows("points", points, ("op", "rank", "M", "predicted", "measured")) if p["op"] == op]
    if not points:
        raise ValueError(f"points: none for op {op!r}")
    ranks = sorted({p["rank"] for p in points})
    if len(ranks) > len(RANK_COLORS):
        raise ValueError(f"points: at most {len(RANK_COLORS)} ranks can be told apart, got {ranks}")
    for rank, color in zip(ranks, RANK_COLORS):
        sel = sorted((p for p in points if p["rank"] == rank), key=lambda p: p["M"])
        ms = [p["M"] for p in sel]
        ax.plot(ms, [p["measured"] for p in sel], color=color, marker="o", markersize=6, lw=2, label=f"r = {rank}")
        ax.plot(ms, [p["predicted"] for p in sel], color=color, linestyle="--", lw=1.5)
    ax.axhline(1.0, color="gray", linewidth=1.2, linestyle=":", zorder=1)
    for style, label in (("-", "measured: two-kernel time / one-shot time"),
                         ("--", "byte model: two-kernel bytes / one-shot bytes")):
        ax.plot([], [], color="black", linestyle=style, lw=2 if style == "-" else 1.5, label=label)
    ax.plot([], [], color="gray", linestyle=":", lw=1.2, label="equal (1)")
    tokens_axis(ax)
    ax.set_xlabel("tokens M", fontsize=size)
    ax.set_ylabel("two-kernel / one-shot  (> 1: one-shot faster)", fontsize=size)
    ax.tick_params(labelsize=size)
    ax.set_title(op, fontsize=size + 1)
    ax.grid(True, alpha=0.3)
    if legend:
        ax.legend(fontsize=size, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
