"""``python -m moelora_lab.bench expand``: what each choice in the one-shot kernel's build buys. The
one-shot path, with the tiles the rule gives it, is timed built each way of ``VARIANTS`` (the kernel
that keeps every build knob: ``experiments.one_shot_builds``), all of a case in interleaved rounds,
after each one's output has been checked against the reference; LoRA B as given (r fastest) and, at
the M in ``--packed-tokens``, packed N-fastest (``op.face.pack_lora_b``).

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, K in, N out, S slices.
"""
from __future__ import annotations

from dataclasses import asdict

import torch

from ..config import MoEShape, random_lora_weights
from ..op.dispatch import choose_config
from ..experiments.one_shot_builds import OneShotBuild, moe_lora_built
from ..op.face import pack_lora_b
from ..profile import timing
from ..profile.traffic import count_workload, lora_op_traffic
from ..reference import moe_lora_reference
from ..routing.host import block_list
from .common import close, device, progress, seeded_generator, sweep_parser, sweep_routing

NAME = "expand"
ROUNDS = 3
# name: (OneShotBuild fields, w13 only). "before" is the kernel as it was: scattered rank offsets (B, rank
# fastest, loaded 2 bytes at a time, unpipelined) and the output tile loaded in its own step. expand_stages 0
# is the tile's num_stages, 1 no pipeline.
VARIANTS = {
    "before": (dict(clamp_ranks=True, prefetch_out=False, expand_stages=0), False),
    "contiguous": (dict(prefetch_out=False, expand_stages=0), False),
    "contiguous_unpipelined": (dict(prefetch_out=False, expand_stages=1), False),
    "prefetch": (dict(prefetch_out=True, expand_stages=0), False),
    "prefetch_unpipelined": (dict(prefetch_out=True, expand_stages=1), False),
    "both_slices": (dict(both_slices=True, prefetch_out=True, expand_stages=0), True),
}


def add_parser(sub):
    p = sweep_parser(sub, NAME, "the one-shot kernel built each way: rank offsets, output prefetch, pipelining",
                     name="one_shot_build", tokens=(64, 512, 2048, 8192), ranks=(16, 64))
    p.add_argument("--packed-tokens", nargs="*", type=int, default=[2048],
                   help="the M at which B is also timed packed N-fastest")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                   help="builds of the one-shot kernel to time (default: all)")


def run(args) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    prov = timing.provenance(args.command)
    copy_bps = timing.copy_bandwidth() if torch.cuda.is_available() else 1.0
    gen = seeded_generator(args.seed)
    rows = []
    cases = [(MoEShape.from_name(p), r, op) for p in args.presets for r in args.ranks for op in ("w13", "w2")]
    bar = progress(total=len(cases) * (len(args.tokens) + len(args.packed_tokens)), desc="expand", unit="case")
    for shape, rank, op in cases:
        L, E, k = args.loras, shape.num_experts, shape.top_k
        lora_a, lora_b = random_lora_weights(shape, op, L, rank, gen, dtype)
        K, N, S = lora_a[0].shape[3], lora_b[0].shape[2], len(lora_a)
        for M, layout in [(M, "r_fastest") for M in args.tokens] + [(M, "n_fastest") for M in args.packed_tokens]:
            bar.update()
            b = lora_b if layout == "r_fastest" else pack_lora_b(lora_b)
            ids, tw, tl = sweep_routing(shape, L, M, args.seed, args.adapters)
            x = torch.randn(M if op == "w13" else M * k, K, device=device(), generator=gen, dtype=dtype)
            out = torch.randn(M, k, S * N, device=device(), generator=gen, dtype=dtype)
            work = count_workload(ids, tl, E, L)
            cfg = choose_config("one_shot", M * k, min(M * k, work.touched_adapter_experts or 1), N, S, x.device,
                                rank=rank)
            blocks = block_list(ids, tl, E, L, cfg.block_m)                        # built once, not timed
            want = moe_lora_reference(x, ids, tw, tl, lora_a, lora_b, mul_routed_weight=op == "w2").float()
            fns = {}
            for name, (build, w13_only) in VARIANTS.items():
                if name not in args.variants or (w13_only and S != 2):
                    continue

                def fn(build=OneShotBuild(**build), output=out):
                    return moe_lora_built(build, x, ids, tw, tl, lora_a, b, output, blocks, cfg,
                                          mul_routed_weight=op == "w2", add_inputs=True)
                got = fn(output=torch.zeros_like(out)).float()
                if not close(got, want):
                    raise RuntimeError(f"{shape.name} {op} M={M} r={rank} {layout}: the {name} build computes a "
                                       f"wrong result (max error {(got - want).abs().max().item():.3g})")
                fns[name] = fn
            traffic = lora_op_traffic("one_shot", work, in_features=K, out_features=N, num_slices=S, rank=rank,
                                      x_rows="token" if op == "w13" else "pair", dtype_bytes=x.element_size(),
                                      add_inputs=True)
            timed = timing.time_cuda_interleaved(fns, rounds=ROUNDS)
            for name, t in timed.items():
                if not isinstance(t, timing.Timing):
                    raise t
                rows.append(dict(preset=shape.name, op=op, M=M, rank=rank, loras=L, dtype=args.dtype, b_layout=layout,
                                 variant=name, **_fields(VARIANTS[name][0]),
                                 block_m=cfg.block_m, block_n=cfg.block_n, n_chunks=cfg.n_chunks,
                                 num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                 us_median=round(t.median_us, 2), us_p20=round(t.p20_us, 2), us_p80=round(t.p80_us, 2),
                                 bytes=traffic.bytes, copy_tbps=round(copy_bps / 1e12, 4),
                                 copy_share=round(traffic.bytes / (t.median_us * 1e-6) / copy_bps, 4), **prov))
        del lora_a, lora_b
        torch.cuda.empty_cache()
    bar.close()
    return rows


def _fields(build: dict) -> dict:
    """The build's every field, as the CSV records it (expand_stages empty for the tile's num_stages)."""
    b = asdict(OneShotBuild(**build))
    return dict(b, expand_stages=b["expand_stages"] or "")
