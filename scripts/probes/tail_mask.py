"""Probe: what the in-K GEMMs pay to keep weights nothing should read out of every row (``MASK_TAIL``).

The ``in_k`` schedule multiplies each pair's LoRA intermediate T (zeros outside its own slot's columns and past
its slot's rank) by the packed B of every slot. A slot no token uses, or B past a slot's rank, may hold NaN (a
server allocates slots with ``torch.empty`` and loads them later), and 0 * NaN = NaN would then reach every row.
So in the K steps that hold T, the grouped GEMM drops the W columns no row of its tile uses (one compare and one
select per such step). This probe times both GEMMs of ``in_k`` with the drop (what the layer runs) and without
(``tiles["MASK_TAIL"] = False``), on T made by the layer's own shrinks, qwen3-30b-a3b, bf16, 4 adapters, with the
method of every table (CUDA graphs replayed by ``triton.testing.do_bench``, L2 flushed, interleaved rounds):

  w13_masked / w13_unmasked   the w13 GEMM over x and its tail T1 [2, P, L*r]
  w2_masked / w2_unmasked     the w2 GEMM over h_ext = [h | T2]
  in_k                        the whole ``in_k`` layer (masked), for scale

each pair's outputs checked equal first (with finite weights the dropped products are zeros). On a GPU, from the
repository root:

    PYTHONPATH=. OUT=/tmp/probe python scripts/probes/tail_mask.py [--tokens 512 2048 8192] [--ranks 16 64]

writes ``$OUT/tail_mask.csv``; its ``command`` starts with ``probe:`` (see data/history/README.md).
"""
import argparse
import os
import sys

import torch

from moelora_lab.bench.common import base_weights, device, seeded_generator, sweep_routing
from moelora_lab.config import MoEShape, layer_lora_weights
from moelora_lab.in_k_launch import shrink_tail
from moelora_lab.layer import plan_layer
from moelora_lab.layer_in_k import W13_ONE_READ, in_k_layer, pack_w13_in_k, pack_w2_in_k
from moelora_lab.moe import gemm_tiles, moe_gemm
from moelora_lab.profile import timing
from moelora_lab.results import write_csv

LORAS = 4


def gemms(x, h_ext, t13, w13_ext, w2_ext, blocks, weights, k: int, I: int, masked: bool):
    """The two in-K GEMMs, with the tail's unused W columns dropped (``masked``) or multiplied."""
    P = h_ext.shape[0]
    tiles = dict(gemm_tiles(P, w13_ext.shape[0]), MASK_TAIL=masked)
    c1 = x.new_empty(P, w13_ext.shape[1])
    c3 = x.new_empty(P, w2_ext.shape[1])
    w13 = lambda: moe_gemm(x, w13_ext, blocks, c1, top_k=k, tiles=tiles, x_tail=t13)
    w2 = lambda: moe_gemm(h_ext, w2_ext, blocks, c3, top_k=k, topk_weights=weights, tiles=tiles, lora_from=I)
    return w13, w2


def main(out: str, tokens: list[int], ranks: list[int], command: str) -> None:
    prov = timing.provenance(command)
    shape = MoEShape.from_name("qwen3-30b-a3b")
    E, H, I, k = shape.num_experts, shape.hidden, shape.intermediate, shape.top_k
    gen, dtype, dev = seeded_generator(0), torch.bfloat16, device()
    w13, w2 = base_weights(shape, gen, dtype)
    rows = []
    for rank in ranks:
        lora = layer_lora_weights(shape, LORAS, rank, gen, dtype)
        w13_ext, w2_ext = pack_w13_in_k(w13, lora["w13_lora_b"]), pack_w2_in_k(w2, lora["w2_lora_b"])
        for M in tokens:
            ids, tw, tl = sweep_routing(shape, LORAS, M, 0)
            P, LR = M * k, LORAS * rank
            x = torch.randn(M, H, device=dev, generator=gen, dtype=dtype)
            plan = plan_layer(ids, tl, E, LORAS, rank, hidden=H, intermediate=I, schedule="sequential")
            tl32, weights = tl.to(torch.int32).contiguous(), tw.reshape(-1).float().contiguous()
            t13 = torch.empty(2, P, LR, device=dev, dtype=dtype)          # T as the layer's shrinks write it
            shrink_tail(x, lora["w13_lora_a"], plan, tl32, k, t13, I, rank, None, token_rows=True,
                        one_read=W13_ONE_READ)
            h_ext = torch.randn(P, I + LR, device=dev, generator=gen, dtype=dtype)
            shrink_tail(h_ext, lora["w2_lora_a"], plan, tl32, k, h_ext[:, I:].unsqueeze(0), H, rank, None)
            fns = {}
            for masked, tag in ((True, "masked"), (False, "unmasked")):
                fns[f"w13_{tag}"], fns[f"w2_{tag}"] = gemms(x, h_ext, t13, w13_ext, w2_ext, plan.base_blocks,
                                                            weights, k, I, masked)
            for op in ("w13", "w2"):
                if not torch.equal(fns[f"{op}_masked"](), fns[f"{op}_unmasked"]()):
                    raise RuntimeError(f"r={rank} M={M} {op}: the masked GEMM differs from the unmasked one")
            fns["in_k"] = lambda: in_k_layer(x, ids, tw, tl, w13_ext, w2_ext, lora["w13_lora_a"], lora["w2_lora_a"],
                                             plan=plan)
            timed = timing.time_cuda_interleaved(fns, rounds=3)
            for name, t in timed.items():
                if isinstance(t, Exception):
                    raise RuntimeError(f"r={rank} M={M} {name}: {t!r}") from t
                rows.append(dict(preset=shape.name, M=M, rank=rank, loras=LORAS, variant=name,
                                 us_median=round(t.median_us, 2), us_p20=round(t.p20_us, 2), us_p80=round(t.p80_us, 2),
                                 **prov))
                print(rank, M, name, rows[-1]["us_median"], flush=True)
            write_csv(rows, os.path.join(out, "tail_mask.csv"))   # after each case: a cut-short run keeps its cases
        del lora, w13_ext, w2_ext
        torch.cuda.empty_cache()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", nargs="+", type=int, default=[512, 2048, 8192])
    parser.add_argument("--ranks", nargs="+", type=int, default=[16, 64])
    args = parser.parse_args()
    main(os.environ.get("OUT", "/tmp"), args.tokens, args.ranks,
         " ".join(["probe: python scripts/probes/tail_mask.py", *sys.argv[1:]]))
