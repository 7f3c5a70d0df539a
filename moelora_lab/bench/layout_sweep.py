"""``python -m moelora_lab.bench layout``: the LoRA op with B in either memory order, r-fastest (as
given) and N-fastest (``ops.pack_lora_b``), the evidence behind packing B. Per (preset, rank, op, M)
the path the dispatcher picks (``dispatch.choose_path``) runs with both layouts on the same routing
metadata (built once, not timed); the outputs must agree before either is timed (a CUDA-graph replay
with L2 flushed).

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, K in, N out, S slices.
"""
from __future__ import annotations

import torch

from ..config import MoEShape, random_lora_weights
from ..op.dispatch import choose_config, choose_path
from ..op.face import moe_lora, pack_lora_b
from ..profile import timing
from ..routing.host import block_list
from .common import close, device, seeded_generator, sweep_parser, sweep_routing

NAME = "layout"


def add_parser(sub):
    sweep_parser(sub, NAME, "the one-shot op with LoRA B r-fastest (as given) vs N-fastest (packed)",
                 name="b_layout", tokens=(1, 16, 64, 512, 2048), ranks=(16, 64))


def run(args) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    prov = timing.provenance(args.command)
    gen = seeded_generator(args.seed)
    rows = []
    for preset in args.presets:
        shape = MoEShape.from_name(preset)
        L, k = args.loras, shape.top_k
        for rank in args.ranks:
            for op in ("w13", "w2"):
                a, b = random_lora_weights(shape, op, L, rank, gen, dtype)
                layouts = {"r_fastest": b, "n_fastest": pack_lora_b(b)}
                for M in args.tokens:
                    ids, tw, tl = sweep_routing(shape, L, M, args.seed, args.adapters)
                    x = torch.randn(M if op == "w13" else M * k, a[0].shape[3], device=device(), generator=gen,
                                    dtype=dtype)
                    N, S, P = b[0].shape[2], len(a), M * k
                    out = torch.zeros(M, k, S * N, device=device(), dtype=dtype)
                    path = choose_path(P, shape.num_experts, L, rank, N)
                    cfg = choose_config(path, P, min(P, L * shape.num_experts), N, S, x.device, rank=rank)
                    blocks = block_list(ids, tl, shape.num_experts, L, cfg.block_m)    # built once, not timed
                    want = None
                    for name, bb in layouts.items():
                        fn = lambda: moe_lora(x, ids, tw, tl, a, bb, path=path, mul_routed_weight=op == "w2",
                                              output=out, add_inputs=False, blocks=blocks)
                        got = fn().float().clone()
                        want = got if want is None else want
                        if not close(got, want, 1e-2):
                            raise RuntimeError(f"{op} M={M} r={rank}: the {name} layout changed the result")
                        t = timing.time_cuda(fn)
                        rows.append(dict(preset=preset, op=op, path=path, M=M, rank=rank, loras=L,
                                         dtype=args.dtype, b_layout=name, us_median=round(t.median_us, 2),
                                         us_p20=round(t.p20_us, 2), us_p80=round(t.p80_us, 2), **prov))
                del a, b, layouts
                torch.cuda.empty_cache()
    return rows
