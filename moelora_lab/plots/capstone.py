"""The capstone: rules that choose a LoRA path or a layer schedule, scored against the H200 measurements.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, K in, N out (per slice), S slices,
P = M*k pairs.

A *case* is one measured point of a sweep: ``features`` (what a rule may look at) and ``us``, the
median time of every choice measured there. A *rule* is a function ``features -> choice``. Its
regret on a case is ``time of its choice / time of the fastest measured choice - 1`` (0: it picked
the fastest; 0.25: a quarter slower than it could have been). ``score_rule`` runs a rule over the
cases; ``draw_regret`` draws several rules' regrets on one scale, ``draw_path_map`` the measured
ratio of the two LoRA paths that a path rule has to read.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from ..config import MoEShape
from ..layer.table import SCHEDULES
from ..validate import check_rows
from .bench import check_ax

PATH_CHOICES = ("one_shot", "two_kernel", "small_batch")
# the rows a schedule rule chooses among: the op's LoRA kernels (one stream, two), both LoRA ops in the GEMMs' K
# (from the weights packed for it) and the LoRA inside the GEMMs
SCHEDULE_CHOICES = tuple(name for name, row in SCHEDULES.items()
                         if row.lora_paths is None or row.gemm_lora_tiles or row.needs_pack)
# the choice whose L*r limit ``fused_fits`` reports (the in-GEMM row of the choices)
FITS_ROW = next(name for name in SCHEDULE_CHOICES if SCHEDULES[name].max_columns is not None)
RULE_COLORS = ("#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#7f7f7f")
FONT = 9


def _times(row) -> tuple[float, float, float] | None:
    t = tuple(row.get(k) for k in ("us_median", "us_p20", "us_p80"))
    return t if all(isinstance(v, (int, float)) and v > 0 for v in t) else None


def _case(features: dict, timed: dict) -> dict:
    us = {c: t[0] for c, t in timed.items()}
    return dict(features=features, us=us, band={c: t[1:] for c, t in timed.items()}, best=min(us, key=us.get))


def path_cases(rows) -> list[dict]:
    """One case per (preset, op, r, M, L) of the LoRA-op sweep (rows of ``kernels.csv``), with the
    times of the paths of ``PATH_CHOICES`` measured there (the ``auto`` and ``align`` rows are not
    choices). Features: preset, op ('w13' or 'w2'), M, rank, loras, top_k, num_experts, pairs (M*k),
    K, N and slices (w13: K = H, N = I, S = 2; w2: K = I, N = H, S = 1)."""
    rows = check_rows("rows", rows, ("preset", "op", "path", "M", "rank", "loras", "us_median"), "kernels.csv")
    groups: dict = {}
    for r in rows:
        t = _times(r)
        if r["path"] in PATH_CHOICES and t is not None:
            groups.setdefault((r["preset"], r["op"], r["rank"], r["M"], r["loras"]), {})[r["path"]] = t
    cases = []
    for (preset, op, rank, M, loras), timed in sorted(groups.items()):
        shape = MoEShape.from_name(preset)
        K, N, S = shape.op_dims(op)
        features = dict(preset=preset, op=op, M=M, rank=rank, loras=loras, top_k=shape.top_k,
                        num_experts=shape.num_experts, pairs=M * shape.top_k, K=K, N=N, slices=S)
        cases.append(_case(features, timed))
    if not cases:
        raise ValueError(f"rows: no timed row of a path in {PATH_CHOICES}; expected the rows of kernels.csv")
    return cases


def schedule_cases(rows) -> list[dict]:
    """One case per (preset, M, r, L) of the layer sweep (rows of ``layer.csv``), with the times of
    the schedules of ``SCHEDULE_CHOICES`` measured there. Features: preset, M, rank, loras, top_k,
    num_experts, pairs (M*k), pairs_per_expert, hidden, intermediate and fused_fits (whether the
    in-GEMM LoRA can run at this L*r: its row's limit, ``FITS_ROW``)."""
    rows = check_rows("rows", rows, ("preset", "M", "rank", "loras", "variant", "us_median"), "layer.csv")
    groups: dict = {}
    for r in rows:
        t = _times(r)
        if r["variant"] in SCHEDULE_CHOICES and t is not None:
            groups.setdefault((r["preset"], r["M"], r["rank"], r["loras"]), {})[r["variant"]] = t
    cases = []
    for (preset, M, rank, loras), timed in sorted(groups.items()):
        shape = MoEShape.from_name(preset)
        features = dict(preset=preset, M=M, rank=rank, loras=loras, top_k=shape.top_k,
                        num_experts=shape.num_experts, pairs=M * shape.top_k,
                        pairs_per_expert=M * shape.top_k / shape.num_experts, hidden=shape.hidden,
                        intermediate=shape.intermediate,
                        fused_fits=SCHEDULES[FITS_ROW].too_wide(loras, rank) is None)
        cases.append(_case(features, timed))
    if not cases:
        raise ValueError(f"rows: no timed row of a schedule in {SCHEDULE_CHOICES}; expected the rows of layer.csv")
    return cases


def auto_path(features: Mapping) -> str:
    """What ``path="auto"`` runs for a path case, by the current rule (``paths.resolve_path``)."""
    from ..op.paths import resolve_path

    return resolve_path("auto", num_pairs=features["pairs"], num_experts=features["num_experts"],
                        num_loras=features["loras"], rank=features["rank"], add_inputs=True,
                        token_rows=features["op"] == "w13", n_out=features.get("N"))


def auto_schedule(features: Mapping) -> str:
    """What ``schedule="auto"`` runs on a GPU for a schedule case, by the current rule (``layer.gpu_schedule``),
    given the weights packed for ``in_k`` (L*r columns), as the sweep's ``auto`` rows ran."""
    from ..layer.plan import gpu_schedule

    return gpu_schedule(features["pairs"], features["num_experts"],
                        in_k_columns=features["loras"] * features["rank"])


def case_name(features: Mapping) -> str:
    """'deepseek-v2-lite w2 r=256 M=8' (a path case) or 'qwen3-30b-a3b r=16 M=2048' (a schedule case)."""
    op = f" {features['op']}" if "op" in features else ""
    return f"{features['preset']}{op} r={features['rank']} M={features['M']}"


def _why_not(choice: str, case: dict, cases: Sequence[dict]) -> str:
    f = case["features"]
    if choice == FITS_ROW and not f.get("fused_fits", True):
        return "the in-GEMM LoRA cannot run at this L*r (features['fused_fits'] is False)"
    where = sorted({c["features"]["M"] for c in cases if choice in c["us"] and c["features"]["preset"] == f["preset"]})
    upto = f"; the sweep timed it for M up to {where[-1]}" if where else ""
    return f"it was not measured for this case{upto}"


def score_rule(choose: Callable, cases: Sequence[dict], *, name: str = "the rule") -> dict:
    """Run ``choose(features)`` (given a copy) on every case; per case the choice, its time, the
    fastest measured choice and the regret. Returns ``{"rows", "mean", "worst" (the row of largest
    regret), "best_picked" (cases where it chose the fastest), "n"}``. A choice that is not one of
    the case's measured choices raises ValueError naming the case and what it may return."""
    if not callable(choose):
        raise TypeError(f"choose: expected a function features -> choice, got {type(choose).__name__}")
    if not cases:
        raise ValueError("cases: empty; build them with path_cases(rows) or schedule_cases(rows)")
    rows = []
    for case in cases:
        got = choose(dict(case["features"]))
        if got not in case["us"]:
            allowed = ", ".join(repr(c) for c in case["us"])
            why = f": {_why_not(got, case, cases)}" if isinstance(got, str) and got in (*PATH_CHOICES,
                                                                                           *SCHEDULE_CHOICES) else ""
            raise ValueError(f"{case_name(case['features'])}: {name} returned {got!r}{why}; "
                             f"return one of {allowed}")
        best = case["best"]
        rows.append(dict(features=case["features"], choice=got, us=case["us"][got], best=best,
                         best_us=case["us"][best], regret=case["us"][got] / case["us"][best] - 1))
    regrets = [r["regret"] for r in rows]
    return dict(rows=rows, mean=sum(regrets) / len(regrets), worst=max(rows, key=lambda r: r["regret"]),
                best_picked=sum(r["choice"] == r["best"] for r in rows), n=len(rows))


def largest_regrets(score: Mapping, count: int = 5) -> list[dict]:
    """The ``count`` rows of ``score`` with the largest regret (ties: in case order), regret > 0 only."""
    rows = sorted((r for r in score["rows"] if r["regret"] > 0), key=lambda r: -r["regret"])
    return rows[:count]


def draw_regret(ax, scores: Mapping[str, Mapping], *, target: Mapping | None = None) -> list[tuple]:
    """Every rule's regret per case on one scale: one row per rule (``scores``: {label: score_rule(...)},
    top to bottom), a dot per case (spread vertically so equal regrets stay visible), the mean as a
    black diamond; mean and worst are written at the right end of each row. ``target`` ({'mean': ,
    'worst': } as fractions) draws the two pass lines. Returns [(label, mean, worst)]."""
    check_ax(ax)
    if not isinstance(scores, Mapping) or not scores:
        raise TypeError(f"scores: expected a non-empty dict {{label: score_rule(...)}}, got {type(scores).__name__}")
    out, x_max = [], 0.0
    for i, (label, s) in enumerate(scores.items()):
        if not (isinstance(s, Mapping) and "rows" in s and "mean" in s):
            raise TypeError(f"scores[{label!r}]: expected the dict score_rule returns")
        regrets = [100 * r["regret"] for r in s["rows"]]
        n = len(regrets)
        jitter = [i + 0.32 * ((j * 0.618) % 1.0 - 0.5) for j in range(n)]
        color = RULE_COLORS[i % len(RULE_COLORS)]
        ax.scatter(regrets, jitter, s=14, color=color, alpha=0.55, linewidths=0)
        ax.scatter([100 * s["mean"]], [i], marker="D", s=60, color="black", zorder=3)
        worst = s["worst"]["regret"]
        ax.annotate(f"mean {s['mean']:.1%}\nworst {worst:.0%}", (1.01, i), xycoords=("axes fraction", "data"),
                    fontsize=FONT, va="center", ha="left", annotation_clip=False)
        x_max = max(x_max, max(regrets))
        out.append((label, s["mean"], worst))
    handles = [ax.scatter([], [], marker="D", s=60, color="black", label="mean over the cases")]
    if target:
        for key, style in (("mean", "--"), ("worst", ":")):
            if key in target:
                handles.append(ax.axvline(100 * target[key], color="black", linestyle=style, linewidth=1.2,
                                          label=f"target: {key} regret at most {target[key]:.0%}"))
                x_max = max(x_max, 100 * target[key])
    ax.set_yticks(range(len(scores)), list(scores), fontsize=FONT)
    ax.set_ylim(len(scores) - 0.5, -0.5)
    ax.set_xlim(-0.02 * max(x_max, 1), 1.04 * max(x_max, 1))
    ax.set_xlabel("regret: time of the choice / fastest measured time − 1 (%)", fontsize=FONT)
    ax.tick_params(labelsize=FONT)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(handles=handles, fontsize=FONT, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncols=len(handles),
              frameon=False)
    return out


def draw_path_map(ax, cases: Sequence[dict], *, preset: str, colorbar: bool = True):
    """The measured one-shot / two-kernel time ratio of one preset's path cases: rows (op, r), columns
    M, blue where the two-kernel path is faster (ratio > 1), red where the one-shot kernel is; each
    cell gives the ratio. Returns the image (for a shared colorbar)."""
    check_ax(ax)
    sel = [c for c in cases if c["features"].get("preset") == preset and {"one_shot", "two_kernel"} <= set(c["us"])]
    if not sel:
        raise ValueError(f"cases: no path case of preset {preset!r} with both one_shot and two_kernel times")
    keys = sorted({(c["features"]["op"], c["features"]["rank"]) for c in sel})
    ms = sorted({c["features"]["M"] for c in sel})
    grid = [[math.nan] * len(ms) for _ in keys]
    for c in sel:
        f = c["features"]
        grid[keys.index((f["op"], f["rank"]))][ms.index(f["M"])] = c["us"]["one_shot"] / c["us"]["two_kernel"]
    logs = [[math.log2(v) if v == v else math.nan for v in row] for row in grid]
    image = ax.imshow(logs, cmap="RdBu", vmin=-1, vmax=1, aspect="auto")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if v == v:
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=FONT,
                        color="white" if abs(math.log2(v)) > 0.6 else "black")
    ax.set_xticks(range(len(ms)), [str(m) for m in ms], fontsize=FONT)
    ax.set_yticks(range(len(keys)), [f"{op} r={r}" for op, r in keys], fontsize=FONT)
    ax.set_xlabel("tokens M", fontsize=FONT)
    ax.set_title(preset, fontsize=FONT + 1)
    if colorbar:
        bar = ax.figure.colorbar(image, ax=ax, ticks=[-1, 0, 1])
        bar.ax.set_yticklabels(["≤ 0.5", "1", "≥ 2"], fontsize=FONT)
        bar.set_label("one-shot time / two-kernel time", fontsize=FONT)
    return image
