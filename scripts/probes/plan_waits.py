"""Probe: the routing plan in one launch whose programs wait for each other, against the three chained launches.

The plan of many pairs counts, scans and places in three launches chained by programmatic dependent launch.
``kernels/align_waits.py`` runs the same three steps in one launch, with a grid-wide wait between them. This
probe times, with the method of every table (CUDA graphs replayed by ``triton.testing.do_bench``, L2 flushed,
interleaved rounds):

  launch_1           one one-program kernel (the floor of any launch)
  launch_3_pdl       three such kernels chained as the plan's are
  waits_empty_P      one kernel of P programs per list (two lists) that only waits twice, as the plan would
  plan               ``plan_layer`` for the two-stream layer (qwen3-30b-a3b, 4 adapters, r 16), by the rule
  plan_waits_P       the same plan in one launch with waits, P programs per list

Every plan is checked equal to the rule's before it is timed and again after (the counters must survive the
graphs' replays). On a GPU, from the repository root:

    PYTHONPATH=. OUT=/tmp/probe python scripts/probes/plan_waits.py [--tokens 64 128 512 2048 8192]

writes ``$OUT/plan_waits.csv``; its ``command`` starts with ``probe:`` (see data/history/README.md).
"""
import argparse
import os
import sys

import torch
import triton
import triton.language as tl

from moelora_lab import align
from moelora_lab.bench.common import device, sweep_routing
from moelora_lab.config import MoEShape
from moelora_lab.kernels.align_waits import _grid_wait, _leave
from moelora_lab.layer import plan_layer
from moelora_lab.profile import timing
from moelora_lab.results import write_csv

PROGRAMS = (16, 32, 64)


@triton.jit
def _waits_only(counters_ptr):
    """Program (p, list): two grid-wide waits of the list's programs and nothing else."""
    programs = tl.num_programs(0)
    counters = counters_ptr + tl.program_id(1) * 3
    _grid_wait(counters, programs)
    _grid_wait(counters + 1, programs)
    _leave(counters, programs)


def _plan(ids, lora, E, L, rank, H, I, waits_programs=None):
    def build():
        if waits_programs is None:
            return plan_layer(ids, lora, E, L, rank, hidden=H, intermediate=I, schedule="dual_stream", validate=False)
        saved = align.WAITS_PROGRAMS
        align.WAITS_PROGRAMS = waits_programs
        try:
            with align.construction(waits_max_pairs=1 << 30):
                return plan_layer(ids, lora, E, L, rank, hidden=H, intermediate=I, schedule="dual_stream",
                                  validate=False)
        finally:
            align.WAITS_PROGRAMS = saved
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
        fns = {"launch_1": lambda: chain(buf, 1, False), "launch_3_pdl": lambda: chain(buf, 3, pdl)}
        for P in PROGRAMS:
            counters = torch.zeros(2, 3, dtype=torch.int32, device=dev)
            fns[f"waits_empty_{P}"] = lambda P=P, c=counters: _waits_only[(P, 2)](c)
        fns["plan"] = _plan(ids, lora, E, L, rank, H, I)
        for P in PROGRAMS:
            fns[f"plan_waits_{P}"] = _plan(ids, lora, E, L, rank, H, I, P)
        if M == tokens[0]:      # the counters of the graphs' capture stream, made before any timed capture
            primer = torch.cuda.CUDAGraph()
            with torch.cuda.graph(primer):
                fns[f"plan_waits_{PROGRAMS[0]}"]()
            del primer
        want = _lists(fns["plan"]())
        for name, fn in fns.items():
            if name.startswith("plan_waits"):
                if not all(torch.equal(a, b) for a, b in zip(_lists(fn()), want)):
                    raise RuntimeError(f"M={M} {name}: the plan differs from the rule's")
        torch.cuda.synchronize()
        timed = timing.time_cuda_interleaved(fns, rounds=3)
        for name, fn in fns.items():
            if name.startswith("plan_waits"):           # after hundreds of replays the counters still work
                if not all(torch.equal(a, b) for a, b in zip(_lists(fn()), want)):
                    raise RuntimeError(f"M={M} {name}: the plan differs from the rule's after the replays")
        for name, t in timed.items():
            if isinstance(t, Exception):
                raise RuntimeError(f"M={M} {name}: {t!r}") from t
            rows.append(dict(preset=shape.name, M=M, pairs=M * shape.top_k, loras=L, rank=rank, variant=name,
                             pdl=int(pdl), us_median=round(t.median_us, 2), us_p20=round(t.p20_us, 2),
                             us_p80=round(t.p80_us, 2), **prov))
            print(M, name, rows[-1]["us_median"], flush=True)
    write_csv(rows, os.path.join(out, "plan_waits.csv"))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", nargs="+", type=int, default=[64, 128, 512, 2048, 8192])
    args = parser.parse_args()
    main(os.environ.get("OUT", "/tmp"), args.tokens,
         " ".join(["probe: python scripts/probes/plan_waits.py", *sys.argv[1:]]))
