"""``python -m moelora_lab.bench eager``: what validation costs an eager call.

For the op (w13, ``path="auto"``) and the layer (``schedule="auto"``) at a few M, each way of
calling it: validated from scratch (``checked``), with routing metadata made once and reused
(``blocks=`` / ``plan=``, whose stamp vouches for the ids: no synchronisation), and with
``validate=False``. Per way: the eager time per call (``n`` calls back to back, then one
synchronisation, wall clock / n: host work and GPU work, whichever is longer), the synchronising
CUDA calls one call makes (torch's sync debug mode), and the GPU time of the same work replayed
from a CUDA graph (no host work at all), for scale.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank.
"""
from __future__ import annotations

import time
import warnings

import torch

from ..config import MoEShape, layer_lora_weights
from ..op.dispatch import choose_config
from ..layer import moe_lora_layer, plan_layer
from ..op.face import moe_lora
from ..op.paths import resolve_path
from ..profile import timing
from ..routing.host import block_list
from .common import base_weights, device, progress, seeded_generator, sweep_parser, sweep_routing

NAME = "eager"
WAYS = ("checked", "reused", "validate_false")


def add_parser(sub):
    e = sweep_parser(sub, NAME, "eager time and device synchronisations per call, with and without validation",
                     name="eager", tokens=(1, 16, 128), ranks=(16,))
    e.add_argument("--calls", type=int, default=200, help="eager calls per measurement")


def syncs_per_call(fn) -> int:
    """Synchronising CUDA calls ``fn()`` makes (torch.cuda's sync debug mode counts them)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in caught)


def eager_us(fn, calls: int) -> float:
    """Wall-clock µs per call of ``calls`` back-to-back eager calls (one synchronisation at the end)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):                                     # best of three runs: the least disturbed
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def _cases(shape, L, rank, M, seed, dtype, gen, weights, adapters="uniform"):
    """The (what, way) -> callable table of one (M, rank)."""
    E, H = shape.num_experts, shape.hidden
    ids, tw, tl = sweep_routing(shape, L, M, seed, adapters)
    x = torch.randn(M, H, device=device(), dtype=dtype, generator=gen)
    op = dict(x=x, topk_ids=ids, topk_weights=tw, token_lora=tl, lora_a=weights["w13_lora_a"],
              lora_b=weights["w13_lora_b"])
    path = resolve_path("auto", num_pairs=M * shape.top_k, num_experts=E, num_loras=L, rank=rank, add_inputs=True,
                        token_rows=True, n_out=shape.intermediate)
    cfg = choose_config(path, M * shape.top_k, min(M * shape.top_k, L * E), shape.intermediate, 2, x.device, rank=rank)
    blocks = block_list(ids, tl, E, L, cfg.block_m) if path != "small_batch" else None
    layer = dict(x=x, topk_ids=ids, topk_weights=tw, token_lora=tl, **weights)
    plan = plan_layer(ids, tl, E, L, rank, intermediate=shape.intermediate)
    return {
        ("op", "checked"): lambda: moe_lora(**op, path=path),
        ("op", "reused"): lambda: moe_lora(**op, path=path, blocks=blocks, config=cfg),
        ("op", "validate_false"): lambda: moe_lora(**op, path=path, validate=False),
        ("layer", "checked"): lambda: moe_lora_layer(**layer),
        ("layer", "reused"): lambda: moe_lora_layer(**layer, plan=plan),
        ("layer", "validate_false"): lambda: moe_lora_layer(**layer, validate=False),
    }


def run(args) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    prov = timing.provenance(args.command)
    gen = seeded_generator(args.seed)
    rows = []
    cases = [(p, r, m) for p in args.presets for r in args.ranks for m in args.tokens]
    for preset, rank, M in progress(cases, desc="eager", unit="case"):
        shape = MoEShape.from_name(preset)
        w13, w2 = base_weights(shape, gen, dtype)
        weights = dict(w13=w13, w2=w2, **layer_lora_weights(shape, args.loras, rank, gen, dtype))
        fns = _cases(shape, args.loras, rank, M, args.seed, dtype, gen, weights, args.adapters)
        for (what, way), fn in fns.items():
            graph = timing.time_cuda(fn).median_us
            rows.append(dict(preset=preset, what=what, way=way, M=M, rank=rank, loras=args.loras, dtype=args.dtype,
                             eager_us=round(eager_us(fn, args.calls), 2), syncs=syncs_per_call(fn),
                             graph_us=round(graph, 2), calls=args.calls, **prov))
    return rows
