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

from ..validate import check_choice, check_int, check_rows
from ..dispatch import KernelConfig
from ..profile.report import WARPS_PER_SM
from .bench import PATH_STYLE, plot_band

REGISTER_CAP = 255        # 32-bit registers one thread may hold (NVIDIA, sm_50 and later)
THREADS_PER_WARP = 32
REGISTER_KEYS = ("rank", "block_m", "max_block_r", "n_regs", "n_spills", "blocks_per_sm", "num_warps")
TIME_KEYS = ("preset", "op", "path", "M", "rank", "us_median", "us_p20", "us_p80")
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


def draw_registers_vs_rank(ax, rows, *, block_m: int, show_prediction: bool = True) -> None:
    """Registers per thread (bar) and spilled registers (hatched, on top) per rank, with and
    without rank tiling; the 255-register cap as a line; the fp32 T tile alone as black ticks."""
    _check_ax(ax)
    rows = _check_rows(rows, REGISTER_KEYS, "registers.csv")
    ranks, settings = _ranks_and_settings(rows, block_m)
    width = 0.8 / len(settings)
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
            if row["n_spills"]:
                ax.bar(x, row["n_spills"], width * 0.92, bottom=row["n_regs"], **SPILL_STYLE,
                       label=once("spilled to local memory"))
                ax.annotate(f"+{row['n_spills']}", (x, row["n_regs"] + row["n_spills"]), ha="center",
                            va="bottom", fontsize=7, color="#d62728", xytext=(0, 2), textcoords="offset points")
            if show_prediction:
                pred = accumulator_registers(block_m, rank_tile(row["rank"], mbr)[0], row["num_warps"])
                ax.plot([x - width * 0.45, x + width * 0.45], [pred, pred], color="black", lw=2,
                        label=once("fp32 T tile alone: BLOCK_M·BLOCK_R / threads"))
    ax.axhline(REGISTER_CAP, color="#d62728", linestyle="--", lw=1.2, label=f"cap: {REGISTER_CAP} registers per thread")
    ax.set_xticks(range(len(ranks)), [str(r) for r in ranks])
    ax.set_xlabel("LoRA rank r")
    ax.set_ylabel("32-bit registers per thread")
    ax.set_title(f"One-shot kernel, BLOCK_M = {block_m}: registers and spills")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")


def draw_occupancy_vs_rank(ax, rows, *, block_m: int) -> None:
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
    ax.set_title(f"One-shot kernel, BLOCK_M = {block_m}: occupancy")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def draw_time_vs_rank(ax, rows, *, preset: str, op: str, M: int, paths=("one_shot", "two_kernel"),
                      show_auto: bool = True) -> None:
    """Measured median µs (p20-p80 band) of each path against rank at one (preset, op, M);
    rings mark what ``path="auto"`` ran."""
    _check_ax(ax)
    check_choice("op", op, ("w13", "w2"))
    sel = _pick(_pick(_check_rows(rows, TIME_KEYS, "kernels.csv"), "preset", preset, "preset"), "op", op, "op")
    sel = _pick(sel, "M", check_int("M", M, low=1), "M")
    for path in paths:
        pts = sorted((r for r in sel if r["path"] == path), key=lambda r: r["rank"])
        if not pts:
            raise ValueError(f"paths: no rows for path {path!r} at {preset} {op} M={M}")
        plot_band(ax, pts, dict(PATH_STYLE.get(path, dict(label=path)), lw=2), x="rank")
    auto = sorted((r for r in sel if r["path"] == "auto"), key=lambda r: r["rank"])
    if show_auto and auto:
        ax.scatter([r["rank"] for r in auto], [r["us_median"] for r in auto], s=180, facecolors="none",
                   edgecolors="black", linewidths=1.3, zorder=5, label='path="auto" (what the dispatcher ran)')
    ranks = sorted({r["rank"] for r in sel})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ranks, [str(r) for r in ranks])
    ax.minorticks_off()
    ax.set_ylim(0, None)
    ax.set_xlabel("LoRA rank r")
    ax.set_ylabel("time per call (µs, median; band p20–p80)")
    gpu = sel[0].get("gpu")
    ax.set_title(f"{preset} {op}, M = {M} tokens" + (f" ({gpu})" if gpu else ""))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def _warp_grid(block_m: int, num_warps: int) -> tuple[int, int]:
    """(warps along rows, warps along columns): 16-row slabs first, as tensor-core layouts do."""
    wm = max(1, min(num_warps, block_m // 16))
    return wm, num_warps // wm


def draw_register_tile(ax, block_m: int, block_r: int, num_warps: int = 4, *, n_regs: int | None = None,
                       n_spills: int = 0) -> None:
    """The fp32 [block_m, block_r] T tile split over the warps of one program (schematic layout),
    and a gauge of registers per thread: the tile alone, where each BLOCK_R lands, the 255 cap and,
    if given, the measured registers (+ spills) of the whole compiled kernel."""
    _check_ax(ax)
    bm = _check_pow2("block_m", block_m, 16, 256)
    br = _check_pow2("block_r", block_r, 16, 1024)
    nw = _check_pow2("num_warps", num_warps, 1, 32)
    if n_regs is not None:
        check_int("n_regs", n_regs, low=0)
    spills = check_int("n_spills", n_spills, low=0)
    threads, regs = THREADS_PER_WARP * nw, accumulator_registers(bm, br, nw)
    r_max, x0, W, top = max(512, br), 0.08, 0.88, 0.88
    w, h = W * br / r_max, 0.34 * bm / max(64, bm)
    wm, wn = _warp_grid(bm, nw)
    colors = plt.get_cmap("Pastel1").colors
    for i in range(wm):
        for j in range(wn):
            cw, ch = w / wn, h / wm
            cx, cy = x0 + j * cw, top - (i + 1) * ch
            ax.add_patch(Rectangle((cx, cy), cw, ch, facecolor=colors[(i * wn + j) % 8], edgecolor="#555"))
            n = i * wn + j
            label = f"warp {n}: 32 threads × {regs} regs" if cw > 0.33 else f"warp {n}" if cw > 0.08 else f"w{n}"
            if cw > 0.03 and ch > 0.03:
                ax.text(cx + cw / 2, cy + ch / 2, label, ha="center", va="center", fontsize=7)
    ax.add_patch(Rectangle((x0, top - h), w, h, fill=False, edgecolor="black", lw=1.5))
    for c in range(0, r_max + 1, 128):                               # column ruler
        ax.plot([x0 + W * c / r_max] * 2, [top + 0.01, top + 0.03], color="gray", lw=1)
        ax.text(x0 + W * c / r_max, top + 0.035, str(c), ha="center", va="bottom", fontsize=7, color="gray")
    ax.text(x0 - 0.01, top - h / 2, f"BLOCK_M\n= {bm}", ha="right", va="center", fontsize=8)
    ax.text(x0 + w / 2, top - h - 0.02, f"BLOCK_R = {br} rank columns", ha="center", va="top", fontsize=8)
    ax.text(x0, top - h - 0.09, f"{bm}×{br} fp32 = {bm * br:,} values / {threads} threads = {regs} registers "
            "per thread", ha="left", va="top", fontsize=9, weight="bold")
    g_max = max(320, regs * 1.1, ((n_regs or 0) + spills) * 1.05)
    gx = lambda v: x0 + W * v / g_max                               # noqa: E731  gauge position
    gy, gh = 0.2, 0.07
    ax.add_patch(Rectangle((x0, gy), W, gh, facecolor="#f0f0f0", edgecolor="#999"))
    ax.add_patch(Rectangle((x0, gy), gx(min(regs, REGISTER_CAP)) - x0, gh, facecolor="#1f77b4", alpha=0.85))
    if regs > REGISTER_CAP:
        ax.add_patch(Rectangle((gx(REGISTER_CAP), gy), gx(regs) - gx(REGISTER_CAP), gh, **SPILL_STYLE))
    shown = {br: gx(regs)} if regs <= g_max else {}
    for b in (512, 256, 128, 64, 32, 16):                            # where each BLOCK_R would land
        v = gx(accumulator_registers(bm, b, nw))
        if v <= x0 + W and all(abs(v - u) > 0.06 for u in shown.values()):
            shown[b] = v
    for b, v in shown.items():
        ax.plot([v] * 2, [gy + gh, gy + gh + 0.015], color="black", lw=1)
        ax.text(v, gy + gh + 0.02, f"R={b}", ha="center", va="bottom", fontsize=7, weight="bold" if b == br else None)
    ax.plot([gx(REGISTER_CAP)] * 2, [gy - 0.02, gy + gh + 0.01], color="#d62728", lw=2)
    ax.text(gx(REGISTER_CAP) + 0.005, gy - 0.025, f"cap: {REGISTER_CAP} per thread", color="#d62728",
            ha="left", va="top", fontsize=8)
    if n_regs is not None:
        if spills:
            ax.add_patch(Rectangle((gx(n_regs), gy + gh * 0.3), gx(n_regs + spills) - gx(n_regs), gh * 0.4,
                                   **SPILL_STYLE))
        ax.plot([gx(n_regs)], [gy - 0.085], marker="^", color="black", markersize=8)
        ax.text(gx(n_regs), gy - 0.115, f"compiled kernel: {n_regs}" + (f" + {spills} spilled" if spills else ""),
                ha="center" if gx(n_regs) < 0.75 else "right", va="top", fontsize=8)
    ax.text(x0, 0.0, f"registers per thread, 0 … {int(g_max)}: blue = the T tile alone, "
            "hatched = over the cap (spilled)", ha="left", va="bottom", fontsize=7, color="#555")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.axis("off")
    ax.set_title(f"T tile in registers: fp32 [{bm}, {br}], {nw} warps (schematic layout)", fontsize=10)
