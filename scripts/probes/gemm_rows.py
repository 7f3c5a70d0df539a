"""Probe: what separates the base GEMMs from torch._grouped_mm at large M: the row gather or the padding?

The base GEMMs read each block's input rows through the routing (``sorted_pairs``: rows scattered over x or h),
scatter their output rows back, and pad each expert's pairs up to whole blocks of BLOCK_M; ``torch._grouped_mm`` is
timed on rows already grouped by expert and computes exactly the rows each expert has. This probe times the rule's
base GEMMs (qwen3-30b-a3b, M 2048 and 8192) on the sweep's routing and on a routing whose pairs already come in
expert order, every expert with the same number of pairs (pair p goes to expert p // (M k / E): a whole number of
blocks, so no padding, and a block's rows contiguous in h and its tokens consecutive in x), beside
``torch._grouped_mm``, with the method of every table (CUDA graphs replayed by ``triton.testing.do_bench``, L2
flushed, interleaved rounds):

  <op>_random / <op>_ordered      our GEMM (w13 or w2) on either routing, whole tiles only (HALF_TAIL off)
  <op>_random_half                the sweep's routing with half tiles for blocks whose second half is padding
  <op>_grouped_mm                 ``torch._grouped_mm`` on pre-grouped rows

The ordered routing changes the order and the padding at once: divide each time by the rows the GEMM computes
(``rows_computed``: ``moe.rows_computed``, also in appendix A1, section 4) to tell them apart. On a GPU, from the repository root:

    PYTHONPATH=. OUT=/tmp/probe python scripts/probes/gemm_rows.py [--tokens 2048 8192] [--presets ...]

writes ``$OUT/gemm_rows.csv``; its ``command`` starts with ``probe:`` (see data/history/README.md).
"""
import argparse
import os
import sys

import torch

from moelora_lab.routing.device import make_blocks
from moelora_lab.bench.common import base_weights, close, device, grouped_mm_fns, seeded_generator, sweep_routing
from moelora_lab.config import MoEShape
from moelora_lab.base_moe import gemm_tiles, moe_gemm, rows_computed
from moelora_lab.profile import timing
from moelora_lab.results import write_csv


def main(out: str, tokens: list[int], presets: list[str], command: str) -> None:
    prov = timing.provenance(command)
    rows = []
    for preset in presets:
        rows += preset_rows(MoEShape.from_name(preset), tokens, prov)
    write_csv(rows, os.path.join(out, "gemm_rows.csv"))


def preset_rows(shape: MoEShape, tokens: list[int], prov: dict) -> list[dict]:
    from plan_knobs import timed_rows       # the same interleaved timing and rows as the plan's probe

    dev = torch.device(device())
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
        fns, computed = {}, {}
        routings = [("random", random_ids, False), ("random_half", random_ids, True)]
        if P % E == 0 and (P // E) % tiles["BLOCK_M"] == 0:          # ordered rows pad nothing: whole blocks only
            routings.append(("ordered", ordered_ids, False))
        for name, ids, half in routings:
            blocks = make_blocks(ids, None, E, 1, tiles["BLOCK_M"])
            if name == "ordered":
                head = blocks.sorted_pairs[:P]
                assert torch.equal(head, torch.arange(P, device=dev, dtype=head.dtype)), "ordered routing not in order"
            computed[name] = rows_computed(torch.bincount(ids.reshape(-1).long(), minlength=E), tiles["BLOCK_M"], half)
            for op, (inp, w, weights) in (("w13", (x, w13, None)), ("w2", (h, w2, wflat))):
                o = torch.empty(P, w.shape[1], device=dev, dtype=torch.bfloat16)
                fns[f"{op}_{name}"] = (lambda inp=inp, w=w, b=blocks, o=o, wt=weights, half=half:
                                       moe_gemm(inp, w, b, o, top_k=k, topk_weights=wt,
                                                tiles=dict(tiles, HALF_TAIL=half)))
        ref13, ref2 = grouped_mm_fns(x, h, random_ids, w13, w2)
        fns["w13_grouped_mm"], fns["w2_grouped_mm"] = ref13, ref2
        # each GEMM checked against torch._grouped_mm on the random routing (the same rows, in expert order)
        order = torch.sort(random_ids.reshape(-1).long(), stable=True).indices
        weighted = ref2().float() * wflat[order][:, None]
        for name in ("random", "random_half"):
            if not close(fns[f"w13_{name}"]()[order].float(), ref13().float()):
                raise RuntimeError(f"{shape.name} M={M}: w13 {name} differs from torch._grouped_mm")
            if not close(fns[f"w2_{name}"]()[order].float(), weighted):
                raise RuntimeError(f"{shape.name} M={M}: w2 {name} differs from torch._grouped_mm")
        computed.update(grouped_mm=P)
        for row in timed_rows(fns, f"{shape.name} M={M}", prov, preset=shape.name, M=M, pairs=P,
                              block_m=tiles["BLOCK_M"]):
            rows.append(dict(row, rows_computed=computed[row["variant"].split("_", 1)[1]]))
    return rows


def run_cli(doc: str, script: str, main) -> None:
    """The GEMM probes' command line: ``--tokens``, ``--presets``, results under ``$OUT``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--tokens", nargs="+", type=int, default=[2048, 8192])
    parser.add_argument("--presets", nargs="+", default=["qwen3-30b-a3b"])
    args = parser.parse_args()
    main(os.environ.get("OUT", "/tmp"), args.tokens, args.presets,
         " ".join([f"probe: python scripts/probes/{script}", *sys.argv[1:]]))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    run_cli(__doc__, "gemm_rows.py", main)
