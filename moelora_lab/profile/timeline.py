"""Per-stream timelines of the layer's stages, and what they say about overlap.

A record is ``{"stream": lane, "name": stage, "start_us": float, "end_us": float}``; lanes are
"main" (base MoE and joins) and "lora" (the side stream). On a GPU, :class:`Tracer` records a
pair of CUDA events around every stage on the stream that runs it; :func:`capture_timeline` first
parks the main stream in a short sleep kernel so the CPU has queued every launch before the GPU
starts, which makes the timeline show the GPU's schedule rather than Python's launch speed.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch


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
