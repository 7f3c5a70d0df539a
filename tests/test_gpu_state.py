"""The GPU state monitor: what it records from its readings, and that it invents none."""
import threading
import time

import pytest
import torch

from moelora_lab.profile.gpu_state import FIELDS, GpuMonitor, default_reader


def test_summary_of_the_samples_read_while_the_block_ran():
    readings = iter([(1980.0, 610.5, 61.0), (1755.0, 700.2, 66.0), (1830.0, 655.0, 64.0)])
    done = threading.Event()

    def reader():
        try:
            return next(readings)
        except StopIteration:
            done.set()
            raise RuntimeError("no more readings")         # a failed reading is skipped

    with GpuMonitor(reader=reader, interval_s=0.001) as mon:
        assert done.wait(5)
    assert mon.summary() == dict(sm_mhz_min=1755, sm_mhz_mean=1855, power_w_mean=655.2, power_w_max=700.2,
                                 temp_c_max=66)
    count = len(mon.samples)
    time.sleep(0.01)
    assert len(mon.samples) == count == 3                    # the thread stopped with the block


def test_no_reader_no_numbers():
    with GpuMonitor(reader=None) as mon:
        pass
    assert mon.summary() == dict.fromkeys(FIELDS, "")
    if not torch.cuda.is_available():
        assert default_reader() is None
    with pytest.raises(ValueError, match="interval_s: must be positive"):
        GpuMonitor(reader=None, interval_s=0)


@pytest.mark.gpu
def test_reads_the_gpu_it_times(device):
    if device != "cuda":
        pytest.skip("needs a CUDA GPU")
    with GpuMonitor(interval_s=0.01) as mon:
        a = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):
            a = a @ a / 64
        torch.cuda.synchronize()
    s = mon.summary()
    assert s["sm_mhz_min"] > 0 and s["power_w_max"] > 0, s


def test_nvidia_smi_reader_asks_the_visible_gpu_and_parses_its_answer(monkeypatch):
    """Without pynvml the monitor asks nvidia-smi about the GPU torch uses: CUDA_VISIBLE_DEVICES' entry
    for the current device, not torch's index."""
    from moelora_lab.profile import gpu_state

    asked = []

    class Done:
        def __init__(self, stdout):
            self.stdout = stdout

    def fake_run(command, **kw):
        asked.append(command)
        return Done("1755, 612.34, 63\n")

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    monkeypatch.setattr(gpu_state.torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(gpu_state.subprocess, "run", fake_run)
    read = gpu_state._smi_reader()
    assert read() == (1755.0, 612.34, 63.0)
    assert asked[-1][:3] == ["nvidia-smi", "-i", "5"]

    monkeypatch.setattr(gpu_state.subprocess, "run", lambda command, **kw: Done("[N/A], [N/A], 40\n"))
    assert gpu_state._smi_reader() is None                   # a GPU that reports no clock: no reader


def test_rate_at_clock_follows_the_sm_clock_and_stays_blank_without_one():
    from moelora_lab.profile.gpu_state import rate_at_clock
    assert rate_at_clock(800e12, 1980, 1485) == pytest.approx(600e12)
    assert rate_at_clock(800e12, "", 1500) == rate_at_clock(800e12, 1500, "") == rate_at_clock(1.0, 0, 1) == ""
