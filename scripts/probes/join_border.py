"""Probe: where the layer's joins should switch from their few-pairs form to the loop (``moe.rows_as_tile``).

Up to ``rules.SUM_TILE_MAX_PAIRS`` pairs the top-k sum takes a token's k rows as one [k, BLOCK] tile and both
joins load a delta row before they know its adapter; beyond, the sum loops over the rows and the delta load
waits for the adapter id. The border came from the layer at M = 128 (1024 pairs, the tile level with the
loop) and M = 512 (4096 pairs, the tile slower). This probe times both forms of each join alone in between,
qwen3-30b-a3b (k = 8), every token with an adapter, with the method of every table (CUDA graphs replayed by
``triton.testing.do_bench``, L2 flushed, interleaved rounds):

  act_delta_<form>               the activation with the two-stream layer's delta
  sum_<form> / sum_delta_<form>  the top-k sum, plain and with the delta

for <form> ``tile`` (the few-pairs form) and ``loop``, each form's output checked against the other's first.
On a GPU, from the repository root:

    PYTHONPATH=. OUT=/tmp/probe python scripts/probes/join_border.py [--tokens 64 128 192 256 384 512]

writes ``$OUT/join_border.csv``; its ``command`` starts with ``probe:`` (see data/history/README.md).
"""
import argparse
import os
import sys

import torch

from moelora_lab import base_moe as moe, rules
from moelora_lab.bench.common import close, device, seeded_generator, sweep_routing
from moelora_lab.config import MoEShape
from moelora_lab.profile import timing
from moelora_lab.results import write_csv

FORMS = {"tile": 1 << 40, "loop": 0}        # rules.SUM_TILE_MAX_PAIRS that forces each form


def in_form(form: str, fn):
    """``fn`` run with the joins in ``form`` (the border is read at each launch, so also under graph capture)."""
    def run():
        kept, rules.SUM_TILE_MAX_PAIRS = rules.SUM_TILE_MAX_PAIRS, FORMS[form]
        try:
            return fn()
        finally:
            rules.SUM_TILE_MAX_PAIRS = kept
    return run


def main(out: str, tokens: list[int], command: str) -> None:
    prov = timing.provenance(command)
    shape = MoEShape.from_name("qwen3-30b-a3b")
    H, I, k = shape.hidden, shape.intermediate, shape.top_k
    gen, dtype, dev = seeded_generator(0), torch.bfloat16, device()
    rows = []
    for M in tokens:
        _, _, token_lora = sweep_routing(shape, 4, M, 0)
        P, lora_ids = M * k, token_lora.to(torch.int32)
        c1, d13, c3, d2 = (torch.randn(P, n, device=dev, generator=gen, dtype=dtype) for n in (2 * I, 2 * I, H, H))
        fns, outs = {}, {}
        for form in FORMS:
            h, y, yd = (torch.empty(P, I, device=dev, dtype=dtype), torch.empty(M, H, device=dev, dtype=dtype),
                        torch.empty(M, H, device=dev, dtype=dtype))
            fns |= {f"act_delta_{form}": in_form(form, lambda h=h: moe.silu_and_mul(c1, h, top_k=k, delta=d13,
                                                                                    token_lora=lora_ids)),
                    f"sum_{form}": in_form(form, lambda y=y: moe.topk_sum(c3, y, top_k=k)),
                    f"sum_delta_{form}": in_form(form, lambda y=yd: moe.topk_sum(c3, y, top_k=k, delta=d2,
                                                                                 token_lora=lora_ids))}
            outs[form] = [fns[f"{name}_{form}"]().clone() for name in ("act_delta", "sum", "sum_delta")]
        for name, a, b in zip(("act_delta", "sum", "sum_delta"), outs["tile"], outs["loop"]):
            if not close(a, b):
                raise RuntimeError(f"M={M} {name}: the tile and the loop differ")
        timed = timing.time_cuda_interleaved(fns, rounds=3)
        for name, t in timed.items():
            if isinstance(t, Exception):
                raise RuntimeError(f"M={M} {name}: {t!r}") from t
            rows.append(dict(preset=shape.name, M=M, pairs=P, loras=4, variant=name, us_median=round(t.median_us, 2),
                             us_p20=round(t.p20_us, 2), us_p80=round(t.p80_us, 2), **prov))
            print(M, P, name, rows[-1]["us_median"], flush=True)
        write_csv(rows, os.path.join(out, "join_border.csv"))     # after each M: a cut-short run keeps its cases


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", nargs="+", type=int, default=[64, 128, 192, 256, 384, 512, 1024])
    args = parser.parse_args()
    main(os.environ.get("OUT", "/tmp"), args.tokens,
         " ".join(["probe: python scripts/probes/join_border.py", *sys.argv[1:]]))
