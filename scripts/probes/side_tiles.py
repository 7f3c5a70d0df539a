"""Probe: the two-stream layer at one to four tokens with the side stream's LoRA tiles varied, w13 and w2 apart.

The layer (qwen3-30b-a3b unless ``--presets`` says otherwise, bf16, 4 adapters, r 16 and 64) from a plan made
for two streams, its LoRA launched with the tiles ``dispatch.gpu_config`` gives, or with fields changed for one op
(``VARIANTS``, ``CHUNKS``, ``PATHS``, ``BORDER``); every variant checked against the rule's output, then all of a
case and the layer without LoRA timed in interleaved rounds. On a GPU, from the repository root:

    PYTHONPATH=. OUT=/tmp/probe python scripts/probes/side_tiles.py [--presets deepseek-v2-lite] [--tokens 1 2 4] \
        [--ranks 16 64] [--variants paths]

writes ``$OUT/side_tiles.csv``; its ``command`` starts with ``probe:`` (see data/history/README.md).
"""
import argparse
import os
import sys

import torch

import moelora_lab.op.dispatch as dispatch
from moelora_lab.bench.common import base_weights, device, seeded_generator, sweep_routing
from moelora_lab.config import MoEShape, layer_lora_weights
from moelora_lab.layer import moe_lora_layer, plan_layer
from moelora_lab.profile import timing
from moelora_lab.results import write_csv

VARIANTS = {"rule": {},
            "w2_c16_n128": {"w2": dict(n_chunks=16, block_n=128)},
            "w2_c8_n128": {"w2": dict(n_chunks=8, block_n=128)},
            "w2_c4_n128": {"w2": dict(n_chunks=4, block_n=128)},
            "w2_k256": {"w2": dict(block_k=256)},
            "w2_w4": {"w2": dict(num_warps=4)},
            "w13_c6_n128": {"w13": dict(n_chunks=6, block_n=128)},
            "both_c8": {"w13": dict(n_chunks=6, block_n=128), "w2": dict(n_chunks=8, block_n=128)}}
# --variants chunks: each op's N chunks alone (128-wide tiles), for a chunk rule of the side stream's own
CHUNKS = {"rule": {}, **{f"{op}_c{c}_n128": {op: dict(n_chunks=c, block_n=128)}
                         for op in ("w13", "w2") for c in (1, 2, 4, 8, 16)}}
# --variants paths: the side rule's path beside both paths, one-shot at few chunks of 128 columns per op (w13, w2)
PATHS = {"rule": {}, "two_kernel": {"path": "two_kernel"}, "one_shot": {"path": "one_shot"},
         **{f"one_shot_c{a}_{b}": {"path": "one_shot", "w13": dict(n_chunks=a, block_n=128),
                                   "w2": dict(n_chunks=b, block_n=128)}
            for a, b in ((1, 2), (1, 4), (2, 4), (2, 8), (3, 8), (6, 16))}}
# --variants border: the side rule's path beside both paths (one-shot with the side stream's own chunks, and
# with 4 w13 and 8 w2 chunks of 128 columns)
BORDER = {"rule": {}, "two_kernel": {"path": "two_kernel"}, "one_shot": {"path": "one_shot"},
          "one_shot_c4_8": {"path": "one_shot", "w13": dict(n_chunks=4, block_n=128),
                            "w2": dict(n_chunks=8, block_n=128)}}
_override: dict = {}
_rule = dispatch.gpu_config


def _gpu_config(path, num_pairs, num_groups, n_out, num_slices, sms, *, rank=None, side_stream=False):
    """The rule's tiles, with the active variant's fields for this op (w13: two slices) replaced."""
    cfg = _rule(path, num_pairs, num_groups, n_out, num_slices, sms, rank=rank, side_stream=side_stream)
    change = _override.get("w13" if num_slices == 2 else "w2")
    return cfg.replace(**change) if change else cfg


def main(out: str, presets: list[str], tokens: list[int], ranks: list[int], variants: dict, command: str) -> None:
    dispatch.gpu_config = _gpu_config
    prov = timing.provenance(command)
    rows = [row for preset in presets for row in measure(preset, tokens, ranks, variants, prov)]
    write_csv(rows, os.path.join(out, "side_tiles.csv"))


def measure(preset: str, tokens: list[int], ranks: list[int], variants: dict, prov: dict) -> list[dict]:
    """The rows of one preset: every case's variants and the layer without LoRA."""
    gen = seeded_generator(0)
    shape = MoEShape.from_name(preset)
    E, H, I, L = shape.num_experts, shape.hidden, shape.intermediate, 4
    w13, w2 = base_weights(shape, gen, torch.bfloat16)
    rows = []
    for rank in ranks:
        lora = layer_lora_weights(shape, L, rank, gen, torch.bfloat16)
        for M in tokens:
            ids, tw, tl = sweep_routing(shape, L, M, 0)
            x = torch.randn(M, H, device=device(), generator=gen, dtype=torch.bfloat16)
            plan = plan_layer(ids, tl, E, L, rank, intermediate=I, schedule="dual_stream")
            plans = {p: plan_layer(ids, tl, E, L, rank, intermediate=I, schedule="dual_stream", lora_path=p)
                     for p in ("one_shot", "two_kernel")}
            plain = plan_layer(ids, tl, E, None, None)
            base = (x, ids, tw, tl, w13, w2)

            def run(variant):
                change = dict(variants[variant])
                use = plans[change.pop("path")] if "path" in change else plan
                _override.update(change)
                try:
                    return moe_lora_layer(*base, **lora, schedule="dual_stream", plan=use)
                finally:
                    _override.clear()

            ref = run("rule").float()
            for variant in variants:
                torch.testing.assert_close(run(variant).float(), ref, rtol=2e-2, atol=2e-2)
            fns = {"no_lora": lambda: moe_lora_layer(*base, plan=plain)}
            fns.update({variant: (lambda v=variant: run(v)) for variant in variants})
            timed = timing.time_cuda_interleaved(fns, rounds=3)
            for variant, t in timed.items():
                path = variants.get(variant, {}).get("path", plan.lora_path)
                rows.append(dict(preset=shape.name, M=M, rank=rank, loras=L, path=path, variant=variant,
                                 us_median=round(t.median_us, 2), us_p20=round(t.p20_us, 2),
                                 us_p80=round(t.p80_us, 2),
                                 over_no_lora=round(t.median_us / timed["no_lora"].median_us, 4), **prov))
                print(rank, M, path, variant, rows[-1]["us_median"], rows[-1]["over_no_lora"], flush=True)
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["qwen3-30b-a3b"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--ranks", nargs="+", type=int, default=[16, 64])
    parser.add_argument("--variants", choices=["tiles", "chunks", "paths", "border"], default="tiles",
                        help="tiles: one field changed at a time (VARIANTS); chunks: each op's N chunks (CHUNKS); "
                             "paths: both paths and one-shot at few chunks (PATHS); border: both paths (BORDER)")
    args = parser.parse_args()
    chosen = {"tiles": VARIANTS, "chunks": CHUNKS, "paths": PATHS, "border": BORDER}[args.variants]
    main(os.environ.get("OUT", "/tmp"), args.presets, args.tokens, args.ranks, chosen,
         " ".join(["probe: python scripts/probes/side_tiles.py", *sys.argv[1:]]))
