"""Probe: what the ``in_join`` schedule's join kernels cost next to the plain ones, and the activation's tiles.

At a few pairs the layer's activation and top-k sum are latency: a handful of loads per program, one
round trip to memory each time a warp needs a value it has not got. The ``in_join`` schedule adds the LoRA to
both (``kernels/in_join``), which puts one more dependent round trip in each (the adapter id and the expert,
then their weights). This probe times, with the method of every table (CUDA graphs replayed by
``triton.testing.do_bench``, L2 flushed, interleaved rounds), qwen3-30b-a3b at r 16 / 64 and M 1, 4, 16:

  act / act_delta                the plain activation, and with the two-stream layer's delta (its join)
  act_lora                       the activation with the LoRA, the rule's tiles (``experiments.in_join.join_block``)
  act_lora_b<cols>_w<warps>      the same with 16..128 columns per program and 1, 2 or 4 warps
  sum / sum_delta / sum_lora     the top-k sum: plain, with the two-stream layer's delta, with the LoRA

each activation checked against the rule's first (h equal, T2's column tiles summing to the same T2). On a GPU,
from the repository root:

    PYTHONPATH=. OUT=/tmp/probe python scripts/probes/join_tiles.py [--tokens 1 4 16] [--ranks 16 64]

writes ``$OUT/join_tiles.csv``; its ``command`` starts with ``probe:`` (see data/history/README.md).
"""
import argparse
import os
import sys

import torch

from moelora_lab.bench.common import close, device, seeded_generator, sweep_routing
from moelora_lab.config import MoEShape, layer_lora_weights
from moelora_lab.experiments.in_join import act_lora, sum_lora
from moelora_lab.base_moe import silu_and_mul, topk_sum
from moelora_lab.profile import timing
from moelora_lab.results import write_csv

TILES = [(block, warps) for block in (16, 32, 64, 128) for warps in (1, 2, 4)]


def main(out: str, tokens: list[int], ranks: list[int], command: str) -> None:
    prov = timing.provenance(command)
    shape = MoEShape.from_name("qwen3-30b-a3b")
    H, I, k, L = shape.hidden, shape.intermediate, shape.top_k, 4
    gen, dtype, dev = seeded_generator(0), torch.bfloat16, device()
    rows = []
    for rank in ranks:
        lora = layer_lora_weights(shape, L, rank, gen, dtype)
        for M in tokens:
            ids, tw, token_lora = sweep_routing(shape, L, M, 0)
            P, flat, lora_ids, w = M * k, ids.reshape(-1), token_lora.to(torch.int32), tw.reshape(-1).float()

            def rand(*size, dt=dtype):
                return torch.randn(*size, device=dev, generator=gen, dtype=dt)

            c1, d13, t1, c3, d2 = rand(P, 2 * I), rand(P, 2 * I), rand(2, P, rank), rand(P, H), rand(P, H)
            h, y = torch.empty(P, I, device=dev, dtype=dtype), torch.empty(M, H, device=dev, dtype=dtype)
            act_args = (c1, t1, lora["w13_lora_b"], lora["w2_lora_a"], flat, lora_ids, None)
            t2 = act_lora(*act_args, h)
            h_rule, t2_rule = h.clone(), t2.sum(1)
            has = lora_ids.repeat_interleave(k) >= 0            # T2 rows the activation writes
            fns = {"act": lambda: silu_and_mul(c1, h, top_k=k),
                   "act_delta": lambda: silu_and_mul(c1, h, top_k=k, delta=d13, token_lora=lora_ids),
                   "act_lora": lambda: act_lora(*act_args, h)}
            for block, warps in TILES:
                hb = torch.empty_like(h)
                t2b = act_lora(*act_args, hb, block=block, num_warps=warps).sum(1)
                if not (close(hb, h_rule) and close(t2b[has], t2_rule[has])):
                    raise RuntimeError(f"r={rank} M={M}: the activation with {block} columns, {warps} warps differs")
                fns[f"act_lora_b{block}_w{warps}"] = (lambda b=block, wp=warps:
                                                      act_lora(*act_args, h, block=b, num_warps=wp))
            fns |= {"sum": lambda: topk_sum(c3, y, top_k=k),
                    "sum_delta": lambda: topk_sum(c3, y, top_k=k, delta=d2, token_lora=lora_ids),
                    "sum_lora": lambda: sum_lora(c3, t2, lora["w2_lora_b"], flat, w, lora_ids, None, y)}
            timed = timing.time_cuda_interleaved(fns, rounds=3)
            for name, t in timed.items():
                if isinstance(t, Exception):
                    raise RuntimeError(f"r={rank} M={M} {name}: {t!r}") from t
                rows.append(dict(preset=shape.name, M=M, pairs=P, loras=L, rank=rank, variant=name,
                                 us_median=round(t.median_us, 2), us_p20=round(t.p20_us, 2),
                                 us_p80=round(t.p80_us, 2), **prov))
                print(rank, M, name, rows[-1]["us_median"], flush=True)
    write_csv(rows, os.path.join(out, "join_tiles.csv"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--ranks", nargs="+", type=int, default=[16, 64])
    args = parser.parse_args()
    main(os.environ.get("OUT", "/tmp"), args.tokens, args.ranks,
         " ".join(["probe: python scripts/probes/join_tiles.py", *sys.argv[1:]]))
