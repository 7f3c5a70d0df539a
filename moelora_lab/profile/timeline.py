"""Per-stream timelines of the layer's stages, what they say about overlap, and what each stage moves.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, H hidden, I intermediate, P = M*k pairs.

A record is ``{"stream": lane, "name": stage, "start_us": float, "end_us": float}``; lanes are
"main" (base MoE and joins) and "lora" (the side stream). On a GPU, :class:`Tracer` records a
pair of CUDA events around every stage on the stream that runs it; :func:`capture_timeline` first
parks the main stream in a short sleep kernel so the CPU has queued every launch before the GPU
starts, which makes the timeline show the GPU's schedule rather than Python's launch speed.
:func:`stage_model` gives each stage of a benchmark trace its bytes (the byte model) and its tiles
(the dispatch rule); ``profile.trace_events`` writes and reads timelines as Chrome trace-event JSON.
"""
from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path

import torch

from ..config import MoEShape, benchmark_routing
from ..op.dispatch import gpu_config
from ..layer.table import SCHEDULES
from ..base_moe import fused_columns, gpu_gemm_tiles
from .traffic import Traffic, count_workload, layer_traffic

H200_SMS = 132          # streaming multiprocessors of an NVIDIA H200: an input of the LoRA tile rule
MODEL_KEYS = ("preset", "M", "rank", "loras", "schedule", "lora_path")
# the kind of every stage a row of ``layer.SCHEDULES`` records (a test keeps it covering them all)
STAGE_KINDS = {"base_w13": "base_gemm", "base_w2": "base_gemm", "lora_w13": "lora", "lora_w2": "lora",
               "act": "join", "sum": "join", "w13+lora": "fused_gemm", "w2+lora": "fused_gemm",
               "w13+lora+act": "fused_gemm",
               "shrink_w13": "lora", "shrink_w2": "lora", "act+lora": "join", "sum+lora": "join"}
LORA_KERNELS = {"one_shot": "one_shot_kernel", "two_kernel": "shrink_kernel, expand_kernel",
                "small_batch": "small_batch_kernel"}


class Tracer:
    """Collects (lane, stage, start event, end event) on CUDA; does nothing elsewhere."""

    def __init__(self):
        self.enabled = torch.cuda.is_available()
        self._events = []

    @contextlib.contextmanager
    def stage(self, name: str, lane: str):
        if not self.enabled:
            yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._events.append((lane, name, start, end))

    def records(self, origin=None) -> list[dict]:
        """Intervals in µs from ``origin`` (an event) or from the earliest start; synchronises."""
        torch.cuda.synchronize()
        if not self._events:
            return []
        origin = origin or self._events[0][2]
        return [dict(stream=lane, name=name, start_us=round(origin.elapsed_time(s) * 1e3, 3),
                     end_us=round(origin.elapsed_time(e) * 1e3, 3)) for lane, name, s, e in self._events]


def capture_timeline(run, *, warmup: int = 3, sleep_cycles: int = 4_000_000) -> list[dict]:
    """Run ``run(tracer)`` after ``warmup`` untraced runs and return its timeline records (GPU only)."""
    if not torch.cuda.is_available():
        raise RuntimeError("capture_timeline needs a CUDA GPU; on the CPU, load the committed H200 traces")
    for _ in range(warmup):
        run(None)
    torch.cuda.synchronize()
    tracer = Tracer()
    torch.cuda._sleep(sleep_cycles)                  # the GPU waits while the CPU queues everything
    origin = torch.cuda.Event(enable_timing=True)
    origin.record()
    run(tracer)
    return tracer.records(origin)


def _union(intervals):
    merged = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def _length(merged) -> float:
    return sum(e - s for s, e in merged)


def _intersection(a, b) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_metrics(records, main: str = "main", side: str = "lora") -> dict:
    """Busy time per lane, time both are busy, overlap = both / side busy, critical path vs serial sum."""
    if not records:
        raise ValueError("records: empty timeline")
    for r in records:
        if r["end_us"] < r["start_us"]:
            raise ValueError(f"records: stage {r['name']!r} ends before it starts ({r['start_us']} > {r['end_us']})")
    lanes = {lane: _union([(r["start_us"], r["end_us"]) for r in records if r["stream"] == lane])
             for lane in (main, side)}
    both = _intersection(lanes[main], lanes[side])
    side_busy = _length(lanes[side])
    return dict(
        main_busy_us=round(_length(lanes[main]), 3), side_busy_us=round(side_busy, 3), both_busy_us=round(both, 3),
        overlap=round(both / side_busy, 4) if side_busy else 0.0,
        critical_path_us=round(max(r["end_us"] for r in records) - min(r["start_us"] for r in records), 3),
        serial_sum_us=round(sum(r["end_us"] - r["start_us"] for r in records), 3),
    )


def save_traces(traces: dict, path) -> None:
    """``traces``: case name -> {"meta": {...}, "records": [...]}; one small JSON file."""
    Path(path).write_text(json.dumps(traces, indent=1))


@functools.lru_cache(maxsize=64)
def bench_workload(shape: MoEShape, num_tokens: int, num_loras: int, seed: int = 0):
    """The counted ``Workload`` of the benchmarks' routing of M tokens: ``make_routing`` with
    ``seed + M`` and ``min(M, 8)`` sequences (as ``python -m moelora_lab.bench`` draws it); cached."""
    r = benchmark_routing(shape, num_loras, num_tokens, seed)
    return count_workload(r["topk_ids"], r["token_lora"], shape.num_experts, num_loras)


def _parts(t: Traffic, reads, writes) -> Traffic:
    """The named read and written parts of a LoRA op's traffic, alone (one launch, FLOPs not split)."""
    r, w = sum(t.part(n) for n in reads), sum(t.part(n) for n in writes)
    return Traffic(r, w, 0, 1, tuple((n, t.part(n)) for n in (*reads, *writes)))


def _lora_weights(t: Traffic) -> Traffic:
    """The LoRA weight reads of a LoRA op's traffic, alone."""
    nbytes = t.part("lora_a") + t.part("lora_b")
    return Traffic(nbytes, 0, 0, 0, (("lora_weights", nbytes),))


def _lora_tiles(path: str, P: int, groups: int, n_out: int, slices: int, sms: int, r: int, *,
                side_stream: bool = False) -> dict:
    """The set fields of a LoRA launch's ``KernelConfig`` on the GPU, with its BLOCK_R and RANK_TILES."""
    cfg = gpu_config(path, P, groups, n_out, slices, sms, rank=r, side_stream=side_stream)
    block_r, rank_tiles = cfg.rank_tiling(r)
    return dict({key: v for key, v in vars(cfg).items() if v is not None}, BLOCK_R=block_r, RANK_TILES=rank_tiles)


def _expands_in_gemm(row) -> bool:
    """Whether a row's base GEMMs expand the LoRA after a shrink of its own (a GEMM stage carries it)."""
    return not row.gemm_lora_tiles and any(STAGE_KINDS.get(s) == "fused_gemm" for s in row.stage_names)


def recorded_lora_path(schedule: str, plan_path: str | None) -> str | None:
    """The ``lora_path`` the benchmarks record (CSV column, trace meta) for a run of ``schedule`` whose plan
    took ``plan_path``: "in_gemm" where the base GEMMs carry the whole LoRA, the schedule's name where its
    GEMMs expand the LoRA after its own shrink, else the plan's path (for a schedule that is no row too)."""
    row = SCHEDULES.get(schedule)
    if row is not None and row.gemm_lora_tiles:
        return "in_gemm"
    if row is not None and _expands_in_gemm(row):
        return schedule
    return plan_path


def _tail(name: str, nbytes: int, *, write: bool) -> Traffic:
    """One named read or write of ``nbytes`` alone (no FLOPs, no launch)."""
    return Traffic(0 if write else nbytes, nbytes if write else 0, 0, 0, ((name, nbytes),))


def stage_model(meta: dict, *, sms: int = H200_SMS) -> dict[str, dict]:
    """Bytes and tiles of every stage of one benchmark trace, from the case's ``meta`` alone.

    meta: preset, M, rank, loras (L), schedule, lora_path and optionally seed (default 0); bf16 (2 bytes).
    Returns stage -> {"kind", "kernel", "bytes", "bytes_read", "bytes_written", "tiles"}, the stages in the
    order of the schedule's row of ``layer.SCHEDULES`` (a schedule that is no row: the op's LoRA kernels).
    bytes: ``layer_traffic`` of the benchmarks' routing (``bench_workload``): a lower bound of the HBM
    bytes. Where the base GEMMs carry the whole LoRA (``fused``), w13+lora / w2+lora move the base GEMM's
    bytes plus every touched (adapter, expert)'s LoRA weights once; act and sum read no LoRA deltas. Where
    the GEMMs expand after a shrink per pair (``epilogue``), shrink_w13 / shrink_w2 move the two-kernel
    shrink's bytes (x rows, A, T written), w13+lora / w2+lora the base GEMM's plus B and T read. With the
    LoRA in the GEMMs' K (``in_k``) the shrinks write T of every pair, L*r columns (zeros outside its
    adapter's r), and each GEMM reads its base weights plus the packed B columns of every slot of every
    touched expert and that T tail; with the activation in w13's GEMM (``in_k_act``) that GEMM reads as
    ``in_k``'s and writes h, not c1. A row whose stages the byte model lacks raises ValueError.
    tiles: ``gpu_gemm_tiles(P / E)`` for the base GEMMs (``lora=True`` and BLOCK_LR for the fused ones,
    BLOCK_LR for the epilogue's); for the LoRA ops the ``KernelConfig`` of ``gpu_config(path, P, groups,
    N, S, sms, rank=r)`` (w13: N = I, S = 2; w2: N = H, S = 1; ``side_stream`` for a row on two streams)
    with its BLOCK_R and RANK_TILES, the shrinks of the GEMM-expanding rows the two-kernel path's; unset
    fields (None) left out; none for act and sum (the row-wise kernels have no tile rule). ``sms``: the
    GPU's SMs (132 on an NVIDIA H200).
    """
    if not isinstance(meta, dict):
        raise TypeError(f"meta: expected a dict (a trace's 'meta'), got {type(meta).__name__}")
    missing = [key for key in MODEL_KEYS if key not in meta]
    if missing:
        raise ValueError(f"meta: {', '.join(missing)} missing; the byte model and tile rule need a benchmark "
                         f"trace's meta ({', '.join(MODEL_KEYS)})")
    if isinstance(sms, bool) or not isinstance(sms, int) or sms < 1:
        raise ValueError(f"sms: expected a positive int (the GPU's SM count, {H200_SMS} on an NVIDIA H200), "
                         f"got {sms!r}")
    shape = MoEShape.from_name(meta["preset"])
    M, r, L, schedule, path = meta["M"], meta["rank"], meta["loras"], meta["schedule"], meta["lora_path"]
    row = SCHEDULES.get(schedule)
    work = bench_workload(shape, M, L, meta.get("seed", 0))
    P, E, H, I = M * shape.top_k, shape.num_experts, shape.hidden, shape.intermediate
    kernels = {"base_gemm": "moe_gemm_kernel", "fused_gemm": "moe_gemm_lora_kernel",
               "shrink_w13": "shrink_kernel", "shrink_w2": "shrink_kernel",
               "lora": LORA_KERNELS.get(path, path), "act": "silu_and_mul_kernel", "sum": "topk_sum_kernel"}
    if row is not None and row.gemm_lora_tiles:
        lora, base = layer_traffic(shape, r, work), layer_traffic(shape, r, work, with_lora=False)
        traffic = {"w13+lora": base["base_w13"] + _lora_weights(lora["lora_w13"]), "act": base["act"],
                   "w2+lora": base["base_w2"] + _lora_weights(lora["lora_w2"]), "sum": base["sum"]}
        fused = dict(gpu_gemm_tiles(P / E, lora=True), BLOCK_LR=fused_columns(L, r))
        tiles = {"w13+lora": fused, "w2+lora": fused}
    elif row is not None and _expands_in_gemm(row):
        # the two-kernel path's shrink alone, then the base GEMM reading T and the B weights
        lora = layer_traffic(shape, r, work, lora_path="two_kernel")
        base = layer_traffic(shape, r, work, with_lora=False)
        traffic = {}
        for op, n_out, slices in (("w13", I, 2), ("w2", H, 1)):
            t = lora[f"lora_{op}"]
            shrink = _parts(t, ("x", "lora_a"), ("intermediate_write",))
            expand = _parts(t, ("lora_b", "intermediate_read"), ())
            if row.needs_pack:
                # T [S, P, L*r] of every pair (bf16) and the B of every slot packed beside each touched expert's W
                tail = slices * P * L * r * 2
                shrink = _parts(t, ("x", "lora_a"), ()) + _tail("tail_write", tail, write=True)
                expand = (_tail("lora_b_packed", work.touched_experts * slices * n_out * L * r * 2, write=False)
                          + _tail("tail_read", tail, write=False))
            traffic[f"shrink_{op}"] = shrink
            traffic[f"{op}+lora"] = base[f"base_{op}"] + expand
        traffic.update(act=base["act"], sum=base["sum"])
        gemm = dict(gpu_gemm_tiles(P / E), **({} if row.needs_pack else dict(BLOCK_LR=fused_columns(L, r))))
        tiles = {"w13+lora": gemm, "w2+lora": gemm}
        for stage, n_out, slices in (("shrink_w13", I, 2), ("shrink_w2", H, 1)):
            tiles[stage] = _lora_tiles("two_kernel", P, min(P, L * E), n_out, slices, sms, r)
        if row.needs_pack:
            kernels.update(shrink_w13="shrink_tail_kernel", shrink_w2="shrink_tail_kernel",
                           fused_gemm="moe_gemm_kernel (K widened by L*r)")
            # the activation in the w13 GEMM's epilogue: its reads, then h written (c1 neither written nor read)
            g, a, h = traffic["w13+lora"], traffic["act"], P * I * 2
            traffic["w13+lora+act"] = Traffic(g.bytes_read, h, g.flops + a.flops, 1,
                                              (("gemm_read", g.bytes_read), ("h_write", h)))
            tiles["w13+lora+act"] = dict(gemm, BLOCK_N=max(16, gemm["BLOCK_N"] // 2))
            kernels["w13+lora+act"] = "gemm_act_kernel (K widened by L*r)"
    elif row is None or row.lora_paths is None:
        traffic = layer_traffic(shape, r, work, lora_path=path)
        groups = P if path == "small_batch" else min(P, L * E)
        tiles = {"base_w13": gpu_gemm_tiles(P / E), "base_w2": gpu_gemm_tiles(P / E)}
        side = row is not None and row.streams > 1
        for stage, n_out, slices in (("lora_w13", I, 2), ("lora_w2", H, 1)):
            tiles[stage] = _lora_tiles(path, P, groups, n_out, slices, sms, r, side_stream=side)
    else:
        raise ValueError(f"meta: schedule {schedule!r} records the stages {', '.join(row.stage_names)}, which the "
                         "byte model does not cover")
    if row is not None:
        lacking = [stage for stage in row.stage_names if stage not in traffic]
        if lacking:
            raise ValueError(f"meta: schedule {schedule!r} records the stages {', '.join(lacking)}, which the byte "
                             "model does not cover")
        traffic = {stage: traffic[stage] for stage in row.stage_names}     # the row's stages, in its launch order
    model = {}
    for stage, t in traffic.items():
        if stage in ("total", "floor"):
            continue
        kind = STAGE_KINDS[stage]
        model[stage] = dict(kind=kind, kernel=kernels.get(stage, kernels.get(kind)), bytes=t.bytes,
                            bytes_read=t.bytes_read, bytes_written=t.bytes_written, tiles=dict(tiles.get(stage, {})))
    return model


def achieved_gbps(nbytes: int, dur_us: float) -> float | None:
    """Bytes over time in GB/s (10^9 bytes per second); None for a zero duration."""
    return round(nbytes / dur_us / 1e3, 2) if dur_us > 0 else None
