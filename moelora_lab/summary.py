"""The README's measured section, written from the committed data, and its schedule table, written from
``layer.SCHEDULES`` (never typed by hand).

``python -m moelora_lab.summary`` prints the measured section; ``tests/test_summary.py`` keeps the README's
copy (between ``<!-- measured -->`` markers) equal to :func:`measured_markdown`, so a number there cannot
drift from the data; ``tests/test_schedule_table.py`` keeps its schedule table (between
``<!-- schedules-table -->`` markers) equal to :func:`schedules_markdown`. The layer benchmark's variant
names (``layer.csv``'s ``variant`` column) are built here from the rows too, for the benchmark, the plots
and this summary alike.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, K in, N out.
"""
from __future__ import annotations

from pathlib import Path

from . import results, rules
from .layer.table import AUTO, AUTO_CPU, AUTO_GPU, AUTO_LARGE, SCHEDULES

# ---------------------------------------------------------------------------------------------
# The layer benchmark's variants (``variant`` in layer.csv), from the rows of ``layer.SCHEDULES``

# the rows that run the op's LoRA kernels, by the streams they run on (1, 2)
KERNEL_ROWS = {row.streams: name for name, row in SCHEDULES.items() if row.lora_paths is None}
# rows timed with vLLM's join too (``<name>_vllm_join``), in table order
VLLM_JOIN_ROWS = tuple(name for name, row in SCHEDULES.items() if "vllm" in row.joins)
# two-stream rows of the op's kernels, timed from a plan made for their side stream too (``<name>_side``)
SIDE_PLAN_ROWS = tuple(name for name, row in SCHEDULES.items() if row.streams > 1 and row.lora_paths is None)
# the measured section's words for a row whose LoRA is in the GEMMs, by whether they carry all of it
IN_GEMM_WORDS = {True: "the LoRA inside the base GEMMs", False: "the shrink once per pair, the expand inside the GEMMs"}
# the rows whose LoRA is in the GEMMs (those with an L*r limit), in table order, with their words
IN_GEMM = tuple((name, IN_GEMM_WORDS[row.gemm_lora_tiles]) for name, row in SCHEDULES.items()
                if row.max_columns is not None)


def vllm_join_variant(schedule: str) -> str:
    """The layer benchmark's variant that runs ``schedule`` with vLLM's join."""
    return f"{schedule}_vllm_join"


def side_plan_variant(schedule: str) -> str:
    """The layer benchmark's variant that runs two-stream ``schedule`` from a plan made for its side stream."""
    return f"{schedule}_side"


# ---------------------------------------------------------------------------------------------
# The README's schedule table

def _honours(row) -> str:
    joins = ", ".join(f"`{j}`" for j in row.joins)
    if row.lora_paths is None:
        paths = "any"
    elif row.lora_paths:
        paths = ", ".join(f"`{p}`" for p in row.lora_paths) + f" only, the rest of its LoRA inside {row.lora_inside}"
    else:
        paths = f"none (its LoRA is inside {row.lora_inside})"
    return f"join: {joins}; lora_path: {paths}"


def _limits(row) -> str:
    limits = [f"L*r <= {row.column_limit} (padded to a power of two, at least 16)"] if row.column_limit else []
    limits += ["the weights packed by `pack_in_k` (`in_k=`)"] if row.needs_pack else []
    return "; ".join(limits) or "none"


def schedules_markdown() -> str:
    """The README's table of the layer's schedules, one line per row of ``layer.SCHEDULES`` and one for
    ``auto`` (a test keeps the README's copy equal to it)."""
    lines = ["| schedule | status | streams | what it does | honours join / lora_path | limits |",
             "|---|---|---|---|---|---|"]
    for name, row in SCHEDULES.items():
        streams = ("1" if row.one_stream else f"{row.streams} (the CPU runs `{row.cpu_runs}`)" if row.cpu_runs
                   else f"{row.streams} (one on the CPU)")
        lines.append(f"| `{name}` | {row.status} | {streams} | {row.summary} | {_honours(row)} | {_limits(row)} |")
    lines.append(f"| `{AUTO}` | the default | that of its pick | `{AUTO_CPU}` on the CPU; on a GPU `{AUTO_GPU}`, "
                 f"or `{AUTO_LARGE}` where `layer.gpu_schedule` says it pays and the call brings a pack "
                 f"| picks only a schedule that honours the call | none |")
    return "\n".join(lines)


PRESET = "qwen3-30b-a3b"
TOKENS = (1, 8, 32, 128, 512, 2048, 8192)
LAYER_TOKENS = (1, 16, 64, 128, 512, 2048, 8192)


def _span(values, fmt="{:.2f}", unit="") -> str:
    lo, hi = min(values), max(values)
    return (fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}–{fmt.format(hi)}") + unit


def _op_section(kernels, vllm, align) -> list[str]:
    ours = {(r["op"], r["rank"], r["M"]): r["us_median"] for r in kernels
            if r["preset"] == PRESET and r["path"] == "auto"}
    theirs = {(r["op"], r["rank"], r["M"]): r for r in vllm if r["preset"] == PRESET}
    cells = sorted(set(ours) & set(theirs))
    ranks = sorted({c[1] for c in cells})
    out = ["`python -m moelora_lab.bench kernels` (CUDA graph replay, L2 flushed before each replay, median µs;",
           "routing metadata built once outside the timed op, as a layer shares it between w13 and w2).",
           f"{PRESET}, `path=\"auto\"` against vLLM's MoE-LoRA dispatch and the fastest of its paths, measured",
           "the same way on the same GPU (`kernels.csv`, `vllm_reference.csv`):", "",
           "| op | r | " + " | ".join(f"M={m}" for m in TOKENS) + " |", "|---|---|" + "---|" * len(TOKENS)]
    for op in ("w13", "w2"):
        for rank in ranks:
            row = [f"{ours[op, rank, m]:.1f} / {theirs[op, rank, m]['vllm_dispatch_us']:.1f}"
                   if (op, rank, m) in ours and (op, rank, m) in theirs else "" for m in TOKENS]
            out.append(f"| {op} | {rank} | " + " | ".join(row) + " |")
    disp = [theirs[c]["vllm_dispatch_us"] / ours[c] for c in cells]
    best = [theirs[c]["vllm_best_us"] / ours[c] for c in cells]
    out += ["", "(ours / vLLM's dispatch, µs.) vLLM's time over ours: " + _speedups(disp, "its dispatch") + "; "
            + _speedups(best, "the fastest of its paths") + "."]
    out += [_auto_line(kernels)]
    by = {(r["method"], r["preset"], r["M"]): r["us_median"] for r in align}
    torch_ops = [v for (m, p, _), v in by.items() if m == "torch_ops"]
    device = [v for (m, p, _), v in by.items() if m == "triton_kernels"]
    out += [f"The routing metadata of one block list costs {_span(torch_ops, '{:.0f}', ' µs')} built from PyTorch ops",
            f"(`block_list`) and {_span(device, '{:.0f}', ' µs')} from Triton kernels (`block_list_device`, used on",
            f"GPUs: one launch up to {rules.RECOUNT_MAX_PAIRS} pairs (one sorting program per list up to "
            f"{rules.SORT_MAX_PAIRS}, recounting programs beyond), three chained launches beyond; `align.csv`, M = "
            + ", ".join(str(m) for m in sorted({k[2] for k in by})) + ")."]
    return out


AUTO_SLACK = 0.03        # "within 3% of our fastest path"


def auto_over_best(kernels) -> dict:
    """(preset, op, r, M) -> time of the ``auto`` row over the fastest of our paths' rows in that cell."""
    cells: dict = {}
    for r in kernels:
        if r["path"] in ("auto", "one_shot", "two_kernel", "small_batch"):
            cells.setdefault((r["preset"], r["op"], r["rank"], r["M"]), {})[r["path"]] = r["us_median"]
    return {key: t["auto"] / min(v for p, v in t.items() if p != "auto")
            for key, t in cells.items() if "auto" in t and len(t) > 1}


def _auto_line(kernels) -> str:
    ratios = auto_over_best(kernels)
    near = [key for key, x in ratios.items() if x <= 1 + AUTO_SLACK]
    worst = max(ratios, key=ratios.get)
    presets = ", ".join(sorted({k[0] for k in ratios}))
    return (f"Against our own paths over the whole sweep ({presets}; w13, w2; r "
            f"{', '.join(str(r) for r in sorted({k[2] for k in ratios}))}): `auto` is within {AUTO_SLACK:.0%} of "
            f"the fastest in {len(near)} of {len(ratios)} cells; its largest loss is {ratios[worst] - 1:.0%} "
            f"({worst[0]} {worst[1]} r={worst[2]} M={worst[3]}).")


def _dram_line(dram) -> str:
    """What the DRAM counters say about ``auto`` at large M: the bytes it reads, the rate it streams."""
    auto = [r for r in dram if r["path"] == "auto"]
    return (f"Under Nsight Compute's counters (`lora_dram.csv`, `python -m moelora_lab.bench dram`, code "
            f"{auto[0]['code']}), `auto`'s kernels at M = {_span([r['M'] for r in auto], '{}')} (r "
            f"{', '.join(str(r) for r in sorted({r['rank'] for r in auto}))}) read "
            f"{_span([r['read_over_model'] for r in auto])}× the byte model's reads from DRAM and stream "
            f"{_span([100 * r['rate_share'] for r in auto], '{:.0f}', '%')} of a copy kernel's DRAM rate while they "
            "run: the gap to the copy rate lies more in speed than in extra bytes.")


def _speedups(ratios, against: str) -> str:
    faster = [x for x in ratios if x > 1]
    text = f"against {against}, faster in {len(faster)} of {len(ratios)} cells"
    if faster:
        text += f" ({_span(faster, '{:.2f}', '×')})"
    slower = [x for x in ratios if x <= 1]
    if slower:
        text += f", not faster in {len(slower)} ({_span(slower, '{:.2f}', '×')})"
    return text


def _run_name(name: str, row) -> str:
    """How the measured section names a schedule ``auto`` ran: the op's LoRA kernels by their streams,
    any other row by its plot label and name."""
    if row.lora_paths is None:
        return "one stream" if row.one_stream else "two streams"
    return f"{(row.style or {}).get('label', name)} (`{name}`)"


RUN_NAMES = {name: _run_name(name, row) for name, row in SCHEDULES.items()}


def _auto_runs(t, ranks, ms) -> str:
    """What ``auto`` ran per rank, by the data's ``schedule`` column: '<schedule> at M = ..., ...'."""
    parts = []
    for rank in ranks:
        by: dict = {}
        for m in ms:
            if (rank, m, "auto") in t:
                by.setdefault(t[rank, m, "auto"]["schedule"], []).append(m)
        spans = [f"{RUN_NAMES.get(s, s)} at " + ("every M" if len(v) == len(ms) else "M = " + ", ".join(map(str, v)))
                 for s, v in by.items()]
        parts.append(f"at r = {rank} " + " and ".join(spans))
    return "; ".join(parts)


def _layer_section(layer) -> list[str]:
    t = {(r["rank"], r["M"], r["variant"]): r for r in layer if r["preset"] == PRESET}
    ms = [m for m in LAYER_TOKENS if (16, m, "no_lora") in t]
    ranks = sorted({k[0] for k in t})

    def line(name, fn):
        return f"| {name} | " + " | ".join(fn(m) for m in ms) + " |"

    def ratio(rank, a, b, fmt="{:.2f}"):
        return lambda m: (fmt.format(t[rank, m, a]["us_median"] / t[rank, m, b]["us_median"])
                          if (rank, m, a) in t and (rank, m, b) in t else "")

    out = ["", "The layer (`python -m moelora_lab.bench layer`, qwen3-30b-a3b, bf16, 4 adapters, routing plan built",
           f"outside the timed region; `layer.csv`, {_codes(layer)}):", "",
           "| M | " + " | ".join(str(m) for m in ms) + " |", "|---|" + "---|" * len(ms),
           line("no LoRA [µs]", lambda m: f"{t[16, m, 'no_lora']['us_median']:.1f}")]
    for rank in ranks:
        out.append(line(f"LoRA r={rank}, `schedule=\"auto\"` / no LoRA", ratio(rank, "auto", "no_lora")))
        out.append(line(f"LoRA r={rank}, max(byte, FLOP floor) / time",
                        lambda m, r=rank: f"{t[r, m, 'auto']['roofline_us'] / t[r, m, 'auto']['us_median']:.2f}"))
    for rank in ranks:
        if any((rank, m, AUTO_LARGE) in t for m in ms):
            out.append(line(f"LoRA r={rank}, `schedule=\"{AUTO_LARGE}\"` / no LoRA", ratio(rank, AUTO_LARGE, "no_lora")))
    out.append(line("our base GEMMs / `torch._grouped_mm`", ratio(16, "base_gemms", "grouped_mm")))
    out.append(line("routing plan [µs]", lambda m: f"{t[16, m, 'plan']['us_median']:.1f}"))
    if all((16, m, "auto_plan") in t for m in ms):
        out.append(line("LoRA r=16, layer + plan (`auto`) [µs]", lambda m: f"{t[16, m, 'auto_plan']['us_median']:.1f}"))
        out.append(line("LoRA r=16, layer + plan / no LoRA + plan", ratio(16, "auto_plan", "no_lora_plan")))
    in_gemm = [(v, words, [t[16, m, v]["us_median"] / t[16, m, "no_lora"]["us_median"] for m in ms if (16, m, v) in t])
               for v, words in IN_GEMM]
    (first, words, first_x), rest = in_gemm[0], in_gemm[1:]
    auto = [t[16, m, AUTO]["us_median"] / t[16, m, "no_lora"]["us_median"] for m in ms]
    one = KERNEL_ROWS[1]
    save = [1 - t[16, m, one]["us_median"] / t[16, m, vllm_join_variant(one)]["us_median"] for m in ms]
    out += ["", f"`auto` (given the weights packed by `pack_in_k`) ran {_auto_runs(t, ranks, ms)}.",
            f"`schedule=\"{first}\"` ({words}) costs {_span(first_x, '{:.2f}', '×')} the no-LoRA "
            f"layer at r = 16, against {_span(auto, '{:.2f}', '×')} for `auto`"
            + "".join(f"; `schedule=\"{v}\"` ({w}) {_span(x, '{:.2f}', '×')}" for v, w, x in rest if x) + ".",
            f"On one stream our folded join takes {_span(save, '{:.0%}')} off the layer with vLLM's "
            "zero-fill-and-add join (r = 16, every M)."]
    return out


def _codes(rows) -> str:
    """'code X', or where a file joins cases of more than one run, each code with the tokens it ran."""
    by_code = {}
    for r in rows:
        by_code.setdefault(r["code"], set()).add(r["M"])
    if len(by_code) == 1:
        return f"code {rows[0]['code']}"
    return " and ".join(f"code {code} (M = {_span(sorted(ms), '{}')})" for code, ms in by_code.items())


def measured_markdown(data_dir=results.DATA_DIR) -> str:
    """The README's measured section, from the committed (stamp-checked) data."""
    kernels = results.load("kernels", data_dir)
    layer = results.load("layer", data_dir)
    align = results.load("align", data_dir)
    vllm = results.read_csv(results.DATA_DIR / "vllm_reference.csv")     # vLLM's code: no stamp of ours
    head = kernels[0]
    codes = f"code {head['code']}" if {head["code"]} == {r["code"] for r in layer} else \
        f"the op's sweep at code {head['code']}, the layer's at {_codes(layer)}"
    out = [f"Measured on one {head['gpu']} (bf16, 4 adapters, torch {head['torch']}, triton {head['triton']}, "
           f"{head['date']}, {codes}; files under `moelora_lab/data/h200/`).", ""]
    op = _op_section(kernels, vllm, align)
    if (Path(data_dir) / "lora_dram.csv").exists():
        op.append(_dram_line(results.load("lora_dram", data_dir)))
    return "\n".join(out + op + _layer_section(layer))


if __name__ == "__main__":
    print(measured_markdown())
