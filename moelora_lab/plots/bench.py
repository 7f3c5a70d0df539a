"""Drawing benchmark results (rows of the CSVs under ``moelora_lab/data``): time against M, the
roofline, our ``auto`` path against vLLM's reference measurement.

Shape legend: M tokens, r rank (LoRA), op w13 (gate|up, 2 slices) or w2 (down, 1 slice).

Pure functions ``draw_*(ax, rows, **params)``: they read rows (dicts as written by
``moelora_lab.bench``, read back by ``moelora_lab.results``) and draw on the Axes they are given.
"""
from __future__ import annotations

from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.lines import Line2D
from matplotlib.ticker import NullLocator

from ..validate import check_rows

PATH_STYLE = {
    "two_kernel": dict(color="#d62728", marker="s", label="two-kernel (T in HBM)"),
    "one_shot": dict(color="#1f77b4", marker="o", label="one-shot (T in registers)"),
    "small_batch": dict(color="#2ca02c", marker="^", label="small-batch (GEMV)"),
    "auto": dict(color="black", marker="", linestyle=":", label="auto (dispatcher)"),
    "gather_bmm": dict(color="#7f7f7f", marker="x", label="gather + bmm (PyTorch, modelled)"),
}


def check_ax(ax) -> None:
    if not isinstance(ax, Axes):
        raise TypeError(f"ax: expected a matplotlib Axes (e.g. fig.add_subplot()), got {type(ax).__name__}")


def tokens_axis(ax) -> None:
    """Log2 M axis ticked at the M values drawn (plain numbers), when there are few of them."""
    ax.set_xscale("log", base=2)
    ms = sorted({float(x) for line in ax.get_lines() for x in line.get_xdata() if x > 0})
    if 0 < len(ms) <= 12:
        ax.set_xticks(ms, [f"{m:g}" for m in ms])
        ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("tokens M")


def select(rows, **where):
    """Rows whose fields equal every ``where`` item."""
    return [r for r in rows if all(r.get(k) == v for k, v in where.items())]


def plot_band(ax, rows, style, *, x="M", y="us_median", low="us_p20", high="us_p80"):
    """One line of ``y`` against ``x`` with its p20-p80 band shaded (rows sorted by ``x``)."""
    rows = sorted(rows, key=lambda r: r[x])
    xs = [r[x] for r in rows]
    ax.plot(xs, [r[y] for r in rows], **style)
    ax.fill_between(xs, [r[low] for r in rows], [r[high] for r in rows], color=style.get("color", "gray"),
                    alpha=0.15, linewidth=0)


def log_axes(ax, ylabel, title, xlabel="tokens M"):
    """Log-log axes (x in powers of two) with labels, title, grid and a small legend."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def _save(fig, path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


def draw_time_vs_tokens(ax, rows, *, preset, op, rank, paths=("two_kernel", "one_shot", "small_batch"),
                        vllm_rows=None, show_floor=True):
    """Median time (p20-p80 band) against M for each path, log-log; optional vLLM reference points."""
    floor = None
    for path in paths:
        sel = sorted(select(rows, preset=preset, op=op, rank=rank, path=path), key=lambda r: r["M"])
        if not sel:
            continue
        plot_band(ax, sel, dict(PATH_STYLE.get(path, dict(label=path))))
        if path == "one_shot":
            floor = [(r["M"], r["floor_us"]) for r in sel]
    if show_floor and floor:
        ax.plot(*zip(*floor), color="gray", linestyle="--", label="byte floor (one-shot bytes / copy rate)")
    if vllm_rows:
        ref = sorted(select(vllm_rows, preset=preset, op=op, rank=rank), key=lambda r: r["M"])
        if ref:
            ax.plot([r["M"] for r in ref], [r["vllm_dispatch_us"] for r in ref], color="#ff7f0e",
                    marker="*", linestyle="-.", label="vLLM dispatch (H200)")
    log_axes(ax, "time per call (µs)", f"{preset} {op}, rank {rank}")


SERIES_COLORS = ("#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02")


def _ceiling(rows, key, given, what):
    """A ceiling given by the caller, else the one value every row carries in ``key``, else None."""
    if given is not None:
        if not (isinstance(given, (int, float)) and given > 0):
            raise ValueError(f"{what}: expected a positive number, got {given!r}")
        return float(given)
    values = {r.get(key) for r in rows}
    if len(values) == 1 and isinstance(next(iter(values)), (int, float)) and next(iter(values)) > 0:
        return float(values.pop())
    return None


def draw_roofline(ax, rows, *, color_by="rank", peak_tflops=None, bandwidth_tbps=None, label_m=True):
    """Achieved TFLOP/s against arithmetic intensity (FLOP / byte of the byte model) for the rows of
    one preset: one line per (``color_by`` value, path) through M ascending, colour = the ``color_by``
    field ('rank' or 'op'; the rows should hold one value of the other), marker = path (filled: the
    first path in ``PATH_STYLE`` order, hollow: the others); with ``label_m`` the M of each point of
    the first path is written beside it.

    Ceilings: the copy bandwidth (``bandwidth_tbps``, else the rows' ``copy_tbps``) and the bf16
    matmul rate (``peak_tflops``, else the rows' ``matmul_tflops``); a ceiling neither gives is not
    drawn. The axes are cropped to the points (and to the ridge point when both ceilings are drawn).
    Returns None; the legend sits outside the Axes, on the right."""
    check_ax(ax)
    rows = [r for r in rows if r.get("bytes") and r.get("us_median")]
    if not rows:
        raise ValueError("rows: no row with bytes and us_median > 0 (rows of a kernels CSV, without 'align' rows)")
    if color_by not in ("rank", "op"):
        raise ValueError(f"color_by: expected 'rank' or 'op', got {color_by!r}")
    other = "op" if color_by == "rank" else "rank"
    cases = sorted({(r["preset"], r[other]) for r in rows})
    if len(cases) != 1:
        raise ValueError(f"rows: expected the rows of one preset and one {other} (lines run through M), "
                         f"got {cases}; select() them first")
    bw = _ceiling(rows, "copy_tbps", bandwidth_tbps, "bandwidth_tbps")
    peak = _ceiling(rows, "matmul_tflops", peak_tflops, "peak_tflops")
    series = sorted({r[color_by] for r in rows}, key=lambda v: (str(type(v)), v))
    paths = sorted({r["path"] for r in rows}, key=lambda p: list(PATH_STYLE).index(p) if p in PATH_STYLE else 99)
    xs, ys = [], []
    for i, value in enumerate(series):
        color = SERIES_COLORS[i % len(SERIES_COLORS)]
        for j, path in enumerate(paths):
            sel = sorted(select(rows, path=path, **{color_by: value}), key=lambda r: r["M"])
            if not sel:
                continue
            x = [r["flops"] / r["bytes"] for r in sel]
            y = [r["flops"] / (r["us_median"] * 1e-6) / 1e12 for r in sel]
            xs += x
            ys += y
            ax.plot(x, y, color=color, linewidth=0.8, linestyle="-" if j == 0 else "--", alpha=0.6,
                    marker=PATH_STYLE.get(path, {}).get("marker") or "o", markersize=6,
                    markerfacecolor=color if j == 0 else "none", markeredgecolor=color)
            if label_m and j == 0:                          # even series below right, odd above left
                right = i % 2 == 0
                place = (dict(xytext=(5, -3), ha="left", va="top") if right
                         else dict(xytext=(-5, 3), ha="right", va="bottom"))
                for r, xi, yi in zip(sel, x, y):
                    ax.annotate(f"{r['M']}", (xi, yi), textcoords="offset points", fontsize=9, color=color, **place)
    x_hi, y_hi = max(xs) * 1.6, max(ys) * 2
    handles = [Line2D([], [], color=SERIES_COLORS[i % len(SERIES_COLORS)], linewidth=2,
                      label=f"r = {v}" if color_by == "rank" else str(v)) for i, v in enumerate(series)]
    handles += [Line2D([], [], color="gray", linestyle="-" if j == 0 else "--",
                       marker=PATH_STYLE.get(p, {}).get("marker") or "o",
                       markerfacecolor="gray" if j == 0 else "none", label=PATH_STYLE.get(p, {}).get("label", p))
                for j, p in enumerate(paths)]
    if peak is not None and bw is not None:
        x_hi = max(x_hi, peak / bw * 1.6)
    if bw is not None:
        xb = [min(xs) / 1.5, peak / bw if peak is not None else x_hi]
        ax.plot(xb, [bw * x for x in xb], color="black", linewidth=1.5)
        handles.append(Line2D([], [], color="black", linewidth=1.5, label=f"copy bandwidth {bw:.2f} TB/s"))
    if peak is not None:
        ax.plot([peak / bw if bw is not None else min(xs) / 1.5, x_hi], [peak, peak], color="black", linewidth=1.5,
                linestyle="-.")
        dtype = rows[0].get("dtype", "")
        handles.append(Line2D([], [], color="black", linewidth=1.5, linestyle="-.",
                              label=f"{dtype} matmul {peak:.0f} TFLOP/s".strip()))
        y_hi = max(y_hi, peak * 1.6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(min(xs) / 1.5, x_hi)
    ax.set_ylim(min(ys) / 2, y_hi)
    ax.set_xlabel("arithmetic intensity (FLOP / byte, byte model)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(handles=handles, fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)


def vllm_comparison(ours, vllm_rows, *, preset: str = "qwen3-30b-a3b") -> list[dict]:
    """Our ``auto`` rows next to vLLM's reference for every (op, rank, M) cell both have:
    speedup = vLLM dispatch µs / our µs (> 1: we are faster), speedup_best against vLLM's fastest path."""
    ours = check_rows("ours", ours, ("preset", "op", "rank", "M", "path", "ran", "us_median"))
    vllm_rows = check_rows("vllm_rows", vllm_rows, ("preset", "op", "rank", "M", "vllm_dispatch_us", "vllm_best_us"))
    table = []
    for v in sorted(select(vllm_rows, preset=preset), key=lambda r: (r["op"] != "w13", r["rank"], r["M"])):
        mine = select(ours, preset=preset, op=v["op"], rank=v["rank"], M=v["M"], path="auto")
        if mine:
            us = mine[0]["us_median"]
            table.append(dict(op=v["op"], rank=v["rank"], M=v["M"], ran=mine[0]["ran"], ours_us=us,
                              vllm_dispatch_us=v["vllm_dispatch_us"], vllm_best_us=v["vllm_best_us"],
                              speedup=v["vllm_dispatch_us"] / us, speedup_best=v["vllm_best_us"] / us))
    if not table:
        raise ValueError(f"ours / vllm_rows: no common (op, rank, M) with path 'auto' for preset {preset!r}")
    return table


def draw_speedup_vs_vllm(ax, table, *, key: str = "speedup") -> None:
    """Speed-up over vLLM (a ``vllm_comparison`` table) against M, one line per (op, rank); the
    legend sits outside the Axes, on the right."""
    check_ax(ax)
    table = check_rows("table", table, ("op", "rank", "M", key))
    colors = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")
    series = sorted({(r["op"], r["rank"]) for r in table}, key=lambda s: (s[0] != "w13", s[1]))
    for i, (op, rank) in enumerate(series):
        sel = sorted((r for r in table if r["op"] == op and r["rank"] == rank), key=lambda r: r["M"])
        ax.plot([r["M"] for r in sel], [r[key] for r in sel], marker="os^D"[i % 4], color=colors[i % len(colors)],
                linestyle="-" if op == "w13" else "--", label=f"{op}, r = {rank}")
    tokens_axis(ax)
    ax.axhline(1.0, color="black", linewidth=1, label="parity")
    ax.set_ylabel("vLLM time / our time (×)" if key == "speedup" else f"{key} (×)")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1))


def save_kernel_plots(rows, out_dir, name="kernels"):
    """One PNG per preset (ops x ranks of time-vs-M panels) and a roofline PNG (presets x ops, the
    two-kernel and one-shot paths); returns the paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..results import read_csv

    vllm_csv = Path(__file__).resolve().parent.parent / "data" / "h200" / "vllm_reference.csv"
    vllm_rows = read_csv(vllm_csv) if vllm_csv.exists() else None
    out_dir = Path(out_dir)
    written = []
    timed = [r for r in rows if r["path"] != "align"]
    for preset in sorted({r["preset"] for r in timed}):
        ops = sorted({r["op"] for r in timed if r["preset"] == preset}, reverse=True)
        ranks = sorted({r["rank"] for r in timed if r["preset"] == preset})
        fig, axes = plt.subplots(len(ops), len(ranks), figsize=(4.2 * len(ranks), 3.6 * len(ops)), squeeze=False)
        for i, op in enumerate(ops):
            for j, rank in enumerate(ranks):
                draw_time_vs_tokens(axes[i][j], timed, preset=preset, op=op, rank=rank, vllm_rows=vllm_rows)
        fig.suptitle(f"{preset}: LoRA op time on {timed[0]['gpu']} ({timed[0]['dtype']})")
        written.append(_save(fig, out_dir / f"{name}_{preset}.png"))
    presets = sorted({r["preset"] for r in timed})
    ops = sorted({r["op"] for r in timed}, reverse=True)
    fig, axes = plt.subplots(len(presets), len(ops), figsize=(6 * len(ops) + 2, 5 * len(presets)), squeeze=False)
    for i, preset in enumerate(presets):
        for j, op in enumerate(ops):
            sel = [r for r in select(timed, preset=preset, op=op) if r["path"] in ("two_kernel", "one_shot")]
            if sel:
                draw_roofline(axes[i][j], sel, color_by="rank")
                if j < len(ops) - 1:
                    axes[i][j].get_legend().remove()              # one legend per row, on the right
            axes[i][j].set_title(f"{preset} {op}")
    fig.suptitle(f"Roofline of the LoRA op, two-kernel and one-shot ({timed[0]['gpu']})")
    written.append(_save(fig, out_dir / f"{name}_roofline.png"))
    return written


def gemm_tile_table(rows) -> list[dict]:
    """Per (op, M, LoRA rank) of ``gemm_tune.csv``: the tiles of the rule when the sweep ran, of
    ``moe.gemm_tiles`` now, and the best of the grid (µs and tiles), for the tiles that ran."""
    from ..config import MoEShape
    from ..base_moe import gpu_gemm_tiles

    keys = ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")
    name = lambda t: "{block_m}x{block_n}x{block_k} g{group_m} w{num_warps} s{num_stages}".format(**t)
    groups: dict = {}
    for r in rows:
        if r.get("us_median") not in ("", None):
            groups.setdefault((r["op"], r["M"], r["lora_rank"]), []).append(r)
    out = []
    for (op, M, rank), rs in sorted(groups.items()):
        best = min(rs, key=lambda r: r["us_median"])
        then = next(r for r in rs if str(r["rule_at_run"]) == "True")
        shape = MoEShape.from_name(rs[0]["preset"])
        now_t = {k.lower(): v for k, v in gpu_gemm_tiles(M * shape.top_k / shape.num_experts, lora=rank > 0).items()}
        now = next((r for r in rs if all(r[k] == now_t[k] for k in keys)), None)
        out.append(dict(op=op, M=M, lora_rank=rank, then_us=then["us_median"], then=name(then),
                        now_us=now["us_median"] if now else None, now=name(now) if now else "not in the grid",
                        best_us=best["us_median"], best=name(best)))
    return out
