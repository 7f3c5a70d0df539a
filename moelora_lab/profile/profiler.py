"""Kernel timelines of the layer from ``torch.profiler`` (CUPTI), as the records of ``profile.timeline``.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, H hidden, I intermediate, P = M*k pairs.

The event tracer (``timeline.Tracer``) times a stage by two CUDA events on its stream: the span from
"the stream reached the stage" to "the stream finished it". The profiler sees the kernels themselves:
when each one really started executing on the GPU and when it ended, its grid, registers and shared
memory. :class:`Annotator` is a tracer that wraps every stage in ``record_function("moelora:<lane>:
<stage>")``; the profiler turns each such range into a ``gpu_user_annotation`` event spanning the
kernels launched inside it on its stream, which is how a kernel is tied to its stage (no guessing from
names or order). :func:`kineto_cases` converts an exported profiler trace (``export_chrome_trace``)
into per-stage records (first kernel start to last kernel end, with the kernels listed) and per-kernel
records; :func:`capture_profiler_timeline` runs the layer under the profiler and returns both.

Where the two views differ. A stage on the side stream starts, for the events, when its stream gets
there; its kernel may start later, when SMs free up from the base GEMM that fills the GPU. So the
side stream's stage *starts* are not compared; stage *ends* and main-stream durations are. An event
pair also times the gap between the start event and the kernel's start (a few µs of launch latency),
and an end event on the side stream may complete a few µs after its kernel while the main stream
keeps the GPU busy. Agreement (:func:`compare_timelines`): the critical path and every stage end
within ``max(TOLERANCE_US, TOLERANCE_REL x critical path)``, and every main-stream stage duration
within ``max(TOLERANCE_US, TOLERANCE_REL x its duration)``.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile

import torch

from .timeline import Tracer, _intersection, _length, _union, overlap_metrics

PREFIX = "moelora"
SPIN_KERNEL = "spin_kernel"                      # torch.cuda._sleep's kernel: holds the GPU while the CPU queues
DEVICE_ACTIVITY = ("kernel", "gpu_memcpy", "gpu_memset")
KERNEL_ARGS = {"grid": "grid", "block": "block", "registers per thread": "registers",
               "shared memory": "shared_memory_bytes"}
TOLERANCE_US, TOLERANCE_REL = 8.0, 0.05


class Annotator:
    """A tracer (``moe_lora_layer(..., tracer=)``) that marks each stage for the profiler."""

    enabled = True

    def stage(self, name: str, lane: str):
        return torch.profiler.record_function(f"{PREFIX}:{lane}:{name}")


class _Both(Annotator):
    """Marks each stage for the profiler and times it with the event tracer, in one run."""

    def __init__(self):
        self.events = Tracer()

    @contextlib.contextmanager
    def stage(self, name: str, lane: str):
        with super().stage(name, lane), self.events.stage(name, lane):
            yield


def _stage_of(annotation: str) -> tuple[str, str] | None:
    """(lane, stage) of an annotation "moelora:<lane>:<stage>", else None."""
    parts = annotation.split(":", 2)
    return (parts[1], parts[2]) if len(parts) == 3 and parts[0] == PREFIX else None


def kernel_label(name: str) -> str:
    """A short name for a profiler's kernel name: no return type, namespaces, template arguments or
    parameters (``void at::native::vectorized_elementwise_kernel<8, at::native::FillFunctor<...>...>(...)``
    -> ``vectorized_elementwise_kernel [fill]``); Triton kernels keep their names."""
    depth, kept = 0, []
    for ch in name.replace("(anonymous namespace)", ""):
        depth += (ch == "<") - (ch == ">")
        kept.append(ch if depth == 0 and ch != ">" else "")
    text = "".join(kept).strip()
    text = text[:text.rindex("(")].strip() if text.endswith(")") and "(" in text else text
    short = (text.split() or [name])[-1].split("::")[-1] or name
    return short + (" [fill]" if "FillFunctor" in name else "")


def stage_kernels(records: list[dict], stage: str) -> tuple[str, ...]:
    """The kernels of one stage, in launch order, as short names: ``kernel_label`` without its
    ``_kernel`` suffix, ``fill`` for PyTorch's fill kernel (``torch.zeros``). ``records``: stage
    records with their kernel names (``kineto_cases``, ``capture_profiler_timeline``); a stage on
    several streams lists them stream after stream; () where no record of ``stage`` has kernels."""
    if not isinstance(stage, str):
        raise TypeError(f"stage: expected a stage name (str), got {type(stage).__name__}")
    if isinstance(records, (str, bytes, dict)) or not hasattr(records, "__iter__"):
        raise TypeError(f"records: expected a list of stage records, got {type(records).__name__}")
    names = []
    for i, r in enumerate(records):
        if not isinstance(r, dict) or "name" not in r:
            raise TypeError(f"records[{i}]: expected a stage record (a dict with 'name' and 'kernels'), got {r!r}")
        if r["name"] == stage:
            names += [kernel_label(k) for k in r.get("kernels", ())]
    return tuple("fill" if n.endswith(" [fill]") else n.removesuffix("_kernel") for n in names)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def kineto_cases(events: list) -> dict:
    """{pid: {"records": [...], "kernels": [...]}} from the events of an exported profiler trace.

    Device activity (cat kernel, gpu_memcpy, gpu_memset) is tied to the ``gpu_user_annotation``
    "moelora:<lane>:<stage>" on the same stream (pid, tid) that contains it; activity outside any is
    kept as stage "other" on lane "stream <N>". Only what follows the last sleep kernel counts (a
    capture sleeps once before the timed run). Times in µs from the end of that sleep kernel, or from
    the first kept kernel. records: one per stage and stream (stream = lane, name = stage, start_us
    of its first kernel, end_us of its last, kernels: their names, busy_us: their summed durations),
    sorted by start; kernels: one per kernel (stream, stage, name, start_us, end_us, grid, block,
    registers, shared_memory_bytes where the profiler gives them). Pids without activity are left out.
    """
    spans: dict = {}
    for e in events:
        if not (isinstance(e, dict) and e.get("ph") == "X" and _number(e.get("ts")) and _number(e.get("dur"))):
            continue
        spans.setdefault(e.get("pid"), []).append(e)
    cases = {}
    for pid, evs in spans.items():
        spins = [e["ts"] + e["dur"] for e in evs if e.get("cat") == "kernel" and SPIN_KERNEL in str(e.get("name"))]
        after = max(spins) if spins else float("-inf")
        acts = sorted((e for e in evs if e.get("cat") in DEVICE_ACTIVITY and e["ts"] >= after
                       and SPIN_KERNEL not in str(e.get("name"))), key=lambda e: e["ts"])
        if not acts:
            continue
        notes = [(e, _stage_of(str(e.get("name")))) for e in evs if e.get("cat") == "gpu_user_annotation"
                 and e["ts"] + e["dur"] >= after]
        notes = [(e, ls) for e, ls in notes if ls is not None]
        origin = after if spins else acts[0]["ts"]
        kernels = []
        for e in acts:
            mid = e["ts"] + e["dur"] / 2
            owner = [ls for n, ls in notes if n.get("tid") == e.get("tid") and n["ts"] <= mid <= n["ts"] + n["dur"]]
            args = e.get("args") if isinstance(e.get("args"), dict) else {}
            lane, stage = owner[-1] if owner else (f"stream {args.get('stream', e.get('tid'))}", "other")
            extra = {ours: args[theirs] for theirs, ours in KERNEL_ARGS.items() if theirs in args}
            kernels.append(dict(stream=lane, stage=stage, name=str(e.get("name")),
                                start_us=round(e["ts"] - origin, 3), end_us=round(e["ts"] + e["dur"] - origin, 3),
                                **extra))
        cases[pid] = dict(records=stage_records(kernels), kernels=kernels)
    return cases


def stage_records(kernels: list[dict]) -> list[dict]:
    """One record per (stream, stage) of per-kernel records: first start, last end, kernel names, busy µs."""
    stages: dict = {}
    for k in kernels:
        stages.setdefault((k["stream"], k["stage"]), []).append(k)
    records = [dict(stream=lane, name=stage, start_us=min(k["start_us"] for k in ks),
                    end_us=max(k["end_us"] for k in ks), kernels=[k["name"] for k in ks],
                    busy_us=round(sum(k["end_us"] - k["start_us"] for k in ks), 3))
               for (lane, stage), ks in stages.items()]
    return sorted(records, key=lambda r: r["start_us"])


def capture_profiler_timeline(run, *, warmup: int = 3, sleep_cycles: int = 10_000_000, keep=None) -> dict:
    """Run ``run(tracer)`` under ``torch.profiler`` (GPU only): {"records", "kernels", "events"}.

    ``warmup`` untraced runs first, then one annotated run inside the profiler to settle it (the first
    profiled launches are slow on the CPU), then the GPU sleeps while the CPU queues the timed run, as in
    ``timeline.capture_timeline``. The timed run is also timed by the event tracer: ``events`` holds its
    records, from an event recorded right after the sleep, so both views describe one execution.
    ``keep``: a path to save the profiler's own trace (JSON) to.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("capture_profiler_timeline needs a CUDA GPU; on the CPU, load the committed H200 traces")
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        run(None)
    torch.cuda.synchronize()
    both = _Both()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(Annotator())
        torch.cuda.synchronize()
        torch.cuda._sleep(sleep_cycles)
        origin = torch.cuda.Event(enable_timing=True)
        origin.record()
        run(both)
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            doc = json.load(f)
        if keep is not None:
            os.replace(path, keep)
    finally:
        if os.path.exists(path):
            os.remove(path)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    cases = kineto_cases(events)
    if len(cases) != 1:
        raise RuntimeError(f"the profiler recorded GPU activity under {len(cases)} processes; expected one")
    return next(iter(cases.values())) | {"events": both.events.records(origin)}


def stream_metrics(records: list[dict], kernels: list[dict] | None = None) -> dict:
    """HTA-style numbers of one timeline: ``overlap_metrics`` plus, per stream, busy and idle µs
    within the run's window (first start to last end) and the kernel count (with ``kernels``; busy
    then counts kernel time only, so gaps inside a two-kernel stage are idle)."""
    base = overlap_metrics(records)
    spans = kernels if kernels else records
    t0, t1 = min(r["start_us"] for r in records), max(r["end_us"] for r in records)
    lanes = list(dict.fromkeys(r["stream"] for r in records))
    busy = {lane: _length(_union([(r["start_us"], r["end_us"]) for r in spans if r["stream"] == lane]))
            for lane in lanes}
    per = {lane: dict(busy_us=round(busy[lane], 3), idle_us=round(t1 - t0 - busy[lane], 3),
                      idle=round(1 - busy[lane] / (t1 - t0), 4) if t1 > t0 else 0.0,
                      kernels=sum(1 for k in kernels if k["stream"] == lane) if kernels else None)
           for lane in lanes}
    return base | dict(streams=per, kernel_count=len(kernels) if kernels else None)


def compare_timelines(tracer: list[dict], profiler: list[dict]) -> dict:
    """How the event tracer's and the profiler's timelines of one case agree (see the module doc).

    Both start at the GPU's release from the sleep; ``capture_profiler_timeline`` gives both of one
    run. Returns critical paths, per stage (in the tracer's order) both ends and durations and their differences, ``side_start_wait_us`` (the profiler's kernel
    start minus the tracer's stage start on the side stream: the time the kernel waited for SMs),
    ``tolerance_us`` and ``agrees``.
    """
    prof = {(r["stream"], r["name"]): r for r in profiler}
    missing = [f"{r['stream']}:{r['name']}" for r in tracer if (r["stream"], r["name"]) not in prof]
    if missing:
        raise ValueError(f"profiler: no kernels for stage(s) {', '.join(missing)} of the tracer's timeline")
    cp = lambda recs: max(r["end_us"] for r in recs) - min(r["start_us"] for r in recs)
    cp_t, cp_p = cp(tracer), cp(profiler)
    tol = max(TOLERANCE_US, TOLERANCE_REL * max(cp_t, cp_p))
    stages, ok = [], abs(cp_t - cp_p) <= tol
    for r in tracer:
        p = prof[r["stream"], r["name"]]
        d_t, d_p = r["end_us"] - r["start_us"], p["end_us"] - p["start_us"]
        row = dict(stream=r["stream"], stage=r["name"], end_tracer_us=r["end_us"], end_profiler_us=p["end_us"],
                   end_diff_us=round(p["end_us"] - r["end_us"], 3), dur_tracer_us=round(d_t, 3),
                   dur_profiler_us=round(d_p, 3))
        ok &= abs(row["end_diff_us"]) <= tol
        if r["stream"] == "main":
            ok &= abs(d_p - d_t) <= max(TOLERANCE_US, TOLERANCE_REL * d_t)
        stages.append(row)
    side = [(prof[r["stream"], r["name"]]["start_us"] - r["start_us"]) for r in tracer if r["stream"] != "main"]
    both_t = _intersection(*(_union([(r["start_us"], r["end_us"]) for r in tracer if r["stream"] == s])
                             for s in ("main", "lora")))
    return dict(critical_path_tracer_us=round(cp_t, 3), critical_path_profiler_us=round(cp_p, 3),
                tolerance_us=round(tol, 3), side_start_wait_us=[round(v, 3) for v in side],
                both_busy_tracer_us=round(both_t, 3), stages=stages, agrees=bool(ok))
