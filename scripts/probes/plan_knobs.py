"""Probe: the routing plan's small rules at the sizes where the plan is near its budget.

The three-launch plan (count, scan, place; ``moelora_lab/routing/device.py``) has knobs that were each measured at some
sizes: pairs per chunk (``chunk_pairs``), the count kernel's warps (``count_warps``), groups per scan program
(``SCAN_GROUPS``) and blocks per table program (``TABLE_BLOCKS``). This probe builds the layer's plan
(qwen3-30b-a3b, 4 adapters, r 16, two streams) with one knob changed at a time, checks every plan equal to the
rule's, and times them in interleaved rounds with the method of every table (CUDA graphs replayed by
``triton.testing.do_bench``, L2 flushed):

  plan               the rule
  chunk_<S>          S pairs per chunk
  count_warps_<W>    W warps in the count kernel
  scan_groups_<G>    G groups per scan program
  table_blocks_<B>   B blocks per table program

On a GPU, from the repository root:

    PYTHONPATH=. OUT=/tmp/probe python scripts/probes/plan_knobs.py [--tokens 128 256 512 1024]

writes ``$OUT/plan_knobs.csv``; its ``command`` starts with ``probe:`` (see data/history/README.md).
"""
import argparse
import os
import sys

import torch

from moelora_lab import rules
from moelora_lab.routing import device as align
from moelora_lab.bench.common import device, sweep_routing
from moelora_lab.config import MoEShape
from moelora_lab.layer import plan_layer
from moelora_lab.profile import timing
from moelora_lab.results import write_csv

# variant -> (module, attribute, value): a function of the construction (replaced by a constant) or a rule
KNOBS = {"chunk_16": (align, "chunk_pairs", 16), "chunk_64": (align, "chunk_pairs", 64),
         "count_warps_2": (align, "count_warps", 2), "count_warps_8": (align, "count_warps", 8),
         "scan_groups_8": (rules, "SCAN_GROUPS", 8), "scan_groups_32": (rules, "SCAN_GROUPS", 32),
         "table_blocks_32": (rules, "TABLE_BLOCKS", 32), "table_blocks_128": (rules, "TABLE_BLOCKS", 128)}


def _plan(ids, lora, E, L, rank, I, knob=None):
    def build():
        if knob is None:
            return plan_layer(ids, lora, E, L, rank, intermediate=I, schedule="dual_stream", validate=False)
        module, name, value = knob
        saved = getattr(module, name)
        setattr(module, name, (lambda n: value) if callable(saved) else value)
        try:
            return plan_layer(ids, lora, E, L, rank, intermediate=I, schedule="dual_stream", validate=False)
        finally:
            setattr(module, name, saved)
    return build


def timed_rows(fns: dict, case: str, prov: dict, **fields) -> list[dict]:
    """The callables ``fns`` timed in interleaved rounds: one row each (``fields``, the variant, its µs, ``prov``)."""
    torch.cuda.synchronize()
    rows = []
    for name, t in timing.time_cuda_interleaved(fns, rounds=3).items():
        if isinstance(t, Exception):
            raise RuntimeError(f"{case} {name}: {t!r}") from t
        rows.append(dict(fields, variant=name, us_median=round(t.median_us, 2), us_p20=round(t.p20_us, 2),
                         us_p80=round(t.p80_us, 2), **prov))
        print(case, name, rows[-1]["us_median"], flush=True)
    return rows


def _lists(plan):
    return [t for blocks in (plan.base_blocks, plan.lora_blocks) for t in blocks.tensors]


def main(out: str, tokens: list[int], command: str) -> None:
    prov = timing.provenance(command)
    dev = torch.device(device())
    shape = MoEShape.from_name("qwen3-30b-a3b")
    E, I, L, rank = shape.num_experts, shape.intermediate, 4, 16
    rows = []
    for M in tokens:
        ids, _, lora = sweep_routing(shape, L, M, 0)
        fns = {"plan": _plan(ids, lora, E, L, rank, I)}
        fns.update({name: _plan(ids, lora, E, L, rank, I, knob) for name, knob in KNOBS.items()})
        want = _lists(fns["plan"]())
        for name, fn in fns.items():
            if not all(torch.equal(a, b) for a, b in zip(_lists(fn()), want)):
                raise RuntimeError(f"M={M} {name}: the plan differs from the rule's")
        rows += timed_rows(fns, f"M={M}", prov, preset=shape.name, M=M, pairs=M * shape.top_k, loras=L, rank=rank,
                           pdl=int(align.chained_launches(dev)))
    write_csv(rows, os.path.join(out, "plan_knobs.csv"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", nargs="+", type=int, default=[128, 256, 512, 1024])
    args = parser.parse_args()
    main(os.environ.get("OUT", "/tmp"), args.tokens,
         " ".join(["probe: python scripts/probes/plan_knobs.py", *sys.argv[1:]]))
