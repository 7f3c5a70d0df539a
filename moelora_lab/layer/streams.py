"""The two-stream executor: fork the LoRA work onto a side stream, join it back with events.

The layer (``layer.py``) enqueues its base GEMMs on the current ("main") stream and its LoRA
kernels inside ``Streams.side``; with ``dual=False`` the same code runs everything on the current
stream, so both schedules launch identical kernels on identical buffers.
"""
from __future__ import annotations

import contextlib

import torch

from ..validate import check_choice

SIDE_PRIORITIES = ("highest", "default")
_AUX_STREAMS: dict = {}


def aux_stream(device: torch.device, priority: str = "highest") -> "torch.cuda.Stream":
    """The side stream of this process for ``device`` and ``priority`` (one of ``SIDE_PRIORITIES``;
    one stream is enough: more would only compete)."""
    check_choice("side_priority", priority, SIDE_PRIORITIES)
    device = torch.device(device)
    index = torch.cuda.current_device() if device.index is None else device.index
    key = (index, priority)
    if key not in _AUX_STREAMS:
        least, highest = torch.cuda.Stream.priority_range()
        _AUX_STREAMS[key] = torch.cuda.Stream(device=index, priority=highest if priority == "highest" else least)
    return _AUX_STREAMS[key]


class Streams:
    """Fork / join helper. ``fork()`` marks the point the side work depends on (record it before
    enqueuing the base GEMM, so both can start together); ``side(name, fork)`` runs work on the side
    stream after that point; ``join()`` makes the main stream wait for it."""

    def __init__(self, dual: bool, device, tracer=None, priority: str = "highest"):
        self.dual, self.tracer = dual, tracer
        self.main = torch.cuda.current_stream(device) if dual else None
        self.aux = aux_stream(device, priority) if dual else None

    def fork(self):
        if not self.dual:
            return None
        event = torch.cuda.Event()
        event.record(self.main)
        return event

    @contextlib.contextmanager
    def side(self, name: str, fork):
        """Run the body on the side stream after ``fork``. If it raises, the main stream still waits
        for whatever it enqueued before the error propagates (the buffers it uses are then freed)."""
        if not self.dual:
            with self.stage(name, "lora"):
                yield
            return
        self.aux.wait_event(fork)
        try:
            with torch.cuda.stream(self.aux), self.stage(name, "lora"):
                yield
        except BaseException:
            self._mark_side_done()
            self.join()
            raise
        self._mark_side_done()

    def _mark_side_done(self):
        self.joined = torch.cuda.Event()
        self.joined.record(self.aux)

    def join(self):
        if self.dual:
            self.main.wait_event(self.joined)

    def stage(self, name, lane):
        return traced(self.tracer, name, lane)


def traced(tracer, name: str, lane: str = "main"):
    """``tracer.stage(name, lane)`` (``profile.timeline.Tracer``), or nothing without a tracer."""
    return tracer.stage(name, lane) if tracer is not None else contextlib.nullcontext()
