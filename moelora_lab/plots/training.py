"""Training pictures: the backward's bytes against its floor, and the loss curves of adapters trained together
next to PEFT training each one alone.

Shape legend: M tokens, k top-k, E experts, L adapters, r rank, K in, N out, S slices, P = M*k pairs.

``grad_traffic_table`` evaluates the backward's byte model (``profile.grad_traffic``) per M and path on the
routing the benchmarks draw (``config.benchmark_routing``), with the block size the launcher picks on a GPU;
``extra_groups`` sorts what a path moves beyond the floor by what causes it. The ``draw_*`` functions draw on
the Axes they are given and return None. Every number here is a byte count of the model, not a measurement.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..config import benchmark_routing
from ..op.dispatch import gpu_config
from ..profile.grad_traffic import GRAD_TRAFFIC_PATHS, GradTraffic, GradWorkload, grad_op_traffic
from ..validate import check_choice, check_int, check_rows
from .bench import PATH_STYLE, check_ax, tokens_axis
from .traffic import OPS, _shape, op_dims

# what a backward path moves beyond the floor, by cause: (group, the parts of grad_op_traffic in it)
EXTRA_GROUPS = (
    ("x and dY read again", ("x", "grad_out", "topk_weights")),
    ("T and dT through HBM", ("t_write", "dt_write", "t_read", "dt_read")),
    ("dx pair rows", ("dx_rows_zero", "dx_rmw_read", "dx_rmw_write", "dx_rows_sum")),
    ("dA, dB slabs again", ("da_rmw_read", "da_rmw_write", "db_rmw_read", "db_rmw_write")),
    ("dw read and written again", ("dw_rmw_read", "dw_rmw_write")),
)
GROUP_COLORS = ("#9ecae1", "#fb6a4a", "#fdae6b", "#74c476", "#bcbddc")
FLOOR_COLOR = "#bdbdbd"
GPU_SMS = 132                   # an H100's or H200's SMs: gpu_config's block size does not depend on them
GRAD_PATH_STYLE = dict(PATH_STYLE, one_shot_atomic=dict(color="#9467bd", marker="^",
                                                          label="one-shot, atomics (not deterministic)"))
CURVE_MARKERS = ("o", "x", "s", "^")


def extra_groups(traffic: GradTraffic) -> dict[str, int]:
    """{group of EXTRA_GROUPS: bytes}: what ``traffic`` moves beyond its floor, by cause (groups it does not
    touch are 0; a part no group names goes to "other", so the values always sum to ``traffic.extra``)."""
    if not isinstance(traffic, GradTraffic):
        raise TypeError(f"traffic: expected a GradTraffic (grad_op_traffic(...)), got {type(traffic).__name__}")
    extra = traffic.extra_parts()
    out = {group: sum(extra.pop(p, 0) for p in parts) for group, parts in EXTRA_GROUPS}
    out["other"] = sum(extra.values())
    return out


def grad_traffic_table(shape, rank: int, tokens, *, op: str = "w13", num_loras: int = 4, dtype_bytes: int = 2,
                       paths=GRAD_TRAFFIC_PATHS, seed: int = 0) -> list[dict]:
    """Byte-model rows of the LoRA op's backward, one per (M, path): ``floor`` (what every backward moves),
    ``bytes`` (what the path moves), ``extra``, ``ratio`` = bytes / floor, the bytes of each group of
    :data:`EXTRA_GROUPS`, ``block_m`` and the ``GradTraffic`` itself.

    The routing is the benchmarks' (``benchmark_routing``: L adapters, no token without one), its blocks
    of the size the launcher picks on a GPU (``gpu_config``); op 'w13' (token rows, 2 slices) or 'w2' (pair
    rows, 1 slice, the routing weights in); x, A, B and dY of ``dtype_bytes`` each, gradients in float32.
    """
    shape = _shape(shape)
    R = check_int("rank", rank, low=1)
    check_choice("op", op, OPS)
    L = check_int("num_loras", num_loras, low=1)
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence) or not tokens:
        raise TypeError(f"tokens: expected a non-empty list of ints, got {tokens!r}")
    for p in paths:
        check_choice("paths[i]", p, GRAD_TRAFFIC_PATHS)
    dims = op_dims(shape, op)
    k, E = shape.top_k, shape.num_experts
    rows = []
    for m in tokens:
        check_int("tokens[i]", m, low=1)
        routing = benchmark_routing(shape, L, m, seed=seed)
        P = m * k
        block_m = gpu_config("two_kernel", P, min(P, L * E), dims["out_features"], dims["num_slices"], GPU_SMS,
                             rank=R).block_m
        wl = GradWorkload.from_routing(routing["topk_ids"], routing["token_lora"], E, L, block_m)
        for path in paths:
            t = grad_op_traffic(path, wl, rank=R, dtype_bytes=dtype_bytes, mul_routed_weight=op == "w2", **dims)
            rows.append(dict(preset=shape.name, op=op, rank=R, M=m, path=path, block_m=block_m,
                             floor=t.floor.bytes, bytes=t.total.bytes, extra=t.extra,
                             ratio=t.total.bytes / t.floor.bytes, **extra_groups(t), traffic=t))
    return rows


def draw_grad_traffic(ax, rows, *, title: str | None = None) -> None:
    """Bytes moved over the floor against M, one line per path of ``rows`` (``grad_traffic_table``); the floor
    itself is the dotted line at 1. The legend sits inside, upper left."""
    check_ax(ax)
    rows = check_rows("rows", rows, ("M", "path", "ratio"))
    for path in [p for p in GRAD_PATH_STYLE if any(r["path"] == p for r in rows)]:
        sel = sorted((r for r in rows if r["path"] == path), key=lambda r: r["M"])
        style = GRAD_PATH_STYLE[path]
        ax.plot([r["M"] for r in sel], [r["ratio"] for r in sel], color=style["color"], marker=style["marker"],
                label=style["label"])
    tokens_axis(ax)                          # before the floor's line: it reads the M ticks off the lines
    ax.axhline(1.0, color="gray", linestyle=":", linewidth=1.2, label="the floor")
    ax.set_ylabel("bytes moved / the floor")
    ax.set_ylim(0, max(r["ratio"] for r in rows) * 1.1)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=9, loc="upper left")
    if title:
        ax.set_title(title)


def draw_extra_breakdown(ax, rows, *, M: int, legend: bool = True) -> None:
    """One stacked bar per path at ``M`` tokens (rows of ``grad_traffic_table``): the floor (grey), then what the
    path adds, by group; MB on the y axis, the ratio to the floor above each bar; the legend outside, right."""
    check_ax(ax)
    rows = check_rows("rows", rows, ("M", "path", "floor", "bytes") + tuple(g for g, _ in EXTRA_GROUPS))
    sel = [r for r in rows if r["M"] == M]
    if not sel:
        raise ValueError(f"M: no rows at M = {M}; the rows hold M = {sorted({r['M'] for r in rows})}")
    sel.sort(key=lambda r: list(GRAD_PATH_STYLE).index(r["path"]) if r["path"] in GRAD_PATH_STYLE else 99)
    xs = range(len(sel))
    bottom = [r["floor"] / 1e6 for r in sel]
    ax.bar(xs, bottom, color=FLOOR_COLOR, width=0.6, label="the floor")
    for (group, _), color in zip(EXTRA_GROUPS, GROUP_COLORS):
        heights = [r[group] / 1e6 for r in sel]
        if any(heights):
            ax.bar(xs, heights, bottom=bottom, color=color, width=0.6, label=group)
            bottom = [b + h for b, h in zip(bottom, heights)]
    for i, r in enumerate(sel):
        ax.annotate(f"{r['bytes'] / r['floor']:.2g}x", (i, r["bytes"] / 1e6), xytext=(0, 3),
                    textcoords="offset points", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(xs), [GRAD_PATH_STYLE.get(r["path"], {}).get("label", r["path"]).replace(" (", "\n(")
                             .replace(", ", ",\n") for r in sel], fontsize=9)
    ax.set_ylabel("HBM bytes per backward (MB)")
    ax.set_ylim(0, max(r["bytes"] for r in sel) / 1e6 * 1.15)
    ax.set_title(f"at M = {M}: the floor, and what each path adds to it")
    ax.grid(True, axis="y", alpha=0.3)
    if legend:
        ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1))


def _curves(name: str, value) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=torch.float64)
    if t.ndim != 2 or t.shape[1] < 1:
        raise ValueError(f"{name}: expected [L, steps] losses (TrainRun.curves), got shape {tuple(t.shape)}")
    return t


def draw_loss_curves(ax, alone, together: Mapping, *, log: bool = True) -> None:
    """Each adapter's loss against the optimizer step: ``alone`` [L, steps] (PEFT training each adapter alone) as
    lines, one colour per adapter; ``together`` {label: [L, s] curves} (joint runs, s <= steps) as markers on
    them, one marker per label. ``log``: a log y axis."""
    check_ax(ax)
    base = _curves("alone", alone)
    if not isinstance(together, Mapping) or not together:
        raise TypeError("together: expected a non-empty dict {label: [L, steps] curves}")
    if len(together) > len(CURVE_MARKERS):
        raise ValueError(f"together: at most {len(CURVE_MARKERS)} runs can be told apart, got {len(together)}")
    L, steps = base.shape
    colors = [f"C{l % 10}" for l in range(L)]
    for l in range(L):
        ax.plot(range(steps), base[l].tolist(), color=colors[l], linewidth=2, label=f"adapter {l}: PEFT, alone")
    for (label, curves), marker in zip(together.items(), CURVE_MARKERS):
        c = _curves(f"together[{label!r}]", curves)
        if c.shape[0] != L or c.shape[1] > steps:
            raise ValueError(f"together[{label!r}]: shape {tuple(c.shape)}; expected [{L}, at most {steps}] like alone")
        for l in range(L):
            ax.plot(range(c.shape[1]), c[l].tolist(), linestyle="none", marker=marker, markersize=6,
                    markerfacecolor="none" if marker in "os^" else colors[l], color=colors[l],
                    label=f"adapter {l}: {label}")
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("the adapter's mean loss on its tokens")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1))


def grad_time_lines(rows) -> list[str]:
    """``bench grad``'s rows as text: one line per (op, r, M), each path's median µs and the path ``auto`` ran."""
    by: dict = {}
    for r in rows:
        by.setdefault((r["op"], r["rank"], r["M"]), {})[r["path"]] = r
    paths = [p for p in (*GRAD_TRAFFIC_PATHS, "auto") if any(p in v for v in by.values())]
    lines = [f"{'op':4s} {'r':>3s} {'M':>6s}" + "".join(f"{p + ' µs':>20s}" for p in paths) + "   auto ran"]
    for (op, rank, m), v in sorted(by.items()):
        times = "".join(f"{v[p]['us_median']:20.1f}" if p in v else " " * 20 for p in paths)
        lines.append(f"{op:4s} {rank:3d} {m:6d}{times}   {v['auto']['ran'] if 'auto' in v else '-'}")
    return lines


def train_time_lines(rows) -> list[str]:
    """``bench train``'s rows as text: one line per (r, M), the lab's step with LoRA against HF + PEFT's (median
    ms, their ratio) and each one's peak memory (MiB); '-' where a variant is missing or failed."""
    by: dict = {}
    for r in rows:
        if not r.get("error"):
            by.setdefault((r["rank"], r["M"]), {})[r["variant"]] = r
    lines = [f"{'r':>3s} {'M':>6s} {'lab ms':>9s} {'HF+PEFT ms':>11s} {'lab / HF':>9s} {'lab MiB':>9s} {'HF MiB':>9s}"]
    for (rank, m), v in sorted(by.items()):
        lab, hf = v.get("lab_lora"), v.get("hf_peft")

        def ms(row):
            return f"{row['us_median'] / 1e3:.2f}" if row else "-"

        def mib(row):
            return f"{row['peak_mib']:.0f}" if row and row.get("peak_mib") not in ("", None) else "-"
        ratio = f"{lab['us_median'] / hf['us_median']:.2f}" if lab and hf else "-"
        lines.append(f"{rank:3d} {m:6d} {ms(lab):>9s} {ms(hf):>11s} {ratio:>9s} {mib(lab):>9s} {mib(hf):>9s}")
    return lines


def grad_reading(rows) -> str:
    """What ``bench grad``'s rows say of ``auto``'s pick, as a sentence: in how many (op, r, M) cases it ran the
    fastest of the paths timed beside it, and where it did not, how much longer it took than the fastest."""
    by: dict = {}
    for r in rows:
        by.setdefault((r["op"], r["rank"], r["M"]), {})[r["path"]] = r
    missed = []
    cases = [(key, v) for key, v in sorted(by.items()) if "auto" in v and len(v) > 1]
    for (op, rank, m), v in cases:
        best = min((p for p in v if p != "auto"), key=lambda p: v[p]["us_median"])
        if v["auto"]["ran"] != best:
            missed.append(f"{op} r {rank} M {m}: {v['auto']['ran']} for {best}, "
                          f"{v['auto']['us_median'] / v[best]['us_median']:.2f}x its time")
    if not cases:
        return "no case times auto beside the paths"
    head = f"auto ran the fastest path in {len(cases) - len(missed)} of {len(cases)} cases"
    return head + (": " + "; ".join(missed) if missed else "")


def train_reading(rows) -> str:
    """What ``bench train``'s rows say of the lab's training step with LoRA against HF + PEFT's, as a sentence:
    the range of its time and of its peak memory as a fraction of theirs, over the cases where both ran."""
    by: dict = {}
    for r in rows:
        if not r.get("error"):
            by.setdefault((r["rank"], r["M"]), {})[r["variant"]] = r
    pairs = [(v["lab_lora"], v["hf_peft"]) for v in by.values() if "lab_lora" in v and "hf_peft" in v]
    if not pairs:
        return "no case has both the lab's step with LoRA and HF + PEFT's"
    time = [lab["us_median"] / hf["us_median"] for lab, hf in pairs]
    mem = [lab["peak_mib"] / hf["peak_mib"] for lab, hf in pairs if lab.get("peak_mib") and hf.get("peak_mib")]
    out = f"over {len(pairs)} cases the lab's step takes {min(time):.2f}-{max(time):.2f}x HF + PEFT's time"
    return out + (f" and {min(mem):.2f}-{max(mem):.2f}x its peak memory" if mem else "")
