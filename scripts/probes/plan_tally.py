"""Probe: the routing plan in two launches (a count with running totals, then the place), against three.

The plan of many pairs counts, scans and places in three launches chained by programmatic dependent launch.
``kernels/align_tally.py`` does without the scan: the count adds each chunk's groups to running totals, and each
placing program sums the counts of the chunks before its own. This probe times, with the method of every table
(CUDA graphs replayed by ``triton.testing.do_bench``, L2 flushed, interleaved rounds):

  launch_1 / launch_2_pdl / launch_3_pdl   one, two, three one-program kernels, chained as the plan's are
  plan               ``plan_layer`` for the two-stream layer (qwen3-30b-a3b, 4 adapters, r 16), by the rule
  plan_tally         the same plan in two launches
  plan_tally_c<S>    the same with S pairs per chunk

Every plan is checked equal to the rule's before it is timed and again after (the totals must be left at zero
through the graphs' replays). On a GPU, from the repository root:

    PYTHONPATH=. OUT=/tmp/probe python scripts/probes/plan_tally.py [--tokens 128 256 512 1024 2048 8192]

writes ``$OUT/plan_tally.csv``; its ``command`` starts with ``probe:`` (see data/history/README.md).
"""
import argparse
import os
import sys

import torch
from moelora_lab import align
from moelora_lab.bench.common import device, sweep_routing
from moelora_lab.config import MoEShape
from moelora_lab.layer import plan_layer
from moelora_lab.profile import timing
from moelora_lab.results import write_csv

CHUNKS = (16, 64)


def _plan(ids, lora, E, L, rank, H, I, tally=False, chunk=None):
    def build():
        saved = align.chunk_pairs
        if chunk:
            align.chunk_pairs = lambda n: chunk
        try:
            with align.construction(tally_max_pairs=(1 << 30) if tally else None):
                return plan_layer(ids, lora, E, L, rank, hidden=H, intermediate=I, schedule="dual_stream",
                                  validate=False)
        finally:
            align.chunk_pairs = saved
    return build


def _lists(plan):
    return [t for blocks in (plan.base_blocks, plan.lora_blocks) for t in blocks.tensors]


def main(out: str, tokens: list[int], command: str) -> None:
    from launch_floor import chain          # the same one-program kernels as the launch floor probe

    prov = timing.provenance(command)
    dev = torch.device(device())
    pdl = align.chained_launches(dev)
    shape = MoEShape.from_name("qwen3-30b-a3b")
    E, H, I, L, rank = shape.num_experts, shape.hidden, shape.intermediate, 4, 16
    buf = torch.zeros(8, dtype=torch.int32, device=dev)
    rows = []
    for M in tokens:
        ids, _, lora = sweep_routing(shape, L, M, 0)
        fns = {"launch_1": lambda: chain(buf, 1, False), "launch_2_pdl": lambda: chain(buf, 2, pdl),
               "launch_3_pdl": lambda: chain(buf, 3, pdl), "plan": _plan(ids, lora, E, L, rank, H, I),
               "plan_tally": _plan(ids, lora, E, L, rank, H, I, tally=True)}
        for S in CHUNKS:
            fns[f"plan_tally_c{S}"] = _plan(ids, lora, E, L, rank, H, I, tally=True, chunk=S)
        if M == tokens[0]:      # the totals of the graphs' capture stream, made before any timed capture
            primer = torch.cuda.CUDAGraph()
            with torch.cuda.graph(primer):
                fns["plan_tally"]()
            del primer
        want = _lists(fns["plan"]())
        for name, fn in fns.items():
            if name.startswith("plan_tally"):
                if not all(torch.equal(a, b) for a, b in zip(_lists(fn()), want)):
                    raise RuntimeError(f"M={M} {name}: the plan differs from the rule's")
        torch.cuda.synchronize()
        timed = timing.time_cuda_interleaved(fns, rounds=3)
        for name, fn in fns.items():
            if name.startswith("plan_tally"):           # after hundreds of replays the counters still work
                if not all(torch.equal(a, b) for a, b in zip(_lists(fn()), want)):
                    raise RuntimeError(f"M={M} {name}: the plan differs from the rule's after the replays")
        for name, t in timed.items():
            if isinstance(t, Exception):
                raise RuntimeError(f"M={M} {name}: {t!r}") from t
            rows.append(dict(preset=shape.name, M=M, pairs=M * shape.top_k, loras=L, rank=rank, variant=name,
                             pdl=int(pdl), us_median=round(t.median_us, 2), us_p20=round(t.p20_us, 2),
                             us_p80=round(t.p80_us, 2), **prov))
            print(M, name, rows[-1]["us_median"], flush=True)
    write_csv(rows, os.path.join(out, "plan_tally.csv"))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", nargs="+", type=int, default=[128, 256, 512, 1024, 2048, 8192])
    args = parser.parse_args()
    main(os.environ.get("OUT", "/tmp"), args.tokens,
         " ".join(["probe: python scripts/probes/plan_tally.py", *sys.argv[1:]]))
