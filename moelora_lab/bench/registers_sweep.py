"""``python -m moelora_lab.bench registers``: registers, spills, shared memory and occupancy of the
one-shot kernel, compiled across ranks with and without rank tiling (no timing). A compile that runs
out of resources is a result, recorded in ``error``.

Shape legend: r rank; BLOCK_M rows of a tile, max_block_r the widest rank tile.
"""
from __future__ import annotations

from pathlib import Path

from ..profile import timing
from ..profile.report import one_shot_report
from .common import DEFAULT_OUT, GPU_ONLY, progress

NAME = "registers"
REPORT_FIELDS = ("n_regs", "n_spills", "shared_bytes", "num_warps", "blocks_per_sm", "occupancy")


def add_parser(sub):
    what = "registers / spills / occupancy of the one-shot kernel vs rank"
    g = sub.add_parser(NAME, help=what, description=f"{what[0].upper()}{what[1:]} (compiled, not timed). {GPU_ONLY}")
    g.add_argument("--ranks", nargs="+", type=int, default=[16, 32, 64, 128, 192, 256, 512],
                   help="LoRA ranks r to compile for (default: %(default)s)")
    g.add_argument("--block-m", nargs="+", type=int, default=[16, 64],
                   help="rows BLOCK_M of a tile (default: %(default)s)")
    g.add_argument("--max-block-r", nargs="+", type=int, default=[128, 512],
                   help="widest rank tile; 512 means one tile up to r = 512 (no rank tiling)")
    g.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="folder for the CSV (default: the committed data, %(default)s)")
    g.add_argument("--name", default="registers", help="file stem of the CSV (default: %(default)s)")


def run(args) -> list[dict]:
    prov = timing.provenance(args.command)
    rows = []
    cases = [(r, bm, mbr) for r in args.ranks for bm in args.block_m for mbr in args.max_block_r]
    for rank, block_m, max_block_r in progress(cases, desc="compile", unit="kernel"):
        try:
            rep = one_shot_report(rank, block_m=block_m, max_block_r=max_block_r).as_dict()
            error = ""
        except Exception as exc:  # an out-of-resources compile is a result here, not a crash
            rep, error = {}, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        rows.append(dict(rank=rank, block_m=block_m, max_block_r=max_block_r,
                         **{f: rep.get(f, "") for f in REPORT_FIELDS}, error=error, **prov))
    return rows
