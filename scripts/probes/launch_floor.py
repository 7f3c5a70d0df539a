"""Probe: what one, two and three dependent launches cost under the lab's timing, beside the routing plan.

The plan of many pairs is three launches (count, scan, place) chained by programmatic dependent launch; this
probe times, with the same method as every table (a CUDA graph replayed by ``triton.testing.do_bench``, L2
flushed before each replay, interleaved rounds), kernels that do almost nothing, so that the plan's time can be
set against the floor its launches alone put under it:

  launch_1                one program that writes one int
  launch_2_pdl / _3_pdl   two / three such kernels, each reading the int the one before wrote, chained by
                          programmatic dependent launch as the plan's are
  launch_3                the same three, not chained
  read_ids                one program that reads the routing ids (cold, M * k ints) and writes their sum
  plan                    ``plan_layer`` for the two-stream layer (qwen3-30b-a3b, 4 adapters, r 16): the
                          layer's base and LoRA block lists in the same launches

On a GPU, from the repository root:

    PYTHONPATH=. OUT=/tmp/probe python scripts/probes/launch_floor.py [--tokens 1 16 64 128 512 2048 8192]

writes ``$OUT/launch_floor.csv``; its ``command`` starts with ``probe:`` (see data/history/README.md).
"""
import argparse
import os
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moelora_lab.routing.device import chained_launches
from moelora_lab.bench.common import device, sweep_routing
from moelora_lab.config import MoEShape
from moelora_lab.layer import plan_layer
from moelora_lab.profile import timing
from moelora_lab.results import write_csv


@triton.jit
def _step(src_ptr, dst_ptr, FIRST: tl.constexpr, LAST: tl.constexpr, PDL: tl.constexpr):
    """dst[0] = src[0] + 1, waiting for the kernel before it (unless FIRST) and letting the next be placed."""
    if PDL and not FIRST:
        gdc_wait()
    tl.store(dst_ptr, tl.load(src_ptr) + 1)
    if PDL and not LAST:
        gdc_launch_dependents()


@triton.jit
def _read(ids_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out[0] = the sum of n ids (every id read once)."""
    acc = tl.zeros((BLOCK,), dtype=tl.int64)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(ids_ptr + offs, mask=offs < n, other=0).to(tl.int64)
    tl.store(out_ptr, tl.sum(acc, 0))


def chain(buf: torch.Tensor, launches: int, pdl: bool) -> None:
    """``launches`` one-program kernels, each reading what the one before wrote."""
    for i in range(launches):
        _step[(1,)](buf[i:], buf[i + 1:], FIRST=i == 0, LAST=i == launches - 1, PDL=pdl, launch_pdl=pdl and i > 0)


def main(out: str, tokens: list[int], command: str) -> None:
    prov = timing.provenance(command)
    dev = torch.device(device())
    pdl = chained_launches(dev)
    shape = MoEShape.from_name("qwen3-30b-a3b")
    E, I, L, rank = shape.num_experts, shape.intermediate, 4, 16
    buf = torch.zeros(8, dtype=torch.int32, device=dev)
    total = torch.zeros(1, dtype=torch.int64, device=dev)
    rows = []
    for M in tokens:
        ids, _, tl_ = sweep_routing(shape, L, M, 0)
        flat = ids.reshape(-1)
        fns = {"launch_1": lambda: chain(buf, 1, False),
               "launch_2_pdl": lambda: chain(buf, 2, pdl),
               "launch_3_pdl": lambda: chain(buf, 3, pdl),
               "launch_3": lambda: chain(buf, 3, False),
               "read_ids": lambda: _read[(1,)](flat, total, flat.numel(), BLOCK=1024),
               "plan": lambda: plan_layer(ids, tl_, E, L, rank, intermediate=I, schedule="dual_stream",
                                          validate=False)}
        chain(buf, 3, pdl)
        torch.cuda.synchronize()
        if int(buf[3]) != int(buf[0]) + 3:
            raise RuntimeError(f"the chained launches did not run in order: {buf.tolist()}")
        timed = timing.time_cuda_interleaved(fns, rounds=3)
        for name, t in timed.items():
            if isinstance(t, Exception):
                raise RuntimeError(f"M={M} {name}: {t!r}") from t
            rows.append(dict(preset=shape.name, M=M, pairs=flat.numel(), loras=L, rank=rank, variant=name,
                             pdl=int(pdl), us_median=round(t.median_us, 2), us_p20=round(t.p20_us, 2),
                             us_p80=round(t.p80_us, 2), **prov))
            print(M, name, rows[-1]["us_median"], flush=True)
    write_csv(rows, os.path.join(out, "launch_floor.csv"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 64, 128, 512, 2048, 8192])
    args = parser.parse_args()
    main(os.environ.get("OUT", "/tmp"), args.tokens,
         " ".join(["probe: python scripts/probes/launch_floor.py", *sys.argv[1:]]))
