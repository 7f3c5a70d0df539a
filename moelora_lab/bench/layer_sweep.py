"""``python -m moelora_lab.bench layer``: the whole MoE layer with and without LoRA, and its timelines.

Variants per (preset, M, rank), each timed as a CUDA-graph replay with L2 flushed (median, p20, p80), all
variants of a case in ``ROUNDS`` interleaved rounds with their replays pooled (``timing.time_cuda_interleaved``):
  no_lora                 the base layer alone (grouped GEMMs, activation, top-k sum)
  <schedule>              each row of ``layer.SCHEDULES`` (``--help`` lists them), our folded join; the rows of
                          the op's LoRA kernels (one stream, two) and ``in_k`` from one plan made for one stream
                          (the op's path rule: the same kernels on both stream counts), every other row from a
                          plan made for it; the rows with an L*r limit only where L*r fits
  <schedule>_side         a two-stream row from a plan made for it, as ``moe_lora_layer`` makes it (the side
                          stream's path rule, ``dispatch.choose_side_path``)
  auto                    what ``moe_lora_layer`` picks by default given the weights packed by ``pack_in_k``
                          (``in_k=``; its plan built the same way); the rows that need the pack read it too,
                          every other LoRA variant reads the unpacked weights
  <schedule>_vllm_join    a row that runs vLLM's join (zero-fill + add passes) with it
  base_gemms              our two grouped GEMMs alone, next to
  grouped_mm              torch._grouped_mm on rows already grouped by expert (a strong reference)
The default leaves out the side-plan variants and the experiment rows without an L*r limit (asked for by
name). Routing metadata is built once per case outside the timed region (``plan_layer``) and timed apart
as ``plan``; ``no_lora_plan`` and ``auto_plan`` time the layer with its plan built inside the call,
as a model pays it in every MoE layer. Next to the byte floor, ``roofline_us`` is max(byte floor,
FLOPs / the bf16 matmul rate measured in the same run): past the ridge the layer is compute-bound and the byte floor alone is
out of reach. Timelines of the default rows that read the unpacked weights (the op's LoRA kernels on one
stream and on two, and the in-GEMM rows where L*r fits) are captured for ``--trace-tokens`` x
``--trace-ranks`` and saved to one JSON file. LoRA B is stored N-fastest (``pack_lora_b``), the
layout the library recommends. ``--side-priority default`` runs the side stream at default priority
instead of the highest (the comparison behind ``layer.aux_stream``). ``--base fp8`` quantizes the base weights
once per shape (``quant.quantize_experts``, (128, 128) blocks) and times only the variants whose schedule serves
a quantized base (``fp8_refusal``), written to ``layer_fp8`` by default; every row records its ``base`` (x's
dtype or fp8), and an FP8 row's byte floor counts FP8 weights (``layer_traffic(base="fp8")``), its roofline
the FP8 matmul rate measured in the same run (``matmul_tflops``: ``timing.fp8_matmul_rate``).

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, H hidden, I expert intermediate.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings

import torch

from ..config import MoEShape, layer_lora_weights
from ..layer import SIDE_PRIORITIES, moe_lora_layer, plan_layer, resolve_schedule
from ..layer.in_k_pack import pack_in_k
from ..layer.plan import _streams_run
from ..layer.table import AUTO, SCHEDULES
from ..base_moe import gemm_tiles, moe_gemm
from ..profile import timing
from ..profile.gpu_state import GpuMonitor, rate_at_clock
from ..profile.timeline import capture_timeline, overlap_metrics, recorded_lora_path, save_traces
from ..profile.trace_events import export_trace_files
from ..profile.traffic import count_workload, layer_traffic
from ..quant import quantize_experts
from ..summary import KERNEL_ROWS, SIDE_PLAN_ROWS, VLLM_JOIN_ROWS, side_plan_variant, vllm_join_variant
from .common import base_weights, device, grouped_mm_fns, progress, seeded_generator, sweep_parser, sweep_routing

NAME = "layer"
AUTO_PLAN = f"{AUTO}_plan"
NO_LORA = ("no_lora", "base_gemms", "grouped_mm", "plan", "no_lora_plan")
SIDE_OF = {side_plan_variant(name): name for name in SIDE_PLAN_ROWS}       # side-plan variant -> its row
VLLM_OF = {vllm_join_variant(name): name for name in VLLM_JOIN_ROWS}      # vLLM-join variant -> its row


def _variants() -> tuple:
    """Every variant, in --help order: no LoRA, each row (its side-plan variant beside it), auto, the vLLM
    joins, the base GEMMs' references and the plans."""
    out = ["no_lora"]
    for name in SCHEDULES:
        out += [name] + [v for v, row in SIDE_OF.items() if row == name]
    return (*out, AUTO, *VLLM_OF, "base_gemms", "grouped_mm", "plan", "no_lora_plan", AUTO_PLAN)


VARIANTS = _variants()
# asked for by name: the side-plan variants and the experiment rows without an L*r limit
BY_NAME = (*SIDE_OF, *(name for name, row in SCHEDULES.items() if row.status == "experiment" and not row.max_columns))
DEFAULT_VARIANTS = tuple(v for v in VARIANTS if v not in BY_NAME)
ROUNDS = 3              # interleaved timing rounds per case: a drift of the GPU during a case hits every variant
# the schedule each LoRA-layer variant asks for (``schedule`` records what it really ran)
SCHEDULE_OF = {**{name: name for name in SCHEDULES}, **SIDE_OF, **VLLM_OF, AUTO: AUTO, AUTO_PLAN: AUTO}
PACKED = (*(name for name, row in SCHEDULES.items() if row.needs_pack), AUTO, AUTO_PLAN)   # read the pack
# rows run from the shared one-stream plan (the op's path rule); every other row gets a plan of its own
SHARED_PLAN = tuple(name for name, row in SCHEDULES.items()
                    if row.lora_blocks and row.plan_path is None and not row.gemm_lora_tiles)
# rows whose timelines are captured: the default rows on the weights as given
TRACED = tuple(name for name, row in SCHEDULES.items() if name in DEFAULT_VARIANTS and not row.needs_pack)
BASES = ("dtype", "fp8")     # the base weights: in x's dtype (--dtype), or quantized to FP8
# variants that run without a schedule row, and why each cannot run on an FP8 base (None: it can)
FP8_OTHERS = {"no_lora": None, "no_lora_plan": None, "plan": None,
              AUTO: "it runs on the in_k pack (pack_in_k), which FP8 weights cannot hold",
              AUTO_PLAN: "it runs on the in_k pack (pack_in_k), which FP8 weights cannot hold",
              "base_gemms": "it times the bf16 grouped GEMM (base_moe.moe_gemm) itself",
              "grouped_mm": "torch._grouped_mm multiplies bf16/fp16/fp32 weights only"}


def fp8_refusal(variant: str) -> str | None:
    """Why ``variant`` cannot run on a quantized (FP8) base, or None: the refusal of the schedule row it asks
    for (``refuses_fp8``), else its entry in FP8_OTHERS."""
    row = SCHEDULES.get(SCHEDULE_OF.get(variant, ""))
    return row.refuses_fp8() if row is not None else FP8_OTHERS[variant]


def output_name(args) -> str:
    """The CSV's file stem: ``--name``, but an FP8 run left at the default name writes ``layer_fp8`` (never over
    the bf16 file)."""
    return f"{NAME}_fp8" if args.base == "fp8" and args.name == NAME else args.name


def _epilog() -> str:
    """The rows of ``layer.SCHEDULES`` as --help lists them: name, status, what it does."""
    width = max(map(len, SCHEDULES)) + 2
    return "schedules (each a variant; rows of moelora_lab.layer.SCHEDULES):\n" + "\n".join(
        f"  {name:<{width}}{row.status}: {row.summary}" for name, row in SCHEDULES.items())


def add_parser(sub):
    y = sweep_parser(sub, NAME, "the MoE layer: no LoRA, every schedule, join variants; timelines",
                     name="layer", tokens=(1, 16, 64, 128, 512, 2048, 8192), ranks=(16, 64), max_seconds=True)
    y.formatter_class, y.epilog = argparse.RawDescriptionHelpFormatter, _epilog()
    y.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(DEFAULT_VARIANTS), metavar="VARIANT",
                   help=f"a subset of {', '.join(VARIANTS)} (default: all but {' and '.join(BY_NAME)})")
    y.add_argument("--trace-tokens", nargs="+", type=int, default=[1, 16, 128, 512, 2048, 8192],
                   help="M of the recorded two-stream timelines (default: %(default)s)")
    y.add_argument("--trace-ranks", nargs="+", type=int, default=[16, 64],
                   help="ranks r of the recorded timelines (default: %(default)s)")
    y.add_argument("--side-priority", choices=SIDE_PRIORITIES, default=SIDE_PRIORITIES[0],
                   help="priority of the LoRA side stream of the two-stream schedules (default: %(default)s)")
    y.add_argument("--base", choices=BASES, default=BASES[0],
                   help="the base weights: 'dtype' in --dtype as given (recorded as its name), 'fp8' quantized "
                        "once per shape to FP8 e4m3 with (128, 128) block scales, timing only the variants that "
                        "serve it (no_lora, sequential, dual_stream and their side-plan and vLLM-join rows, plan) "
                        "and written to layer_fp8 unless --name names another file (default: %(default)s)")
    y.add_argument("--trace-events", action="store_true",
                   help="also write the timelines as Chrome trace-event JSON (<out>/<name>_traces.trace.json, one "
                        "process per case) for Perfetto or chrome://tracing")
    return y


def _fits(variant: str, num_loras: int, rank: int) -> bool:
    """Whether the row a variant asks for can run L adapters of rank r (no row: always)."""
    row = SCHEDULES.get(SCHEDULE_OF.get(variant, ""))
    return row is None or row.too_wide(num_loras, rank) is None


def matmul_ceiling(dtype: torch.dtype, fp8: bool) -> float:
    """The compute ceiling of the rows' roofline: the FP8 matmul rate on an FP8 base (the bf16 rate, said so,
    where the FP8 matmul cannot run), else the rate in ``dtype``."""
    if fp8:
        try:
            return timing.fp8_matmul_rate()
        except RuntimeError as e:
            print(f"--base fp8: no FP8 matmul rate ({str(e).splitlines()[0][:120]}); the roofline uses the bf16 "
                  "rate", file=sys.stderr)
            return timing.matmul_rate(torch.bfloat16)
    return timing.matmul_rate(dtype)


def run_layer(args) -> tuple[list[dict], dict]:
    """The timed rows, and the timelines by case name ({meta, records, metrics})."""
    dtype = getattr(torch, args.dtype)
    fp8 = args.base == "fp8"
    base_name = "fp8" if fp8 else args.dtype
    variants = list(args.variants)
    if fp8:
        for name in [v for v in variants if fp8_refusal(v)]:
            print(f"--base fp8: skipping {name}: {fp8_refusal(name)}", file=sys.stderr)
        variants = [v for v in variants if not fp8_refusal(v)]
    prov = timing.provenance(args.command)
    copy_bps = timing.copy_bandwidth()
    with GpuMonitor(interval_s=0.02) as at_ceiling:   # the clock the ceiling was measured at
        flops_per_s = matmul_ceiling(dtype, fp8)
    ceiling_mhz = at_ceiling.summary()["sm_mhz_mean"]
    gen = seeded_generator(args.seed)
    rows, traces = [], {}
    cases = [(p, r, m) for p in args.presets for r in args.ranks for m in args.tokens]
    start = time.monotonic()
    for preset, rank, M in progress(cases, desc="layer", unit="case"):
        if time.monotonic() - start > args.max_seconds:
            print(f"time budget of {args.max_seconds} s spent: skipping the remaining cases", file=sys.stderr)
            break
        shape = MoEShape.from_name(preset)
        E, H, I, k, L = shape.num_experts, shape.hidden, shape.intermediate, shape.top_k, args.loras
        if not rows or rows[-1]["preset"] != preset:
            w13, w2 = base_weights(shape, gen, dtype)
            quantized = quantize_experts(w13, w2) if fp8 else None     # the checkpoints' (128, 128) blocks
        lora = dict(layer_lora_weights(shape, L, rank, gen, dtype), side_priority=args.side_priority)
        ids, tw, tl = sweep_routing(shape, L, M, args.seed, args.adapters)
        x = torch.randn(M, H, device=device(), generator=gen, dtype=dtype)
        plan_l = plan_layer(ids, tl, E, L, rank, intermediate=I, schedule=KERNEL_ROWS[1])
        # a plan per row that does not share plan_l (where L*r fits), and per side-plan variant
        plan_of = {name: plan_layer(ids, tl, E, L, rank, intermediate=I, schedule=name)
                   for name, row in SCHEDULES.items() if name not in SHARED_PLAN and _fits(name, L, rank)}
        plan_of.update({v: plan_layer(ids, tl, E, L, rank, intermediate=I, schedule=name)
                        for v, name in SIDE_OF.items()})
        plan_a = plan_layer(ids, tl, E, L, rank, intermediate=I)      # as moe_lora_layer builds it
        plan_of.update({AUTO: plan_a, AUTO_PLAN: plan_a})                      # every other variant runs plan_l's path
        plan_b = plan_layer(ids, tl, E, None, None)
        base = (x, ids, tw, tl, *((quantized.w13, quantized.w2) if fp8 else (w13, w2)))
        pack = None if fp8 else pack_in_k(w13, w2, lora["w13_lora_b"], lora["w2_lora_b"])   # the bench's only copy
        packed = None if fp8 else (x, ids, tw, tl, pack.w13, pack.w2)
        h = torch.randn(M * k, I, device=device(), generator=gen, dtype=dtype)
        c1 = torch.empty(M * k, 2 * I, device=device(), dtype=dtype)
        c3 = torch.empty(M * k, H, device=device(), dtype=dtype)
        tiles, wflat = gemm_tiles(M * k, E), tw.reshape(-1).contiguous()
        grouped = () if fp8 else grouped_mm_fns(x, h, ids, w13, w2)

        def layer_fn(variant, schedule, join="fold"):
            """The LoRA layer as ``variant`` runs it: ``schedule`` with ``join``, on the pack where it needs it."""
            pl = plan_of.get(variant) or plan_of.get(schedule, plan_l)
            if variant in PACKED:
                return lambda: moe_lora_layer(*packed, **lora, schedule=schedule, join=join, in_k=pack, plan=pl)
            return lambda: moe_lora_layer(*base, **lora, schedule=schedule, join=join, plan=pl)

        fns = {
            "no_lora": lambda: moe_lora_layer(*base, plan=plan_b),
            **{name: layer_fn(name, name) for name in SCHEDULES if _fits(name, L, rank)},
            **{v: layer_fn(v, name) for v, name in SIDE_OF.items()},
            AUTO: lambda: moe_lora_layer(*packed, **lora, in_k=pack, plan=plan_a),
            **{v: layer_fn(v, name, join="vllm") for v, name in VLLM_OF.items()},
            "base_gemms": lambda: (moe_gemm(x, w13, plan_b.base_blocks, c1, top_k=k, tiles=tiles),
                                   moe_gemm(h, w2, plan_b.base_blocks, c3, top_k=k, topk_weights=wflat,
                                            tiles=tiles)),
            "grouped_mm": lambda: tuple(f() for f in grouped),
            "no_lora_plan": lambda: moe_lora_layer(*base, validate=False),
            AUTO_PLAN: lambda: moe_lora_layer(*packed, **lora, in_k=pack, validate=False),
            "plan": lambda: plan_layer(ids, tl, E, L, rank, intermediate=I, schedule=KERNEL_ROWS[1],
                                       validate=False),
        }
        work = count_workload(ids, tl, E, L)
        nb = dict(dtype_bytes=x.element_size(), base="fp8" if fp8 else "dtype")
        floors = {True: layer_traffic(shape, rank, work, lora_path=plan_l.lora_path, **nb)["floor"],
                  False: layer_traffic(shape, rank, work, with_lora=False, **nb)["floor"]}
        names = [n for n in variants if _fits(n, L, rank)]                  # L*r too wide: no in-GEMM rows
        with GpuMonitor() as state:                  # the clock and power while this case's variants ran
            timed = timing.time_cuda_interleaved({n: fns[n] for n in names}, rounds=ROUNDS)
        streams_run = _streams_run(torch.device(device()))
        for name in names:
            error, t = "", timed[name]
            if isinstance(t, timing.Timing):
                med, p20, p80 = round(t.median_us, 2), round(t.p20_us, 2), round(t.p80_us, 2)
            else:   # e.g. torch._grouped_mm missing on an older torch: record, go on
                med = p20 = p80 = ""
                error = f"{type(t).__name__}: {str(t).splitlines()[0][:120]}"
            floor = floors[name not in NO_LORA]
            asks = SCHEDULE_OF.get(name)
            ran = ""
            if asks:                           # the schedule that really ran (auto resolved)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    ran = resolve_schedule(asks, torch.device(device()), num_pairs=M * k, num_experts=E,
                                           num_loras=L, rank=rank, in_k_columns=L * rank if name in PACKED else None,
                                           join="vllm" if name in VLLM_OF else "fold", quantized=fp8)
            path = recorded_lora_path(ran, (plan_of.get(name) or plan_of.get(asks) or plan_l).lora_path)
            two = streams_run and ran in SCHEDULES and SCHEDULES[ran].streams > 1     # a side stream really ran
            clocked = rate_at_clock(flops_per_s, ceiling_mhz, state.summary()["sm_mhz_mean"])   # at this case's clock
            rows.append(dict(preset=preset, M=M, rank=rank, loras=L, base=base_name, variant=name, schedule=ran,
                             lora_path=path,
                             side_priority=args.side_priority if two else "",
                             us_median=med, us_p20=p20, us_p80=p80, floor_bytes=floor.bytes,
                             floor_us=round(floor.floor_us(copy_bps), 2),
                             roofline_us=round(max(floor.floor_us(copy_bps), floor.flops / flops_per_s * 1e6), 2),
                             copy_tbps=round(copy_bps / 1e12, 4), matmul_tflops=round(flops_per_s / 1e12, 1),
                             matmul_sm_mhz=ceiling_mhz,
                             matmul_tflops_at_clock=clocked and round(clocked / 1e12, 1),
                             roofline_clock_us=clocked and round(max(floor.floor_us(copy_bps),
                                                                     floor.flops / clocked * 1e6), 2),
                             error=error, **state.summary(), **prov))
        if M in args.trace_tokens and rank in args.trace_ranks:
            for sched in (s for s in TRACED if _fits(s, L, rank) and not (fp8 and fp8_refusal(s))):
                pl = plan_of.get(sched, plan_l)
                run = (lambda tr, s=sched, pl=pl: moe_lora_layer(*base, **lora, schedule=s, plan=pl, tracer=tr))
                try:
                    recs = capture_timeline(run)
                except Exception as exc:  # keep the timings even if a trace fails
                    print(f"trace {preset} M={M} r={rank} {sched} failed: {exc}", file=sys.stderr)
                    continue
                meta = dict(preset=preset, M=M, rank=rank, loras=L, base=base_name, schedule=sched,
                            lora_path=recorded_lora_path(sched, pl.lora_path),
                            floor_us=round(floors[True].floor_us(copy_bps), 2), copy_tbps=round(copy_bps / 1e12, 4),
                            **prov)
                traces[f"{preset}_M{M}_r{rank}_{sched}"] = dict(meta=meta, records=recs,
                                                                metrics=overlap_metrics(recs))
        del lora, pack
        torch.cuda.empty_cache()
    return rows, traces


def run(args) -> list[dict]:
    """Time the layer; write its timelines to ``<out>/<name>_traces.json`` (none on the CPU)."""
    args.name = output_name(args)              # the CSV's name too (cli writes <out>/<args.name>.csv)
    rows, traces = run_layer(args)
    if traces:
        args.out.mkdir(parents=True, exist_ok=True)
        save_traces(traces, args.out / f"{args.name}_traces.json")
        if args.trace_events:
            export_trace_files(traces, args.out, combined=True, stem=f"{args.name}_traces")
    return rows


def save_plots(rows, args) -> list:
    """The layer plots next to the CSV."""
    from ..plots.layer import save_layer_plots   # imported here: matplotlib is only needed for plots
    return save_layer_plots(rows, args.out, args.name)
