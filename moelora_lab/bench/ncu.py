"""Nsight Compute (``ncu``) as the ``dram`` sweep runs it: the command line and its CSV report, parsed.

``ncu --csv --page raw`` writes one header row (the launch's columns, then one per metric), one row of
units, then a row per profiled kernel. With ``--print-nvtx-rename kernel`` a kernel's name is
``<NVTX range>/<kernel>``: the range it ran in ties it to its case.
"""
from __future__ import annotations

import csv
import io
import re

# ncu metric -> our column
METRICS = {
    "gpu__time_duration.sum": "duration_ns",
    "dram__bytes_read.sum": "dram_read_bytes",
    "dram__bytes_write.sum": "dram_write_bytes",
    "lts__t_bytes.sum": "l2_bytes",
    "sm__cycles_elapsed.avg.per_second": "sm_hz",
}
# launch statistics ncu's raw page carries with every kernel (no extra pass): our column <- ncu's
LAUNCH = {"waves": "launch__waves_per_multiprocessor", "blocks_per_sm_warps": "launch__occupancy_limit_warps"}
LIMITS = ("launch__occupancy_limit_blocks", "launch__occupancy_limit_registers", "launch__occupancy_limit_shared_mem",
          "launch__occupancy_limit_warps", "launch__occupancy_limit_barriers")
UNIT = {"": 1, "byte": 1, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "ns": 1, "nsecond": 1, "us": 1e3,
        "usecond": 1e3, "ms": 1e6, "msecond": 1e6, "s": 1e9, "second": 1e9, "hz": 1, "khz": 1e3, "mhz": 1e6,
        "ghz": 1e9, "cycle/nsecond": 1e9, "cycle/usecond": 1e6, "cycle/second": 1}


def ncu_command(ncu: str, log) -> list[str]:
    """ncu's arguments before the program: counters of the kernels inside profiled ranges only, named
    by their NVTX range, the clocks left alone, caches flushed before each kernel (ncu's default)."""
    return [ncu, "--clock-control", "none", "--profile-from-start", "off", "--nvtx", "--print-nvtx-rename",
            "kernel", "--print-units", "base", "--metrics", ",".join(METRICS), "--csv", "--page", "raw",
            "--log-file", str(log)]


def _number(text: str, unit: str) -> float:
    scale = UNIT.get(unit.strip().lower())
    if scale is None:
        raise ValueError(f"ncu report: unknown unit {unit!r}")
    return float(text.replace(",", "")) * scale


def parse_ncu_csv(text: str) -> list[dict]:
    """The kernels of an ``ncu --csv --page raw`` report, in launch order: {range (the NVTX range it ran
    in), kernel (its name), grid, each of :data:`METRICS` under our column name, in bytes, ns and Hz, and,
    where the report has them, ``waves`` (the grid in waves of the programs that fit on all SMs at once)
    and ``occupancy`` (the share of an SM's warps those programs hold: the tightest of the limits, by
    blocks, registers, shared memory and barriers, over the limit by warps alone)}."""
    lines = [line for line in text.splitlines() if line.startswith('"')]      # ncu's own ==PROF== lines out
    table = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(table) < 2:
        raise ValueError("ncu report: no header and units rows (was anything profiled?)")
    header, units, data = table[0], table[1], table[2:]
    col = {name: i for i, name in enumerate(header)}
    missing = [m for m in (*METRICS, "Kernel Name") if m not in col]
    if missing:
        raise ValueError(f"ncu report: columns {missing} missing (ncu version or metric names differ)")
    grid = col.get("Grid Size")
    kernels = []
    for row in data:
        where, _, kernel = row[col["Kernel Name"]].strip().partition("/")
        k = {"range": where, "kernel": re.sub(r"[\s(<].*", "", kernel),
             "grid": row[grid].strip("() ").replace(", ", "x") if grid is not None else ""}
        for metric, name in METRICS.items():
            k[name] = _number(row[col[metric]], units[col[metric]])
        if all(c in col for c in (LAUNCH["waves"], *LIMITS[:4])):
            fits = min(int(_number(row[col[c]], "")) for c in LIMITS if c in col)
            k["waves"] = _number(row[col[LAUNCH["waves"]]], "")
            k["occupancy"] = fits / _number(row[col[LAUNCH["blocks_per_sm_warps"]]], "")
        kernels.append(k)
    return kernels
