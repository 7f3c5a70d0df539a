"""``python -m moelora_lab.bench profiler``: the layer's timelines from torch.profiler, next to the event tracer.

For every (preset, M, rank) and schedule of ``SCHEDULES`` (the op's LoRA kernels on one stream and on two,
and the LoRA inside the GEMMs where L*r fits: rows of ``layer.SCHEDULES``), the layer runs under ``torch.profiler`` with its stages marked (``profile.profiler.capture_profiler_timeline``):
the kernels as the GPU ran them, each tied to its stage, and the same run timed by the event tracer.
Writes ``<out>/<name>_traces.json`` (case -> meta, records (per stage, from the kernels), kernels,
events (the event tracer's records), metrics, agreement) and one CSV row per case with HTA-style
numbers: kernel count, busy and idle time per stream, overlap, critical path by both instruments, the
side-stream kernels' wait for SMs, and whether the two views agree within the stated tolerance.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, H hidden, I expert intermediate.
"""
from __future__ import annotations

import sys

import torch

from ..config import MoEShape, layer_lora_weights
from ..layer import moe_lora_layer, plan_layer
from ..layer.table import SCHEDULES as ROWS
from ..profile import timing
from ..profile.profiler import TOLERANCE_REL, TOLERANCE_US, capture_profiler_timeline, compare_timelines, stream_metrics
from ..profile.timeline import recorded_lora_path, save_traces
from ..profile.trace_events import export_trace_files
from ..profile.traffic import count_workload, layer_traffic
from ..summary import KERNEL_ROWS
from .common import base_weights, device, progress, seeded_generator, sweep_parser, sweep_routing

NAME = "profiler"
# the rows profiled: the op's LoRA kernels (one stream, two) and the LoRA inside the GEMMs
SCHEDULES = tuple(name for name, row in ROWS.items() if row.lora_paths is None or row.gemm_lora_tiles)


def add_parser(sub):
    y = sweep_parser(sub, NAME, "the layer's kernels under torch.profiler, against the event tracer",
                     name="layer_profiler", tokens=(1, 16, 128, 512, 2048, 8192), ranks=(16, 64))
    y.add_argument("--trace-events", action="store_true",
                   help="also write <out>/<name>_traces.trace.json (Chrome trace events, one process per case)")


def _row(case: dict) -> dict:
    """The CSV row of one profiled case: its meta, then HTA-style numbers and the agreement."""
    m, a = case["metrics"], case["agreement"]
    streams = m["streams"]
    side = streams.get("lora", {})
    return dict({k: case["meta"][k] for k in ("preset", "M", "rank", "loras", "schedule", "lora_path")},
                kernels=m["kernel_count"], lora_kernels=side.get("kernels") or 0, critical_path_us=m["critical_path_us"], events_critical_path_us=a["critical_path_tracer_us"],
                main_busy_us=streams["main"]["busy_us"], main_idle_us=streams["main"]["idle_us"],
                lora_busy_us=side.get("busy_us", 0.0), overlap=m["overlap"],
                side_wait_us=max(a["side_start_wait_us"], default=0.0),
                max_end_diff_us=max(abs(s["end_diff_us"]) for s in a["stages"]), tolerance_us=a["tolerance_us"],
                agrees=int(a["agrees"]), floor_us=case["meta"]["floor_us"],
                **{k: case["meta"][k] for k in case["meta"] if k not in ("preset", "M", "rank", "loras", "schedule",
                                                                         "lora_path", "floor_us", "source")})


def run_profiles(args) -> dict:
    """case name -> {meta, records, kernels, events, metrics, agreement}."""
    dtype = getattr(torch, args.dtype)
    prov = timing.provenance(args.command)
    copy_bps = timing.copy_bandwidth()
    gen = seeded_generator(args.seed)
    out, weights = {}, None
    cases = [(p, r, m) for p in args.presets for r in args.ranks for m in args.tokens]
    for preset, rank, M in progress(cases, desc="profiler", unit="case"):
        shape = MoEShape.from_name(preset)
        E, H, I, L = shape.num_experts, shape.hidden, shape.intermediate, args.loras
        if weights is None or weights[0] != preset:
            weights = (preset, *base_weights(shape, gen, dtype))
        _, w13, w2 = weights
        lora = layer_lora_weights(shape, L, rank, gen, dtype)
        ids, tw, tl = sweep_routing(shape, L, M, args.seed, args.adapters)
        x = torch.randn(M, H, device=device(), generator=gen, dtype=dtype)
        floor = layer_traffic(shape, rank, count_workload(ids, tl, E, L),
                              lora_path=plan_layer(ids, tl, E, L, rank).lora_path)["floor"]
        for sched in SCHEDULES:
            row = ROWS[sched]
            if row.too_wide(L, rank):
                continue
            # the op's kernels share one plan made for one stream (the same kernels on both stream counts)
            plan = plan_layer(ids, tl, E, L, rank, intermediate=I,
                              schedule=KERNEL_ROWS[1] if row.lora_paths is None else sched)
            run = (lambda tr, s=sched, pl=plan: moe_lora_layer(x, ids, tw, tl, w13, w2, **lora, schedule=s, plan=pl,
                                                               tracer=tr))
            name = f"{preset}_M{M}_r{rank}_{sched}"
            try:
                p = capture_profiler_timeline(run)
            except Exception as exc:  # record what ran; one failed capture does not lose the others
                print(f"profiler trace {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            meta = dict(preset=preset, M=M, rank=rank, loras=L, schedule=sched,
                        lora_path=recorded_lora_path(sched, plan.lora_path),
                        floor_us=round(floor.floor_us(copy_bps), 2), copy_tbps=round(copy_bps / 1e12, 4),
                        source="torch.profiler", tolerance=f"max({TOLERANCE_US} us, {TOLERANCE_REL:.0%})", **prov)
            out[name] = dict(meta=meta, **p, metrics=stream_metrics(p["records"], p["kernels"]),
                             agreement=compare_timelines(p["events"], p["records"]))
        del lora
        torch.cuda.empty_cache()
    return out


def run(args) -> list[dict]:
    """Profile the layer; write the timelines next to the CSV; one row per case."""
    profiled = run_profiles(args)
    if profiled:
        args.out.mkdir(parents=True, exist_ok=True)
        save_traces(profiled, args.out / f"{args.name}_traces.json")
        if args.trace_events:
            export_trace_files(profiled, args.out, combined=True, stem=f"{args.name}_traces")
    return [_row(case) for case in profiled.values()]
