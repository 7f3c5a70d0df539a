"""Benchmarks of the LoRA op and the MoE layer on a CUDA GPU, each written to a CSV with provenance.

``python -m moelora_lab.bench <subcommand> [--out DIR] ...``: the subcommands are the modules in
``SUBCOMMANDS``; each one adds its parser (``add_parser(sub)``), measures (``run(args)`` -> rows),
and may draw plots from its rows (``save_plots(rows, args)`` -> paths). This module writes the CSV
``<out>/<name>.csv`` and records the command (:func:`moelora_lab.bench.common.command_line`) and the
adapter assignment (``--adapters``) in every row. Only ``__main__`` imports it.
"""
from __future__ import annotations

import argparse
import sys

import torch

from ..results import write_csv
from . import (align_sweep, common, dram_sweep, eager_sweep, expand_sweep, gemm_sweep, grad_sweep, in_k_sweep,
               kernels_sweep, layer_sweep, layout_sweep, profiler_sweep, registers_sweep, train_sweep, tune_sweep)

# in the order --help lists them
SUBCOMMANDS = {m.NAME: m for m in (kernels_sweep, registers_sweep, layer_sweep, align_sweep, gemm_sweep,
                                   eager_sweep, tune_sweep, layout_sweep, expand_sweep, profiler_sweep, in_k_sweep,
                                   dram_sweep, train_sweep, grad_sweep)}


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m moelora_lab.bench``, a subparser per module of ``SUBCOMMANDS``."""
    p = argparse.ArgumentParser(prog=common.PROG, description=__doc__.split("\n\n")[0],
                                epilog="Every subcommand needs a CUDA GPU and stops at once on a CPU (but `dram "
                                       "--from-report`, which parses a saved report); `<subcommand> --help` lists its "
                                       "options.")
    sub = p.add_subparsers(dest="what", required=True)
    for module in SUBCOMMANDS.values():
        module.add_parser(sub)
    return p


def parse_args(argv) -> argparse.Namespace:
    """The parsed subcommand and its arguments, with ``argv`` and the recorded ``command``."""
    args = build_parser().parse_args(argv)
    args.argv = list(argv)
    args.command = common.command_line(argv)
    return args


def _with_column(row: dict, name: str, value, *, after: str) -> dict:
    """``row`` with ``name`` = ``value`` placed right after the column ``after`` (last where there is none)."""
    out = {}
    for key, v in row.items():
        out[key] = v
        if key == after:
            out[name] = value
    out.setdefault(name, value)
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not torch.cuda.is_available() and common.DEVICE == "cuda" and getattr(args, "from_report", None) is None:
        print("the benchmark times CUDA kernels and needs a GPU; on the CPU, read the committed CSVs under "
              f"{common.DEFAULT_OUT} (the notebooks plot them)", file=sys.stderr)
        return 2
    module = SUBCOMMANDS[args.what]
    rows = module.run(args)
    if hasattr(args, "adapters"):             # how the sequences got their adapters, beside the adapter count
        rows = [_with_column(row, "adapters", args.adapters, after="loras") for row in rows]
    csv_path = args.out / f"{args.name}.csv"
    write_csv(rows, csv_path)
    print(f"wrote {csv_path} ({len(rows)} rows)", file=sys.stderr)
    for png in getattr(module, "save_plots", lambda rows, args: [])(rows, args):
        print(f"wrote {png}", file=sys.stderr)
    return 0
