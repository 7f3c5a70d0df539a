"""Register pictures: the fused kernel's fp32 rank tile, registers / spills / occupancy against rank.

Shape legend: BM = BLOCK_M pairs per block, BR = BLOCK_R rank columns per register tile, r rank.

``draw_*(ax, rows, **params)`` draw on a matplotlib Axes and return None. ``rows`` are dicts as
``moelora_lab.results.load`` returns them: registers.csv (``bench registers``) for the register
and occupancy plots, kernels.csv (``bench kernels``) for the timing plot.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.patches import Rectangle

from ..config import MoEShape
from ..op.dispatch import KernelConfig
from ..op.paths import resolve_path
from ..validate import check_choice, check_int, check_rows
from ..profile.report import WARPS_PER_SM
from .bench import PATH_STYLE, plot_band

REGISTER_CAP = 255        # 32-bit registers one thread may hold (NVIDIA, sm_50 and later)
THREADS_PER_WARP = 32
REGISTER_KEYS = ("rank", "block_m", "max_block_r", "n_regs", "n_spills", "blocks_per_sm", "num_warps")
TIME_KEYS = ("preset", "op", "path", "M", "rank", "loras", "us_median", "us_p20", "us_p80")
TILING_STYLE = {  # by max_block_r: 128 = rank tiling on, 512 = one tile up to r = 512
    128: dict(color="#1f77b4", label="rank tiling (BLOCK_R <= 128)"),
    512: dict(color="#ff7f0e", label="no tiling (one BLOCK_R up to 512)"),
}
SPILL_STYLE = dict(facecolor="#f4b6b6", edgecolor="#d62728", hatch="xx")


def _check_ax(ax) -> None:
    if not isinstance(ax, Axes):
        raise TypeError(f"ax: expected a matplotlib Axes (e.g. fig.add_subplot()), got {type(ax).__name__}")


def _check_pow2(name: str, value, low: int = 1, high: int | None = None) -> int:
    v = check_int(name, value, low=low, high=high)
    if v & (v - 1):
        raise ValueError(f"{name}: must be a power of two, got {v}")
    return v


def _check_rows(rows, keys: Sequence[str], source: str) -> list[Mapping]:
    return check_rows("rows", rows, keys, source)


def _pick(rows, name: str, value, key: str):
    have = {r[key] for r in rows}
    try:
        have = sorted(have)
    except TypeError:                                   # mixed types: sort by text
        have = sorted(have, key=str)
    if value not in have:
        raise ValueError(f"{name}: {value!r} is not in the rows; available: {', '.join(map(str, have))}")
    return [r for r in rows if r[key] == value]


def accumulator_registers(block_m: int, block_r: int, num_warps: int = 4) -> int:
    """32-bit registers per thread that an fp32 [block_m, block_r] tile needs when it is split
    evenly over the 32 * num_warps threads of a program: ceil(block_m * block_r / threads)."""
    bm = check_int("block_m", block_m, low=1)
    br = check_int("block_r", block_r, low=1)
    threads = THREADS_PER_WARP * _check_pow2("num_warps", num_warps, 1, 32)
    return -(-bm * br // threads)


def rank_tile(rank: int, max_block_r: int) -> tuple[int, int]:
    """(BLOCK_R, rank tiles) the launcher uses for ``rank`` when tiles are at most ``max_block_r`` wide."""
    check_int("rank", rank, low=1)
    return KernelConfig(max_block_r=_check_pow2("max_block_r", max_block_r, 16)).rank_tiling(rank)


def register_rows(rows, *, block_m: int, max_block_r: int) -> list[dict]:
    """The compiled-kernel rows of one (block_m, max_block_r), sorted by rank (failed compiles dropped)."""
    rows = _check_rows(rows, REGISTER_KEYS, "registers.csv")
    sel = _pick(_pick(rows, "block_m", block_m, "block_m"), "max_block_r", max_block_r, "max_block_r")
    return sorted((r for r in sel if isinstance(r["n_regs"], int)), key=lambda r: r["rank"])


def _ranks_and_settings(rows, block_m):
    sel = _pick(rows, "block_m", block_m, "block_m")
    return sorted({r["rank"] for r in sel}), sorted({r["max_block_r"] for r in sel})


def draw_registers_vs_rank(ax, rows, *, block_m: int, show_prediction: bool = True, legend: bool = True) -> None:
    """Registers per thread (bar) and spilled registers (hatched, on top) per rank, with and
    without rank tiling; the 255-register cap as a line; the fp32 T tile alone as black ticks."""
    _check_ax(ax)
    rows = _check_rows(rows, REGISTER_KEYS, "registers.csv")
    ranks, settings = _ranks_and_settings(rows, block_m)
    width, tallest = 0.8 / len(settings), REGISTER_CAP
    labelled = set()

    def once(label):                                   # each legend entry once
        if label in labelled:
            return None
        labelled.add(label)
        return label

    for s, mbr in enumerate(settings):
        style = TILING_STYLE.get(mbr, dict(color=f"C{s + 2}", label=f"max BLOCK_R = {mbr}"))
        for row in register_rows(rows, block_m=block_m, max_block_r=mbr):
            x = ranks.index(row["rank"]) + (s - (len(settings) - 1) / 2) * width
            ax.bar(x, row["n_regs"], width * 0.92, color=style["color"], label=once(style["label"]))
            tallest = max(tallest, row["n_regs"] + row["n_spills"])
            if row["n_spills"]:
                ax.bar(x, row["n_spills"], width * 0.92, bottom=row["n_regs"], **SPILL_STYLE,
                       label=once("spilled to local memory"))
                ax.annotate(f"+{row['n_spills']}", (x, row["n_regs"] + row["n_spills"]), ha="center",
                            va="bottom", fontsize=9, color="#d62728", xytext=(0, 2), textcoords="offset points")
            if show_prediction:
                pred = accumulator_registers(block_m, rank_tile(row["rank"], mbr)[0], row["num_warps"])
                ax.plot([x - width * 0.45, x + width * 0.45], [pred, pred], color="black", lw=2,
                        label=once("fp32 T tile alone: BLOCK_M·BLOCK_R / threads"))
    ax.axhline(REGISTER_CAP, color="#d62728", linestyle="--", lw=1.2, label=f"cap: {REGISTER_CAP} registers per thread")
    ax.set_ylim(0, max(ax.get_ylim()[1], tallest * 1.1))                # room for the spill labels
    ax.set_xticks(range(len(ranks)), [str(r) for r in ranks])
    ax.set_xlabel("LoRA rank r")
    ax.set_ylabel("32-bit registers per thread")
    ax.set_title(f"BLOCK_M = {block_m}: registers and spills", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    if legend:
        ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.02, 1))


def draw_occupancy_vs_rank(ax, rows, *, block_m: int, legend: bool = True) -> None:
    """Resident blocks per SM against rank, with and without rank tiling (right axis: % of warp slots)."""
    _check_ax(ax)
    rows = _check_rows(rows, REGISTER_KEYS, "registers.csv")
    ranks, settings = _ranks_and_settings(rows, block_m)
    warps = next(r["num_warps"] for r in rows if r["block_m"] == block_m)
    for s, mbr in enumerate(settings):
        style = TILING_STYLE.get(mbr, dict(color=f"C{s + 2}", label=f"max BLOCK_R = {mbr}"))
        sel = register_rows(rows, block_m=block_m, max_block_r=mbr)
        ax.plot([ranks.index(r["rank"]) for r in sel], [r["blocks_per_sm"] for r in sel], color=style["color"],
                label=style["label"], marker="os"[s % 2], markersize=9 - 3 * (s % 2),
                linestyle="-" if s == 0 else ":", lw=2)
    ax.set_xticks(range(len(ranks)), [str(r) for r in ranks])
    ax.set_ylim(0, None)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("LoRA rank r")
    ax.set_ylabel(f"resident blocks per SM ({warps} warps each)")
    sec = ax.secondary_yaxis("right", functions=(lambda b: b * warps / WARPS_PER_SM * 100,
                                                 lambda p: p * WARPS_PER_SM / warps / 100))
    sec.set_ylabel("occupancy (% of 64 warp slots)")
    ax.set_title(f"BLOCK_M = {block_m}: occupancy", fontsize=10)
    ax.grid(True, alpha=0.3)
    if legend:
        ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.12, 1))


def auto_path(preset: str, op: str, M: int, rank: int, num_loras: int) -> str:
    """The path ``path="auto"`` runs now for the benchmark's LoRA op at (preset, op, M, rank): the current
    rule (:func:`moelora_lab.op.paths.resolve_path`) with the arguments ``bench kernels`` passes it."""
    check_choice("op", op, ("w13", "w2"))
    shape = MoEShape.from_name(preset)
    return resolve_path("auto", num_pairs=check_int("M", M, low=1) * shape.top_k, num_experts=shape.num_experts,
                        num_loras=check_int("num_loras", num_loras, low=1), rank=check_int("rank", rank, low=1),
                        add_inputs=True, token_rows=op == "w13", n_out=shape.op_dims(op)[1])


def draw_time_vs_rank(ax, rows, *, preset: str, op: str, M: int, paths=("one_shot", "two_kernel"),
                      show_auto: bool = True, legend: bool = True) -> None:
    """Measured median µs (p20-p80 band) of each path against rank at one (preset, op, M); rings
    mark the path the current ``auto`` rule picks (:func:`auto_path`), on that path's measurement."""
    _check_ax(ax)
    check_choice("op", op, ("w13", "w2"))
    sel = _pick(_pick(_check_rows(rows, TIME_KEYS, "kernels.csv"), "preset", preset, "preset"), "op", op, "op")
    sel = _pick(sel, "M", check_int("M", M, low=1), "M")
    for path in paths:
        pts = sorted((r for r in sel if r["path"] == path), key=lambda r: r["rank"])
        if not pts:
            raise ValueError(f"paths: no rows for path {path!r} at {preset} {op} M={M}")
        plot_band(ax, pts, dict(PATH_STYLE.get(path, dict(label=path)), lw=2), x="rank")
    ranks = sorted({r["rank"] for r in sel})
    if show_auto:
        picked = []
        for rank in ranks:
            row = next(r for r in sel if r["rank"] == rank)
            want = auto_path(preset, op, M, rank, row["loras"])
            picked += [r for r in sel if r["rank"] == rank and r["path"] == want and want in paths][:1]
        ax.scatter([r["rank"] for r in picked], [r["us_median"] for r in picked], s=180, facecolors="none",
                   edgecolors="black", linewidths=1.3, zorder=5, label='path="auto" picks (current rule)')
    ax.set_xscale("log", base=2)
    ax.set_xticks(ranks, [str(r) for r in ranks])
    ax.minorticks_off()
    ax.set_ylim(0, None)
    ax.set_xlabel("LoRA rank r")
    ax.set_ylabel("µs per call (median, p20–p80)")
    ax.set_title(f"{preset} {op}, M = {M}", fontsize=10)
    ax.grid(True, alpha=0.3)
    if legend:
        ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.02, 1))


def _warp_grid(block_m: int, num_warps: int) -> tuple[int, int]:
    """(warps along rows, warps along columns): 16-row slabs first, as tensor-core layouts do."""
    wm = max(1, min(num_warps, block_m // 16))
    return wm, num_warps // wm


def _gauge_ticks(g_max: float) -> list[int]:
    step = 64 if g_max <= 520 else 128
    return sorted({*range(0, int(g_max) + 1, step)} - {256} | {REGISTER_CAP})


def _bar_label(ax, end: float, y: float, text: str, g_max: float) -> None:
    """The value at the end of a gauge bar: outside it, or inside on white where the axis ends."""
    inside = end > 0.72 * g_max
    ax.text(end - 0.01 * g_max if inside else end + 0.01 * g_max, y, text, ha="right" if inside else "left",
            va="center", fontsize=9, bbox=dict(facecolor="white", edgecolor="none", pad=1) if inside else None)


def draw_register_tile(ax, block_m: int, rank: int, *, max_block_r: int = 128, num_warps: int = 4,
                       n_regs: int | None = None, n_spills: int = 0, measured_label: str = "compiled kernel",
                       registers_max: int | None = None) -> None:
    """The rank r of one program as the launcher tiles it and what its fp32 T tile costs a thread.

    Top: the r rank columns split into RANK_TILES tiles of [BLOCK_M, BLOCK_R] (:func:`rank_tile`),
    padded columns past r hatched; the first tile split over the warps (schematic layout), the later
    ones dashed: they reuse the same registers one after another. Bottom: a numbered axis of 32-bit
    registers per thread with the 255 cap, the T tile alone and, if ``n_regs`` is given, the compiled
    kernel's registers (+ ``n_spills`` spilled, hatched) at their values, up to ``registers_max``
    (default: what the bars need; give the same to panels that should compare)."""
    _check_ax(ax)
    bm = _check_pow2("block_m", block_m, 16, 256)
    rank = check_int("rank", rank, low=1, high=1024)
    mbr = _check_pow2("max_block_r", max_block_r, 16, 1024)
    nw = _check_pow2("num_warps", num_warps, 1, 32)
    if n_regs is not None:
        check_int("n_regs", n_regs, low=0)
    spills = check_int("n_spills", n_spills, low=0)
    if registers_max is not None:
        check_int("registers_max", registers_max, low=REGISTER_CAP)
    br, tiles = rank_tile(rank, mbr)
    threads, regs = THREADS_PER_WARP * nw, accumulator_registers(bm, br, nw)
    span = tiles * br                                                 # columns the tiles cover
    r_max, x0, W, top = max(512, span), 0.17, 0.8, 0.86
    col = lambda c: x0 + W * c / r_max                                # noqa: E731  rank column -> x
    h, w = 0.3 * bm / max(64, bm), col(br) - x0
    for c in range(0, r_max + 1, 128):                                # rank-column ruler
        ax.plot([col(c)] * 2, [top + 0.005, top + 0.025], color="gray", lw=1)
        ax.text(col(c), top + 0.03, str(c), ha="center", va="bottom", fontsize=9, color="#444")
    ax.text(x0 - 0.01, top + 0.03, "rank column", ha="right", va="bottom", fontsize=9, color="#444")
    wm, wn = _warp_grid(bm, nw)
    colors = plt.get_cmap("Pastel1").colors
    cw, ch = w / wn, h / wm
    for i in range(wm):
        for j in range(wn):
            n, cx, cy = i * wn + j, x0 + j * cw, top - (i + 1) * ch
            ax.add_patch(Rectangle((cx, cy), cw, ch, facecolor=colors[n % 8], edgecolor="#555"))
            label = (f"warp {n}: 32 threads × {regs} registers" if cw > 0.42 else f"warp {n}" if cw > 0.09
                     else f"w{n}" if cw > 0.035 else "")
            if label and ch > 0.035:
                ax.text(cx + cw / 2, cy + ch / 2, label, ha="center", va="center", fontsize=9)
    for t in range(1, tiles):                                         # later rank tiles: same registers
        ax.add_patch(Rectangle((col(t * br), top - h), w, h, facecolor="#f2f2f2", edgecolor="#777", ls="--"))
        if w > 0.06:
            mid = (col(t * br) + col(min(rank, (t + 1) * br))) / 2
            ax.text(mid, top - h / 2, f"tile {t + 1}", ha="center", va="center", fontsize=9, color="#555")
    if span > rank:                                                   # padded columns (masked loads)
        ax.add_patch(Rectangle((col(rank), top - h), col(span) - col(rank), h, fill=False, hatch="//",
                               edgecolor="#999", lw=0))
    ax.add_patch(Rectangle((x0, top - h), w, h, fill=False, edgecolor="black", lw=2))
    ax.text(x0 - 0.01, top - h / 2, f"BLOCK_M = {bm}", ha="right", va="center", fontsize=9)
    later = "tile 2 reuses them after it" if tiles == 2 else f"tiles 2–{tiles} reuse them in turn"
    what = (f"{tiles} rank tiles of BLOCK_R = {br}: tile 1 is in registers, {later}" if tiles > 1
            else f"1 rank tile of BLOCK_R = {br} columns")
    pad = f"; hatched: padding past r = {rank}" if span > rank else ""
    ax.text(x0, 0.535, what + pad, ha="left", va="top", fontsize=9)
    ax.text(x0, 0.465, f"T tile: {bm}×{br} fp32 = {bm * br:,} values / {threads} threads = {regs} "
            "registers per thread", ha="left", va="top", fontsize=10, weight="bold")
    total = (n_regs or 0) + spills
    g_max = max(REGISTER_CAP * 1.15, regs, total, registers_max or 0) * 1.04
    g = ax.inset_axes([x0, 0.14, W, 0.17 if n_regs is not None else 0.09])
    bars = [(1, "T tile alone")] + ([(0, measured_label)] if n_regs is not None else [])
    g.barh(1, min(regs, REGISTER_CAP), height=0.6, color="#1f77b4")
    if regs > REGISTER_CAP:
        g.barh(1, regs - REGISTER_CAP, left=REGISTER_CAP, height=0.6, **SPILL_STYLE)
    _bar_label(g, regs, 1, str(regs) + (" (over the cap)" if regs > REGISTER_CAP else ""), g_max)
    if n_regs is not None:
        g.barh(0, n_regs, height=0.6, color="#555555")
        if spills:
            g.barh(0, spills, left=n_regs, height=0.6, **SPILL_STYLE)
        _bar_label(g, total, 0, f"{n_regs}" + (f" + {spills} spilled" if spills else ""), g_max)
    g.axvline(REGISTER_CAP, color="#d62728", lw=2)
    g.text(REGISTER_CAP, 1.03, f"cap: {REGISTER_CAP} per thread", transform=g.get_xaxis_transform(), ha="center",
           va="bottom", fontsize=9, color="#d62728")
    ticks = _gauge_ticks(g_max)
    g.set_xticks(ticks, [str(t) for t in ticks], fontsize=9)
    g.get_xticklabels()[ticks.index(REGISTER_CAP)].set_color("#d62728")
    g.set_yticks([y for y, _ in bars], [name for _, name in bars], fontsize=9)
    g.set_xlim(0, g_max)
    g.set_ylim(min(y for y, _ in bars) - 0.5, 1.5)
    hatched = [what for what, drawn in (("past the cap", regs > REGISTER_CAP), ("spilled", spills > 0)) if drawn]
    g.set_xlabel(f"32-bit registers per thread (cap {REGISTER_CAP} in red"
                 + (f"; hatched: {' / '.join(hatched)})" if hatched else ")"), fontsize=9)
    g.spines[["top", "right"]].set_visible(False)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.axis("off")
    ax.set_title(f"r = {rank}, BLOCK_M = {bm}, {nw} warps, rank tiles of at most {mbr} columns", fontsize=10)
