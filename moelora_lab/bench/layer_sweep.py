"""``python -m moelora_lab.bench layer``: the whole MoE layer with and without LoRA, and its timelines.

Variants per (preset, M, rank), each timed as a CUDA-graph replay with L2 flushed (median, p20, p80), all
variants of a case in ``ROUNDS`` interleaved rounds with their replays pooled (``timing.time_cuda_interleaved``):
  no_lora                 the base layer alone (grouped GEMMs, activation, top-k sum)
  sequential / dual_stream                 LoRA with our folded join, one stream or two, from one plan made
                          for one stream (the op's path rule: the same kernels on both schedules)
  dual_stream_side        two streams from a plan made for them, as ``moe_lora_layer(schedule="dual_stream")``
                          makes it (the side stream's path rule, ``dispatch.choose_side_path``)
  fused                   LoRA computed inside the base grouped GEMMs (when L*r fits)
  in_k                    both LoRA ops in their GEMMs' K (``layer_in_k``), from the weights packed once
  in_join                 the LoRA inside the activation and the top-k sum (``layer_in_join``): w13's shrink
                          beside the w13 GEMM is its only LoRA launch
  auto                    what ``moe_lora_layer`` picks by default given that pack (``in_k=``; its plan built
                          the same way), so it may run ``in_k``; every other LoRA variant reads the
                          unpacked weights
  sequential_vllm_join / dual_stream_vllm_join   LoRA with vLLM's join (zero-fill + add passes)
  base_gemms              our two grouped GEMMs alone, next to
  grouped_mm              torch._grouped_mm on rows already grouped by expert (a strong reference)
Routing metadata is built once per case outside the timed region (``plan_layer``) and timed apart
as ``plan``; ``no_lora_plan`` and ``auto_plan`` time the layer with its plan built inside the call,
as a model pays it in every MoE layer. Next to the byte floor, ``roofline_us`` is max(byte floor,
FLOPs / the bf16 matmul rate measured in the same run): past the ridge the layer is compute-bound and the byte floor alone is
out of reach. Timelines of the sequential, dual-stream (and in-GEMM) layer are captured for ``--trace-tokens``
x ``--trace-ranks`` and saved to one JSON file. LoRA B is stored N-fastest (``pack_lora_b``), the
layout the library recommends. ``--side-priority default`` runs the side stream at default priority
instead of the highest (the comparison behind ``layer.aux_stream``).

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, H hidden, I expert intermediate.
"""
from __future__ import annotations

import sys
import time
import warnings

import torch

from ..config import MoEShape, layer_lora_weights
from ..layer import SIDE_PRIORITIES, fused_fits, moe_lora_layer, plan_layer, resolve_schedule
from ..layer_in_k import pack_in_k
from ..moe import gemm_tiles, moe_gemm
from ..profile import timing
from ..profile.gpu_state import GpuMonitor
from ..profile.timeline import capture_timeline, overlap_metrics, save_traces
from ..profile.trace_events import export_trace_files
from ..profile.traffic import count_workload, layer_traffic
from .common import base_weights, device, grouped_mm_fns, progress, seeded_generator, sweep_parser, sweep_routing

NAME = "layer"
VARIANTS = ("no_lora", "sequential", "dual_stream", "dual_stream_side", "fused", "epilogue", "in_k", "in_join", "auto",
            "sequential_vllm_join", "dual_stream_vllm_join", "base_gemms", "grouped_mm", "plan", "no_lora_plan",
            "auto_plan")
DEFAULT_VARIANTS = tuple(v for v in VARIANTS if v not in ("dual_stream_side", "in_join"))   # those: asked for by name
ROUNDS = 3              # interleaved timing rounds per case: a drift of the GPU during a case hits every variant
NO_LORA = ("no_lora", "base_gemms", "grouped_mm", "plan", "no_lora_plan")
# the schedule each LoRA-layer variant asks for (``schedule`` records what it really ran)
SCHEDULE_OF = {"sequential": "sequential", "dual_stream": "dual_stream", "dual_stream_side": "dual_stream",
               "fused": "fused", "epilogue": "epilogue",
               "in_k": "in_k", "in_join": "in_join", "auto": "auto",
               "sequential_vllm_join": "sequential", "dual_stream_vllm_join": "dual_stream", "auto_plan": "auto"}


def add_parser(sub):
    y = sweep_parser(sub, NAME, "the MoE layer: no LoRA, sequential, dual stream, join variants; timelines",
                     name="layer", tokens=(1, 16, 64, 128, 512, 2048, 8192), ranks=(16, 64), max_seconds=True)
    y.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(DEFAULT_VARIANTS), metavar="VARIANT",
                   help=f"a subset of {', '.join(VARIANTS)} (default: all but dual_stream_side and in_join)")
    y.add_argument("--trace-tokens", nargs="+", type=int, default=[1, 16, 128, 512, 2048, 8192])
    y.add_argument("--trace-ranks", nargs="+", type=int, default=[16, 64])
    y.add_argument("--side-priority", choices=SIDE_PRIORITIES, default=SIDE_PRIORITIES[0])
    y.add_argument("--trace-events", action="store_true",
                   help="also write the timelines as Chrome trace-event JSON (<out>/<name>_traces.trace.json, one "
                        "process per case) for Perfetto or chrome://tracing")


def run_layer(args) -> tuple[list[dict], dict]:
    """The timed rows, and the timelines by case name ({meta, records, metrics})."""
    dtype = getattr(torch, args.dtype)
    prov = timing.provenance(args.command)
    copy_bps, flops_per_s = timing.copy_bandwidth(), timing.matmul_rate(dtype)
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
        lora = dict(layer_lora_weights(shape, L, rank, gen, dtype), side_priority=args.side_priority)
        ids, tw, tl = sweep_routing(shape, L, M, args.seed)
        x = torch.randn(M, H, device=device(), generator=gen, dtype=dtype)
        plan_l = plan_layer(ids, tl, E, L, rank, hidden=H, intermediate=I, schedule="sequential")
        plan_f = plan_layer(ids, tl, E, L, rank, schedule="fused") if fused_fits(L, rank) else None
        plan_e = plan_layer(ids, tl, E, L, rank, schedule="epilogue") if fused_fits(L, rank) else None
        plan_s = plan_layer(ids, tl, E, L, rank, hidden=H, intermediate=I, schedule="dual_stream")
        plan_j = plan_layer(ids, tl, E, L, rank, hidden=H, intermediate=I, schedule="in_join")
        plan_a = plan_layer(ids, tl, E, L, rank, hidden=H, intermediate=I)      # as moe_lora_layer builds it
        plan_b = plan_layer(ids, tl, E, None, None)
        base = (x, ids, tw, tl, w13, w2)
        pack = pack_in_k(w13, w2, lora["w13_lora_b"], lora["w2_lora_b"])     # a second copy: the bench's only
        packed = (x, ids, tw, tl, pack.w13, pack.w2)
        h = torch.randn(M * k, I, device=device(), generator=gen, dtype=dtype)
        c1 = torch.empty(M * k, 2 * I, device=device(), dtype=dtype)
        c3 = torch.empty(M * k, H, device=device(), dtype=dtype)
        tiles, wflat = gemm_tiles(M * k, E), tw.reshape(-1).contiguous()
        grouped = grouped_mm_fns(x, h, ids, w13, w2)
        fns = {
            "no_lora": lambda: moe_lora_layer(*base, plan=plan_b),
            "sequential": lambda: moe_lora_layer(*base, **lora, schedule="sequential", plan=plan_l),
            "dual_stream": lambda: moe_lora_layer(*base, **lora, schedule="dual_stream", plan=plan_l),
            "dual_stream_side": lambda: moe_lora_layer(*base, **lora, schedule="dual_stream", plan=plan_s),
            "fused": lambda: moe_lora_layer(*base, **lora, schedule="fused", plan=plan_f),
            "epilogue": lambda: moe_lora_layer(*base, **lora, schedule="epilogue", plan=plan_e),
            "in_k": lambda: moe_lora_layer(*packed, **lora, schedule="in_k", in_k=pack, plan=plan_l),
            "in_join": lambda: moe_lora_layer(*base, **lora, schedule="in_join", plan=plan_j),
            "auto": lambda: moe_lora_layer(*packed, **lora, in_k=pack, plan=plan_a),
            "sequential_vllm_join": lambda: moe_lora_layer(*base, **lora, schedule="sequential", join="vllm",
                                                           plan=plan_l),
            "dual_stream_vllm_join": lambda: moe_lora_layer(*base, **lora, schedule="dual_stream", join="vllm",
                                                            plan=plan_l),
            "base_gemms": lambda: (moe_gemm(x, w13, plan_b.base_blocks, c1, top_k=k, tiles=tiles),
                                   moe_gemm(h, w2, plan_b.base_blocks, c3, top_k=k, topk_weights=wflat,
                                            tiles=tiles)),
            "grouped_mm": lambda: tuple(f() for f in grouped),
            "no_lora_plan": lambda: moe_lora_layer(*base, validate=False),
            "auto_plan": lambda: moe_lora_layer(*packed, **lora, in_k=pack, validate=False),
            "plan": lambda: plan_layer(ids, tl, E, L, rank, hidden=H, intermediate=I, schedule="sequential",
                                       validate=False),
        }
        plan_of = {"fused": plan_f, "epilogue": plan_e, "auto": plan_a, "auto_plan": plan_a,
                   "dual_stream_side": plan_s, "in_join": plan_j}             # every other variant runs plan_l's path
        work = count_workload(ids, tl, E, L)
        floors = {True: layer_traffic(shape, rank, work, lora_path=plan_l.lora_path)["floor"],
                  False: layer_traffic(shape, rank, work, with_lora=False)["floor"]}
        names = [n for n in args.variants if n not in ("fused", "epilogue") or plan_f is not None]
        with GpuMonitor() as state:                  # the clock and power while this case's variants ran
            timed = timing.time_cuda_interleaved({n: fns[n] for n in names}, rounds=ROUNDS)   # L*r too wide: no in-GEMM
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
            if asks:                           # the schedule that really ran (auto resolved, CPU: sequential)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    ran = resolve_schedule(asks, torch.device(device()), num_pairs=M * k, num_experts=E,
                                           fits=plan_f is not None,
                                           in_k_columns=L * rank if name in ("in_k", "auto", "auto_plan") else None)
            path = "in_k" if ran == "in_k" else (plan_of.get(name) or plan_l).lora_path
            rows.append(dict(preset=preset, M=M, rank=rank, loras=L, variant=name, schedule=ran, lora_path=path,
                             side_priority=args.side_priority if ran == "dual_stream" else "",
                             us_median=med, us_p20=p20, us_p80=p80, floor_bytes=floor.bytes,
                             floor_us=round(floor.floor_us(copy_bps), 2),
                             roofline_us=round(max(floor.floor_us(copy_bps), floor.flops / flops_per_s * 1e6), 2),
                             copy_tbps=round(copy_bps / 1e12, 4), matmul_tflops=round(flops_per_s / 1e12, 1),
                             error=error, **state.summary(), **prov))
        if M in args.trace_tokens and rank in args.trace_ranks:
            for sched in ("sequential", "dual_stream") + (("fused", "epilogue") if plan_f is not None else ()):
                pl = {"fused": plan_f, "epilogue": plan_e}.get(sched, plan_l)
                run = (lambda tr, s=sched, pl=pl: moe_lora_layer(*base, **lora, schedule=s, plan=pl, tracer=tr))
                try:
                    recs = capture_timeline(run)
                except Exception as exc:  # keep the timings even if a trace fails
                    print(f"trace {preset} M={M} r={rank} {sched} failed: {exc}", file=sys.stderr)
                    continue
                meta = dict(preset=preset, M=M, rank=rank, loras=L, schedule=sched, lora_path=pl.lora_path,
                            floor_us=round(floors[True].floor_us(copy_bps), 2), copy_tbps=round(copy_bps / 1e12, 4),
                            **prov)
                traces[f"{preset}_M{M}_r{rank}_{sched}"] = dict(meta=meta, records=recs,
                                                                metrics=overlap_metrics(recs))
        del lora, pack
        torch.cuda.empty_cache()
    return rows, traces


def run(args) -> list[dict]:
    """Time the layer; write its timelines to ``<out>/<name>_traces.json`` (none on the CPU)."""
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
