"""Routing pictures: router -> top-k, sorted blocks, padding waste, naive vs sorted assignment.

Shape legend: M tokens, E experts, k top-k, L adapters, P slots per adapter row, pair p = t*k + j.

``draw_*(ax, data, **params)`` draw on a matplotlib Axes and return None: they never create a
figure or call ``plt.show()``. The data functions are pure and return plain dicts.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from .._checks import FLOAT_DTYPES, INDEX_DTYPES, check_int, check_range, check_tensor
from ..config import LoRAShape, MoEShape, make_problem
from ..routing import Alignment, align_block_size, use_naive_assignment

PAD_STYLE = dict(facecolor="#e4e4e4", edgecolor="#8c8c8c", hatch="///")
COST_KEYS = ("num_tokens", "naive_loads", "sorted_loads")


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


def _check_list(name: str, value, what: str):
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise TypeError(f"{name}: expected a non-empty list of {what}, got {value!r}")
    return value


def _last_naive_tokens(num_experts: int, top_k: int, num_loras: int) -> int:
    """Largest M for which use_naive_assignment(M*k, E, L) holds (0 if none)."""
    m = 0
    while use_naive_assignment((m + 1) * top_k, num_experts, num_loras):
        m += 1
    return m


def _check_alignment(alignment, num_pairs):
    """Validate an Alignment and its sentinel num_pairs = M*k; returns CPU (ids, experts, ntpp, bs)."""
    if not isinstance(alignment, Alignment):
        raise TypeError(f"alignment: expected a moelora_lab.Alignment (from align_block_size), "
                        f"got {type(alignment).__name__}")
    n = check_int("num_pairs", num_pairs, low=0)
    ids = check_tensor("alignment.sorted_token_ids", alignment.sorted_token_ids, ndim=2,
                       dtypes=INDEX_DTYPES, legend="[L, P]").cpu().long()
    L, P = ids.shape
    experts = check_tensor("alignment.expert_ids", alignment.expert_ids, ndim=2, dtypes=INDEX_DTYPES,
                           shape=(L, None), legend="[L, P // block_size]").cpu().long()
    ntpp = check_tensor("alignment.num_tokens_post_padded", alignment.num_tokens_post_padded,
                        dtypes=INDEX_DTYPES, shape=(L,), legend="[L]").cpu().long()
    bs = alignment.block_size
    check_range("alignment.sorted_token_ids", ids, 0, n + 1,
                f"pair ids below num_pairs={n} and the padding sentinel {n}; is num_pairs M*k?")
    tail = torch.arange(P)[None, :] >= ntpp[:, None]                       # slots past each row's end
    if bool((ids[tail] != n).any()):
        raise ValueError(f"num_pairs: {n} is not the padding sentinel of alignment.sorted_token_ids "
                         f"(its unused slots hold {int(ids[tail].max())}); pass num_pairs = M*k")
    return ids, experts, ntpp, bs


def padding_stats(alignment: Alignment, num_pairs: int) -> dict:
    """How many slots of an Alignment hold a pair, and how many are padding.

    For every adapter row l (``per_adapter``) and in total:
      valid_slots    pairs placed in the row (ids < num_pairs)
      padded_slots   num_tokens_post_padded[l]: the row length the kernels walk
      padding_slots  padded_slots - valid_slots: sentinel slots inside used blocks
      waste          padding_slots / padded_slots (0.0 for an empty row)
      blocks         padded_slots // block_size: the programs that have work
    """
    ids, _, ntpp, bs = _check_alignment(alignment, num_pairs)

    def stats(valid: int, padded: int) -> dict:
        return dict(valid_slots=valid, padded_slots=padded, padding_slots=padded - valid,
                    waste=(padded - valid) / padded if padded else 0.0, blocks=padded // bs)

    valid = (ids < num_pairs).sum(dim=1).tolist()
    per = [dict(adapter=l, **stats(v, p)) for l, (v, p) in enumerate(zip(valid, ntpp.tolist()))]
    return dict(block_size=bs, num_pairs=num_pairs, **stats(sum(valid), int(ntpp.sum())), per_adapter=per)


def padding_by_block_size(topk_ids, token_lora, num_experts: int, num_loras: int, block_sizes) -> list[dict]:
    """``padding_stats`` of one routing aligned with each block size (ascending list of ints)."""
    for b in _check_list("block_sizes", block_sizes, "ints"):
        check_int("block_sizes[i]", b, low=1)
    num_pairs = topk_ids.numel() if isinstance(topk_ids, torch.Tensor) else 0
    return [padding_stats(align_block_size(topk_ids, token_lora, num_experts, num_loras, b), num_pairs)
            for b in block_sizes]


def find_crossover(rows) -> int | None:
    """First M from which on the sorted assignment loads fewer weight tiles than the naive one.

    ``rows`` are ordered by num_tokens and hold num_tokens, naive_loads and sorted_loads. Returns
    None when sorting never wins for good (a win followed by a loss at larger M does not count).
    """
    for i, row in enumerate(_check_list("rows", rows, "dicts (assignment_costs(...)['rows'])")):
        if not isinstance(row, Mapping) or any(key not in row for key in COST_KEYS):
            raise ValueError(f"rows[{i}]: expected a dict with keys {', '.join(COST_KEYS)}, got {row!r}")
    ms = [row["num_tokens"] for row in rows]
    if any(a >= b for a, b in zip(ms, ms[1:])):
        raise ValueError(f"rows: num_tokens must be strictly increasing, got {ms}")
    crossover = None
    for row in rows:
        if row["sorted_loads"] < row["naive_loads"]:
            crossover = row["num_tokens"] if crossover is None else crossover
        else:
            crossover = None
    return crossover


def assignment_costs(shape, num_loras: int, block_size: int, token_counts, *, seed: int = 0,
                     popularity: str = "uniform") -> dict:
    """Naive vs sorted assignment of (token, slot) pairs to programs, counted for each M in token_counts.

    Cost model (programs and weight loads are proxies for launch work and HBM traffic):
      naive   one program per pair that has an adapter; each program reads the weight tile of
              its own (adapter, expert), so two pairs of one (adapter, expert) read it twice.
              naive_programs = naive_loads = pairs with an adapter.
      sorted  align_block_size groups each adapter's pairs by expert into blocks of block_size;
              one program per block, and the block_size pairs of a block share one weight read.
              sorted_programs = sorted_loads = sum(num_tokens_post_padded) // block_size.
              sorted_grid = L * P // block_size is the grid a launch must reserve before the
              device knows num_tokens_post_padded; programs past it exit at once.
    distinct_weights (the touched (adapter, expert) pairs) is the floor of both: every weight
    read once. padding_waste is the fraction of walked slots that hold no pair.

    Problems come from ``make_problem(shape, LoRAShape(num_loras, 8), M, seed=seed,
    adapter_popularity=popularity, with_base=False)``. Returns a dict: shape, num_experts, top_k,
    num_loras, block_size, popularity, seed, rows (one dict per M, also with vllm_naive:
    use_naive_assignment(M*k, E, L)), crossover (find_crossover of the rows) and vllm_threshold
    (the largest M that vLLM's rule M*k*8 <= E*L still runs naive).
    """
    if isinstance(shape, str):
        shape = MoEShape.from_name(shape)
    if not isinstance(shape, MoEShape):
        raise TypeError(f"shape: expected a MoEShape or a preset name, got {type(shape).__name__}")
    L = check_int("num_loras", num_loras, low=1)
    bs = check_int("block_size", block_size, low=1)
    for m in _check_list("token_counts", token_counts, "ints"):
        check_int("token_counts[i]", m, low=1)
    if any(a >= b for a, b in zip(token_counts, token_counts[1:])):
        raise ValueError(f"token_counts: must be strictly increasing, got {list(token_counts)}")
    E, k = shape.num_experts, shape.top_k
    rows = []
    for m in token_counts:
        prob = make_problem(shape, LoRAShape(L, 8), m, seed=seed, adapter_popularity=popularity, with_base=False)
        align = align_block_size(prob.topk_ids, prob.token_lora, E, L, bs)
        st = padding_stats(align, m * k)
        has = prob.token_lora.long() >= 0
        keys = prob.token_lora.long()[has, None] * E + prob.topk_ids.long()[has]
        pairs = int(has.sum()) * k
        rows.append(dict(num_tokens=m, pairs=m * k, naive_programs=pairs, naive_loads=pairs,
                         sorted_programs=st["blocks"], sorted_loads=st["blocks"],
                         sorted_grid=L * align.expert_ids.shape[1], distinct_weights=int(torch.unique(keys).numel()),
                         padded_slots=st["padded_slots"], padding_waste=st["waste"],
                         vllm_naive=use_naive_assignment(m * k, E, L)))
    return dict(shape=shape.name, num_experts=E, top_k=k, num_loras=L, block_size=bs, popularity=popularity,
                seed=seed, rows=rows, crossover=find_crossover(rows), vllm_threshold=_last_naive_tokens(E, k, L))


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
            ax.text(e, t, f"{dense[t, e]:.2f}", ha="center", va="center", fontsize=8,
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


def draw_block_layout(ax, alignment: Alignment, num_pairs: int, *, num_tokens: int | None = None,
                      top_k: int | None = None, num_experts: int | None = None,
                      annotate: bool | None = None) -> None:
    """Each adapter row (y) of sorted_token_ids as slots (x): one coloured bar per expert run,
    one hatched grey bar per padding run, black ticks at block boundaries, a red mark at
    num_tokens_post_padded. Slots show their pair id p, and (t, j) when num_tokens and top_k are given;
    num_experts fixes the colour map (default: the largest expert in expert_ids + 1)."""
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
    annotate = xmax <= 48 and L <= 8 if annotate is None else annotate
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
                    label = f"{p}\n({p // top_k},{p % top_k})" if top_k else str(p)
                    ax.text(s + 0.5, l, label, ha="center", va="center", fontsize=7, color="white",
                            linespacing=1.3)
        if not row:
            ax.text(0.2, l, "no pairs", va="center", fontsize=8, color="#666666")
    if annotate:                                                # thin separators between slots
        ax.vlines(np.arange(1, xmax), -0.4, L - 0.6, colors="white", linewidth=0.6, alpha=0.8)
    if edges:
        xs, ys = np.array(edges, dtype=float).T
        ax.vlines(xs, ys - 0.45, ys + 0.45, colors="black", linewidth=1.6 if xmax <= 64 * bs else 0.5)
    ax.vlines(ntpp.numpy(), np.arange(L) - 0.5, np.arange(L) + 0.5, colors="tab:red", linewidth=2.5)
    for l in range(L):
        ax.text(int(ntpp[l]) + 0.3, l - 0.42, f"{int(ntpp[l])}", color="tab:red", fontsize=8, va="bottom")
    ax.set_xlim(0, xmax * 1.04 + 1)
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
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


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
    if label is not None:
        ax.legend(fontsize=8)


def draw_assignment_cost(ax, costs: Mapping) -> None:
    """Programs and weight-tile loads of naive vs sorted assignment against M (from assignment_costs)."""
    _check_ax(ax)
    if not isinstance(costs, Mapping):
        raise TypeError(f"costs: expected the dict returned by assignment_costs, got {type(costs).__name__}")
    for key in ("rows", "num_experts", "top_k", "num_loras", "block_size"):
        if key not in costs:
            raise ValueError(f"costs: missing {key!r}; pass the dict returned by assignment_costs")
    rows = costs["rows"]
    crossover = find_crossover(rows)
    col = lambda key: [r[key] for r in rows]  # noqa: E731
    m = col("num_tokens")
    ax.plot(m, col("naive_loads"), "o-", color="tab:red", label="naive: programs = weight loads (1 per pair)")
    ax.plot(m, col("sorted_loads"), "s-", color="tab:blue",
            label="sorted: programs = weight loads (1 per block)")
    if all("sorted_grid" in r for r in rows):
        ax.plot(m, col("sorted_grid"), ":", color="tab:blue", label="sorted: grid launched (idle ones exit)")
    if all("distinct_weights" in r for r in rows):
        ax.plot(m, col("distinct_weights"), "--", color="0.5", label="floor: each (adapter, expert) read once")
    E, k, L = costs["num_experts"], costs["top_k"], costs["num_loras"]
    last = _last_naive_tokens(E, k, L)                          # vLLM's rule, via use_naive_assignment
    thr = max(last, 0.5)
    ax.axvspan(min(m[0], thr) / 1.5, thr, color="tab:red", alpha=0.07)
    ax.axvline(thr, color="tab:red", linestyle="--", linewidth=1.5, zorder=3,
               label=f"vLLM: naive iff M·k·8 ≤ E·L  (M ≤ {last})")
    if crossover is not None:
        ax.axvline(crossover, color="black", linewidth=1.5, zorder=2,
                   label=f"crossover: sorted loads fewer from M = {crossover}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    if len(m) <= 14:
        ax.set_xticks(m, [str(v) for v in m])
    ax.set_xlabel("tokens M")
    ax.set_ylabel("programs / (adapter, expert) weight-tile loads")
    ax.set_title(f"{costs.get('shape', 'custom')}: E={E}, k={k}, L={L}, BLOCK_M={costs['block_size']}, "
                 f"adapters {costs.get('popularity', '?')}", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7.5, loc="lower right")
