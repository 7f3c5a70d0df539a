"""The two-stream executor: fork, side work, join; exception safety; the device each stream uses."""
import contextlib

import pytest
import torch

import moelora_lab.layer.streams as streams_mod
from moelora_lab.layer.streams import Streams


class FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_event(self, event):
        self.log.append(f"{self.name} waits for {event.name}")


class FakeEvent:
    count = 0

    def __init__(self, log):
        FakeEvent.count += 1
        self.name, self.log = f"event{FakeEvent.count}", log

    def record(self, stream):
        self.log.append(f"{self.name} recorded on {stream.name}")


@pytest.fixture
def fake_cuda(monkeypatch):
    """Streams and events that write what happens to a log (runs on a machine without a GPU)."""
    log = []
    main, aux = FakeStream("main", log), FakeStream("aux", log)
    FakeEvent.count = 0
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "Event", lambda: FakeEvent(log))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(streams_mod, "aux_stream", lambda device, priority="highest": aux)
    return log


def test_fork_side_join_order(fake_cuda):
    s = Streams(True, "cuda:0")
    fork = s.fork()
    with s.side("lora", fork):
        fake_cuda.append("side work")
    s.join()
    assert fake_cuda == ["event1 recorded on main", "aux waits for event1", "side work",
                         "event2 recorded on aux", "main waits for event2"]


def test_side_work_that_raises_still_joins_the_main_stream(fake_cuda):
    """If the side work fails after enqueuing kernels, the main stream must still wait for them
    before the error propagates: the buffers they use are freed on the way out."""
    s = Streams(True, "cuda:0")
    fork = s.fork()
    with pytest.raises(RuntimeError, match="launch failed"):
        with s.side("lora", fork):
            fake_cuda.append("side work")
            raise RuntimeError("launch failed")
    assert fake_cuda[-2:] == ["event2 recorded on aux", "main waits for event2"]


def test_one_stream_runs_the_body_in_place():
    s = Streams(False, "cpu")
    ran = []
    assert s.fork() is None
    with s.side("lora", None):
        ran.append(1)
    s.join()
    assert ran == [1]
    with pytest.raises(ValueError, match="boom"):
        with s.side("lora", None):
            raise ValueError("boom")


@pytest.mark.gpu
def test_aux_stream_lives_on_the_device_asked_for():
    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    assert streams_mod.aux_stream(dev).device == dev
    with torch.cuda.device(dev):
        assert streams_mod.aux_stream(torch.device("cuda")).device == dev
