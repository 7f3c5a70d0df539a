"""Probe: what separates the base GEMMs from torch._grouped_mm at large M: the row gather or the padding?

The base GEMMs read each block's input rows through the routing (``sorted_pairs``: rows scattered over x or h),
scatter their output rows back, and pad each expert's pairs up to whole blocks of BLOCK_M; ``torch._grouped_mm`` is
timed on rows already grouped by expert and computes exactly the rows each expert has. This probe times the rule's
base GEMMs (qwen3-30b-a3b, M 2048 and 8192) on the sweep's routing and on a routing whose pairs already come in
expert order, every expert with the same number of pairs (pair p goes to expert p // (M k / E): a whole number of
blocks, so no padding, and a block's rows contiguous in h and its tokens consecutive in x), beside
``torch._grouped_mm``, with the method of every table (CUDA graphs replayed by ``triton.testing.do_bench``, L2
flushed, interleaved rounds):

  <op>_random / <op>_ordered      our GEMM (w13 or w2) on either routing
  <op>_grouped_mm                 ``torch._grouped_mm`` on pre-grouped rows

The ordered routing changes the order and the padding at once: divide each time by the rows the GEMM computes
(notebook 05, section 4) to tell them apart. On a GPU, from the
repository root:

    PYTHONPATH=. OUT=/tmp/probe python scripts/probes/gemm_rows.py [--tokens 2048 8192]

writes ``$OUT/gemm_rows.csv``; its ``command`` starts with ``probe:`` (see data/history/README.md).
"""
import argparse
import os
import sys

import torch

from moelora_lab.align import make_blocks
from moelora_lab.bench.common import base_weights, close, device, grouped_mm_fns, seeded_generator, sweep_routing
from moelora_lab.config import MoEShape
from moelora_lab.moe import gemm_tiles, moe_gemm
from moelora_lab.profile import timing
from moelora_lab.results import write_csv


def main(out: str, tokens: list[int], command: str) -> None:
    from plan_knobs import timed_rows       # the same interleaved timing and rows as the plan's probe

    prov = timing.provenance(command)
    dev = torch.device(device())
    shape = MoEShape.from_name("qwen3-30b-a3b")
    E, H, I, k = shape.num_experts, shape.hidden, shape.intermediate, shape.top_k
    gen = seeded_generator(0)
    w13, w2 = base_weights(shape, gen, torch.bfloat16)
    rows = []
    for M in tokens:
        P = M * k
        random_ids, tw, _ = sweep_routing(shape, 4, M, 0)
        ordered_ids = (torch.arange(P, device=dev) // (P // E)).clamp(max=E - 1).reshape(M, k).to(random_ids.dtype)
        x = torch.randn(M, H, device=dev, generator=gen, dtype=torch.bfloat16)
        h = torch.randn(P, I, device=dev, generator=gen, dtype=torch.bfloat16)
        wflat = tw.reshape(-1).float().contiguous()
        tiles = gemm_tiles(P, E)
        fns = {}
        for name, ids in (("random", random_ids), ("ordered", ordered_ids)):
            blocks = make_blocks(ids, None, E, 1, tiles["BLOCK_M"])
            if name == "ordered":
                head = blocks.sorted_pairs[:P]
                assert torch.equal(head, torch.arange(P, device=dev, dtype=head.dtype)), "ordered routing not in order"
            for op, (inp, w, weights) in (("w13", (x, w13, None)), ("w2", (h, w2, wflat))):
                o = torch.empty(P, w.shape[1], device=dev, dtype=torch.bfloat16)
                fns[f"{op}_{name}"] = (lambda inp=inp, w=w, b=blocks, o=o, wt=weights:
                                       moe_gemm(inp, w, b, o, top_k=k, topk_weights=wt, tiles=tiles))
        ref13, ref2 = grouped_mm_fns(x, h, random_ids, w13, w2)
        fns["w13_grouped_mm"], fns["w2_grouped_mm"] = ref13, ref2
        # each GEMM checked against torch._grouped_mm on the random routing (the same rows, in expert order)
        order = torch.sort(random_ids.reshape(-1).long(), stable=True).indices
        if not close(fns["w13_random"]()[order].float(), ref13().float()):
            raise RuntimeError(f"M={M}: w13 differs from torch._grouped_mm")
        weighted = ref2().float() * wflat[order][:, None]
        if not close(fns["w2_random"]()[order].float(), weighted):
            raise RuntimeError(f"M={M}: w2 differs from torch._grouped_mm")
        rows += timed_rows(fns, f"M={M}", prov, preset=shape.name, M=M, pairs=P)
    write_csv(rows, os.path.join(out, "gemm_rows.csv"))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", nargs="+", type=int, default=[2048, 8192])
    args = parser.parse_args()
    main(os.environ.get("OUT", "/tmp"), args.tokens,
         " ".join(["probe: python scripts/probes/gemm_rows.py", *sys.argv[1:]]))
