"""Drawing benchmark results (rows of the CSVs under ``moelora_lab/data``).

Pure functions ``draw_*(ax, rows, **params)``: they read rows (dicts as written by
``moelora_lab.bench``) and draw on the Axes they are given.
"""
from __future__ import annotations

from pathlib import Path

PATH_STYLE = {
    "two_kernel": dict(color="#d62728", marker="s", label="two-kernel (T in HBM)"),
    "one_shot": dict(color="#1f77b4", marker="o", label="one-shot (T in registers)"),
    "small_batch": dict(color="#2ca02c", marker="^", label="small-batch (GEMV)"),
    "auto": dict(color="black", marker="", linestyle=":", label="auto (dispatcher)"),
    "gather_bmm": dict(color="#7f7f7f", marker="x", label="gather + bmm (PyTorch, modelled)"),
}


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


def draw_roofline(ax, rows, *, peak_tflops=790.0, bandwidth_tbps=None, label_key="path"):
    """Achieved TFLOP/s against arithmetic intensity (FLOP/byte of the byte model), under the ceilings."""
    if bandwidth_tbps is None:
        bws = [r["copy_tbps"] for r in rows if r.get("copy_tbps")]
        bandwidth_tbps = bws[0] if bws else 4.3
    xs = [0.1, 1e4]
    ridge = peak_tflops / bandwidth_tbps
    ax.plot([xs[0], ridge, xs[1]], [bandwidth_tbps * xs[0], peak_tflops, peak_tflops], color="black", lw=1.5,
            label=f"ceilings: {bandwidth_tbps:.2f} TB/s copy, {peak_tflops:.0f} TFLOP/s bf16")
    for key in sorted({r[label_key] for r in rows}):
        sel = [r for r in rows if r[label_key] == key and r["bytes"] and r["us_median"]]
        if not sel:
            continue
        style = PATH_STYLE.get(key, {})
        ax.scatter([r["flops"] / r["bytes"] for r in sel],
                   [r["flops"] / (r["us_median"] * 1e-6) / 1e12 for r in sel],
                   s=14, alpha=0.7, color=style.get("color"), marker=style.get("marker") or "o",
                   label=style.get("label", key))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte, byte model)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def save_kernel_plots(rows, out_dir, name="kernels"):
    """One PNG per preset (ops x ranks of time-vs-M panels) and a roofline PNG; returns the paths."""
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
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    draw_roofline(ax, [r for r in timed if r["path"] != "auto"])
    ax.set_title(f"Roofline: every path, every case ({timed[0]['gpu']})")
    written.append(_save(fig, out_dir / f"{name}_roofline.png"))
    return written


def gemm_tile_table(rows) -> list[dict]:
    """Per (op, M, LoRA rank) of ``gemm_tune.csv``: the tiles of the rule when the sweep ran, of
    ``moe.gemm_tiles`` now, and the best of the grid (µs and tiles), for the tiles that ran."""
    from ..config import MoEShape
    from ..moe import gpu_gemm_tiles

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
