"""Routing pictures: router -> top-k, sorted blocks, padding waste, naive vs sorted assignment.

Shape legend: M tokens, E experts, k top-k, L adapters, P slots per adapter row, pair p = t*k + j.

``draw_*(ax, data, **params)`` draw on a matplotlib Axes and return None: they never create a
figure or call ``plt.show()``. The numbers they draw come from ``plots.routing_data``.
"""
from __future__ import annotations

from collections.abc import Mapping

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from ..validate import FLOAT_DTYPES, INDEX_DTYPES, check_bool, check_int, check_range, check_tensor
from ..routing.host import Alignment
from .routing_data import _check_alignment, _check_list, _last_naive_tokens, find_crossover, padding_stats

PAD_STYLE = dict(facecolor="#e4e4e4", edgecolor="#8c8c8c", hatch="///")


def expert_colors(num_experts: int) -> list:
    """One RGB(A) colour per expert: tab10 / tab20 without their greys (kept for padding) for up
    to 18 experts, a sampled 'turbo' beyond."""
    n = check_int("num_experts", num_experts, low=1)
    if n <= 18:
        name, greys = ("tab10", (7,)) if n <= 9 else ("tab20", (14, 15))
        return [c for i, c in enumerate(plt.get_cmap(name).colors) if i not in greys][:n]
    return [tuple(c) for c in plt.get_cmap("turbo")(np.linspace(0.05, 0.95, n))]


def _check_ax(ax) -> None:
    if not isinstance(ax, Axes):
        raise TypeError(f"ax: expected a matplotlib Axes (e.g. fig.add_subplot()), got {type(ax).__name__}")


def draw_topk_heatmap(ax, topk_ids, topk_weights, num_experts: int, *, token_lora=None,
                      annotate: bool | None = None, colorbar: bool = True) -> None:
    """Token x expert grid of routing weights: the k experts each token keeps, zero elsewhere."""
    _check_ax(ax)
    E = check_int("num_experts", num_experts, low=1)
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=INDEX_DTYPES, legend="[M, k]")
    check_tensor("topk_weights", topk_weights, dtypes=FLOAT_DTYPES, shape=tuple(topk_ids.shape),
                 legend="[M, k] (same shape as topk_ids)")
    check_range("topk_ids", topk_ids, 0, E, f"experts of a {E}-expert layer")
    M, k = topk_ids.shape
    if token_lora is not None:
        check_tensor("token_lora", token_lora, dtypes=INDEX_DTYPES, shape=(M,), legend="[M]")
    dense = torch.zeros(M, E).scatter_add_(1, topk_ids.cpu().long(), topk_weights.cpu().float()).numpy()
    vmax = max(float(dense.max()), 1e-6)
    im = ax.imshow(dense, cmap="Blues", vmin=0.0, vmax=vmax, aspect="auto", interpolation="nearest")
    if annotate if annotate is not None else M * E <= 400:
        for t, e in zip(*np.nonzero(dense)):
            ax.text(e, t, f"{dense[t, e]:.2f}", ha="center", va="center", fontsize=9,
                    color="white" if dense[t, e] > 0.55 * vmax else "black")
    if E <= 32:
        ax.set_xticks(range(E))
    if M <= 32:
        ax.set_yticks(range(M))
        if token_lora is not None:
            ax.set_yticklabels([f"t{t} · " + (f"adapter {l}" if l >= 0 else "no adapter")
                                for t, l in enumerate(token_lora.tolist())])
    if M <= 64 and E <= 64:                                     # cell borders, while they stay thin
        ax.set_xticks(np.arange(E + 1) - 0.5, minor=True)
        ax.set_yticks(np.arange(M + 1) - 0.5, minor=True)
        ax.grid(which="minor", color="white", linewidth=1.0)
        ax.tick_params(which="minor", length=0)
    ax.set_xlabel("expert e")
    ax.set_ylabel("token t")
    ax.set_title(f"router → top-{k}: each token keeps {k} of {E} experts")
    if colorbar:
        ax.figure.colorbar(im, ax=ax, label="routing weight topk_weights[t, j]", fraction=0.05)


LABEL_PT = 9                                                    # the smallest text the figures draw


def _text_width_pt(text: str) -> float:
    """Rough width of ``text`` at LABEL_PT: digits are wide, brackets and commas narrow."""
    return LABEL_PT * sum(0.64 if c.isdigit() else 0.4 for c in text)


def _slot_labels(ax, xmax: int, rows: int, num_pairs: int, top_k: int | None) -> str | None:
    """Which slot labels of draw_block_layout fit at LABEL_PT: 'p, (t, j)', 'p' or None.

    Estimated from the figure's size, leaving room for tick labels and the legend on the right."""
    fig = ax.figure
    width_in = fig.bbox.width / fig.dpi * ax.get_position().width / 0.775 - 2.9
    height_in = fig.bbox.height / fig.dpi * ax.get_position().height / 0.77 - 0.9
    slot_w = width_in * 72 / (xmax * 1.08 + 1)                  # points per slot
    row_h = 0.8 * height_in * 72 / (rows + 0.1)                 # points per bar
    last = max(num_pairs - 1, 0)
    if top_k and slot_w >= _text_width_pt(f"({last // top_k},{top_k - 1})") + 4 and row_h >= 2.6 * LABEL_PT:
        return "p, (t, j)"
    if slot_w >= _text_width_pt(str(last)) + 4 and row_h >= 1.4 * LABEL_PT:
        return "p"
    return None


def draw_block_layout(ax, alignment: Alignment, num_pairs: int, *, num_tokens: int | None = None,
                      top_k: int | None = None, num_experts: int | None = None,
                      annotate: bool | None = None) -> None:
    """Each adapter row (y) of sorted_token_ids as slots (x): one coloured bar per expert run,
    one hatched grey bar per padding run, black ticks at block boundaries, a red mark at
    num_tokens_post_padded. Slots show their pair id p, and (t, j) when num_tokens and top_k are given;
    annotate=None shows only the labels that fit at 9 pt in the figure's width, True forces them,
    False leaves them out. num_experts fixes the colour map (default: the largest expert in
    expert_ids + 1)."""
    _check_ax(ax)
    ids, experts, ntpp, bs = _check_alignment(alignment, num_pairs)
    if (num_tokens is None) != (top_k is None):
        raise ValueError("num_tokens and top_k: give both (slots then also show (t, j)) or neither")
    if num_tokens is not None:
        check_int("num_tokens", num_tokens, low=0)
        check_int("top_k", top_k, low=1)
        if num_tokens * top_k != num_pairs:
            raise ValueError(f"num_tokens * top_k: {num_tokens} * {top_k} = {num_tokens * top_k} "
                             f"but num_pairs is {num_pairs}; they must match (num_pairs = M*k)")
    L = ids.shape[0]
    E = max(int(experts.max()) + 1 if experts.numel() else 1, 1)
    if num_experts is not None and check_int("num_experts", num_experts, low=1) < E:
        raise ValueError(f"num_experts: {num_experts} but alignment.expert_ids holds expert {E - 1}")
    E = E if num_experts is None else num_experts
    colors = expert_colors(E)
    xmax = max(int(ntpp.max()) if L else 0, bs)
    labels = _slot_labels(ax, xmax, L, num_pairs, top_k) if annotate is None else \
        ("p, (t, j)" if top_k else "p") if annotate else None
    annotate = labels is not None
    dense = xmax > 160                                          # thin runs: no edges, no hatch
    pad_style = dict(facecolor=PAD_STYLE["facecolor"]) if dense else PAD_STYLE
    used, edges = set(), []
    for l in range(L):
        row = ids[l, : int(ntpp[l])].tolist()
        s = 0
        while s < len(row):                                     # one bar per run of one kind
            e, pad = int(experts[l, s // bs]), row[s] >= num_pairs
            end = s + 1
            while end < len(row) and (row[end] >= num_pairs) == pad and int(experts[l, end // bs]) == e:
                end += 1
            style = pad_style if pad else dict(facecolor=colors[e], edgecolor="white")
            ax.barh(l, end - s, left=s, height=0.8, linewidth=0 if dense else 0.8, **style)
            used |= set() if pad else {e}
            s = end
        edges += [(x, l) for x in range(0, len(row) + 1, bs)]
        if annotate:
            for s, p in enumerate(row):
                if p < num_pairs:
                    label = f"{p}\n({p // top_k},{p % top_k})" if labels == "p, (t, j)" else str(p)
                    ax.text(s + 0.5, l, label, ha="center", va="center", fontsize=LABEL_PT, color="white",
                            linespacing=1.2)
        if not row:
            ax.text(0.2, l, "no pairs", va="center", fontsize=LABEL_PT, color="#666666")
    if annotate:                                                # thin separators between slots
        ax.vlines(np.arange(1, xmax), -0.4, L - 0.6, colors="white", linewidth=0.6, alpha=0.8)
    if edges:
        xs, ys = np.array(edges, dtype=float).T
        ax.vlines(xs, ys - 0.45, ys + 0.45, colors="black", linewidth=1.6 if xmax <= 64 * bs else 0.5)
    ax.vlines(ntpp.numpy(), np.arange(L) - 0.5, np.arange(L) + 0.5, colors="tab:red", linewidth=2.5)
    for l in range(L):
        ax.annotate(f"{int(ntpp[l])}", (int(ntpp[l]), l), xytext=(4, 0), textcoords="offset points",
                    color="tab:red", fontsize=LABEL_PT, va="center", ha="left")
    ax.set_xlim(0, xmax * 1.08 + 1)                             # room for the row ends' numbers
    if xmax // bs <= 16:
        ax.set_xticks(range(0, xmax + 1, bs))
    ax.set_ylim(L - 0.5, -0.6)
    ax.set_yticks(range(L))
    ax.set_yticklabels([f"adapter {l}" for l in range(L)])
    ax.set_xlabel(f"slot of sorted_token_ids[l, :]  (row length P = {ids.shape[1]}, drawn up to the longest row)")
    st = padding_stats(alignment, num_pairs)
    ax.set_title(f"BLOCK_M = {bs}: {st['padding_slots']} of {st['padded_slots']} slots are padding "
                 f"({st['waste']:.1%} waste), {st['blocks']} blocks")
    handles = [Patch(facecolor=colors[e], label=f"expert {e}") for e in sorted(used)] if len(used) <= 12 else \
        [Patch(facecolor=colors[0], label=f"colour = expert ({len(used)} used)")]
    handles += [Patch(label="padding (sentinel M*k)", **PAD_STYLE),
                Line2D([], [], color="black", linewidth=1.6, label="block boundary"),
                Line2D([], [], color="tab:red", linewidth=2.5, label="num_tokens_post_padded")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)


def draw_padding_waste(ax, rows, *, label: str | None = None, color=None) -> None:
    """Padding waste (%) against block size, one line per call (rows: padding_by_block_size)."""
    _check_ax(ax)
    if any(not isinstance(r, Mapping) or "block_size" not in r or "waste" not in r
           for r in _check_list("rows", rows, "padding_stats dicts")):
        raise ValueError("rows: every row needs 'block_size' and 'waste' (use padding_by_block_size)")
    bs = [r["block_size"] for r in rows]
    ax.plot(bs, [100 * r["waste"] for r in rows], marker="o", label=label, color=color)
    ax.set_xscale("log", base=2)
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.set_ylim(0, 100)
    ax.set_xlabel("block size BLOCK_M (pairs per program)")
    ax.set_ylabel("padding waste (% of walked slots)")
    ax.set_title("padding waste vs block size")
    ax.grid(True, alpha=0.3)
    if label is not None:                                       # outside, right: never over the lines
        ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)


def draw_assignment_cost(ax, costs: Mapping, *, legend: bool = True) -> None:
    """Programs and weight-tile loads of naive vs sorted assignment against M (from assignment_costs).

    One count axis: in the cost model every program with work loads exactly one weight tile, so
    programs and loads are the same number for each assignment; the sorted grid (programs launched)
    and the floor (distinct weights) share that axis. Lines that coincide stay distinguishable:
    naive is filled circles, sorted open squares around them, the floor a wide grey band underneath.
    vLLM's naive range is shaded and labelled in place (no legend entry); the crossover is a ring
    on the sorted line with its own note. ``legend=False`` leaves the legend to the caller
    (e.g. one ``fig.legend`` for several panels).
    """
    _check_ax(ax)
    check_bool("legend", legend)
    if not isinstance(costs, Mapping):
        raise TypeError(f"costs: expected the dict returned by assignment_costs, got {type(costs).__name__}")
    for key in ("rows", "num_experts", "top_k", "num_loras", "block_size"):
        if key not in costs:
            raise ValueError(f"costs: missing {key!r}; pass the dict returned by assignment_costs")
    rows = costs["rows"]
    crossover = find_crossover(rows)
    col = lambda key: [r[key] for r in rows]  # noqa: E731
    m = col("num_tokens")
    if all("distinct_weights" in r for r in rows):             # under the sorted line, still visible
        ax.plot(m, col("distinct_weights"), "-", color="0.55", alpha=0.35, linewidth=7, solid_capstyle="butt",
                zorder=1, label="floor: weight tiles touched (each (adapter, expert) loaded once)")
    ax.plot(m, col("naive_loads"), "o-", color="tab:red", markersize=5, zorder=3,
            label="naive: one program per pair, each loads its tile (programs = loads)")
    ax.plot(m, col("sorted_loads"), "s-", color="tab:blue", markerfacecolor="none", markersize=8,
            markeredgewidth=1.5, zorder=4,
            label="sorted: one program per block, each loads one tile (programs = loads)")
    if all("sorted_grid" in r for r in rows):
        ax.plot(m, col("sorted_grid"), "^:", color="tab:blue", markersize=4, linewidth=1.5, zorder=2,
                label="sorted: programs launched (grid for the worst case; idle ones exit)")
    E, k, L = costs["num_experts"], costs["top_k"], costs["num_loras"]
    last = _last_naive_tokens(E, k, L)                          # vLLM's rule, via use_naive_assignment
    lo, hi = m[0] / 1.5, m[-1] * 1.5
    rule = "vLLM's rule M·k·8 ≤ E·L"
    if last >= m[0]:                                            # shaded, labelled in place, not in the legend
        edge = min(last, hi)
        ax.axvspan(lo, edge, color="tab:red", alpha=0.08, linewidth=0)
        ax.axvline(edge, color="tab:red", linestyle="--", linewidth=1.2, zorder=2, gid="vllm-threshold",
                   label="_vLLM threshold")
        ax.annotate(f"{rule}:\nnaive for M ≤ {last}", (edge, 0.98), xycoords=ax.get_xaxis_transform(),
                    xytext=(-3, 0), textcoords="offset points", rotation=90, ha="right", va="top",
                    fontsize=9, color="tab:red", gid="vllm-note")
    else:
        ax.annotate(f"{rule}: sorted at every M shown", (0.02, 0.98), xycoords="axes fraction",
                    ha="left", va="top", fontsize=9, color="tab:red", gid="vllm-note")
    if crossover is not None:
        y = rows[m.index(crossover)]["sorted_loads"]
        ax.plot([crossover], [y], "o", markersize=15, markerfacecolor="none", markeredgecolor="black",
                markeredgewidth=1.5, zorder=5, gid="crossover", label="_crossover")
        same = " (= vLLM's last naive M)" if crossover == last else ""
        ax.annotate(f"crossover: sorted loads fewer\nfrom M = {crossover} on{same}", (crossover, y),
                    xytext=(16, -12), textcoords="offset points", fontsize=9, ha="left", va="top",
                    arrowprops=dict(arrowstyle="-", color="black", linewidth=0.8, relpos=(0.0, 1.0)),
                    gid="crossover-note")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    if len(m) <= 14:
        ax.set_xticks(m, [f"{v // 1024}k" if v >= 1024 and v % 1024 == 0 else str(v) for v in m])
    ax.set_xlabel("tokens M  (1k = 1024)" if m[-1] >= 1024 else "tokens M")
    ax.set_ylabel("count per launch (programs, weight-tile loads)")
    ax.set_title(f"{costs.get('shape', 'custom')}: E = {E}, k = {k}, L = {L}\n"
                 f"BLOCK_M = {costs['block_size']}, adapters {costs.get('popularity', '?')}", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    if legend:
        ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
