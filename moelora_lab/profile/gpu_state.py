"""What the GPU's clock and power did while a case was timed.

A long case on a GPU near its power cap runs at a lower SM clock than a short one, and the same
kernels timed twice can differ by as much as the schedules being compared (the H200 at M = 8192:
the matmul share of one GEMM swung between 69% and 77% from run to run). The benchmarks therefore
record, next to each case's timings, the SM clock and the power draw sampled while it ran:

    with GpuMonitor() as mon:
        timed = timing.time_cuda_interleaved(fns)
    row.update(mon.summary())      # sm_mhz_min, sm_mhz_mean, power_w_mean, power_w_max, temp_c_max

A background thread polls the GPU every ``interval_s`` (NVML through ``torch.cuda`` where the
``pynvml`` module is installed, ``nvidia-smi`` otherwise). Without an NVIDIA GPU, or without either
reader, every field is blank: a missing reading is never made up.
"""
from __future__ import annotations

import functools
import os
import subprocess
import threading
from statistics import mean

import torch

FIELDS = ("sm_mhz_min", "sm_mhz_mean", "power_w_mean", "power_w_max", "temp_c_max")


def _nvml_reader():
    """A reader of (SM MHz, W, °C) through torch's NVML calls, or None without pynvml."""
    try:
        torch.cuda.clock_rate()
        torch.cuda.power_draw()
    except Exception:                       # pynvml missing, or NVML refused: try nvidia-smi
        return None
    return lambda: (float(torch.cuda.clock_rate()), torch.cuda.power_draw() / 1000.0,
                    float(torch.cuda.temperature()))


def _smi_reader():
    """A reader through ``nvidia-smi`` for the current device, or None where it does not answer."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    index = torch.cuda.current_device()
    gpu = visible[index].strip() if index < len(visible) and visible[index].strip() else str(index)
    command = ["nvidia-smi", "-i", gpu, "--query-gpu=clocks.sm,power.draw,temperature.gpu",
               "--format=csv,noheader,nounits"]

    def read():
        out = subprocess.run(command, capture_output=True, text=True, timeout=5, check=True).stdout
        sm, watts, temp = (float(v) for v in out.strip().splitlines()[0].split(","))
        return sm, watts, temp

    try:
        read()
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None
    return read


@functools.lru_cache(maxsize=None)
def default_reader():
    """The reader :class:`GpuMonitor` uses by default, found once per process (None: nothing to read here)."""
    if not torch.cuda.is_available():
        return None
    return _nvml_reader() or _smi_reader()


class GpuMonitor:
    """Samples ``reader()`` -> (SM MHz, W, °C) from a thread while the ``with`` block runs."""

    def __init__(self, reader="default", interval_s: float = 0.1):
        if interval_s <= 0:
            raise ValueError(f"interval_s: must be positive, got {interval_s}")
        self.reader = default_reader() if reader == "default" else reader
        self.interval_s = interval_s
        self.samples: list[tuple] = []
        self._stop = threading.Event()
        self._thread = None

    def _poll(self):
        while True:
            try:
                self.samples.append(tuple(self.reader()))
            except Exception:               # one failed reading is skipped, not invented
                pass
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self):
        if self.reader is not None:
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return False

    def summary(self) -> dict:
        """The fields of :data:`FIELDS` over the samples taken (blank strings without samples)."""
        if not self.samples:
            return dict.fromkeys(FIELDS, "")
        sm, watts, temp = zip(*self.samples)
        return dict(sm_mhz_min=round(min(sm)), sm_mhz_mean=round(mean(sm)), power_w_mean=round(mean(watts), 1),
                    power_w_max=round(max(watts), 1), temp_c_max=round(max(temp)))


def rate_at_clock(rate: float, measured_mhz, at_mhz):
    """A compute rate measured at ``measured_mhz`` scaled to ``at_mhz`` (tensor-core throughput follows the SM
    clock): the ceiling a case had at the clock it ran at. Blank (``""``) where either clock was not read."""
    if measured_mhz in ("", None) or at_mhz in ("", None) or float(measured_mhz) <= 0:
        return ""
    return rate * float(at_mhz) / float(measured_mhz)
