"""The schedules that add the LoRA inside the base grouped GEMMs: ``fused`` and ``epilogue``.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, H hidden, I expert intermediate,
S slices, P = M*k pairs.

``fused``: the GEMM's K loop also shrinks (all the block's adapters, stacked L*r columns) and its
epilogue expands: four launches, no LoRA buffer at all, but every N tile recomputes the shrink.
``epilogue``: each op's shrink runs once per pair (the two-kernel path's ``shrink_kernel``) into
T [S, P, r], the only LoRA bytes in HBM, and the GEMM expands it before its K loop (the schedule is named
for where the expand first ran, after the loop, 7-12% slower): one dot of K = L*r per
output tile, no delta written or read back, no join. Both need L*r <= ``moe.MAX_FUSED_COLUMNS``.
"""
from __future__ import annotations

import torch

from .dispatch import choose_config
from .moe import GemmLoRA, gemm_tiles, moe_gemm, silu_and_mul, topk_sum
from .paths import launch_shrink
from .streams import Streams


def buffers(x, M: int, k: int, H: int, I: int):
    """The layer's activations, uninitialised, on the current stream: c1 [P, 2I], h [P, I], c3 [P, H], y [M, H]."""
    P = M * k
    return tuple(torch.empty(*shape, dtype=x.dtype, device=x.device) for shape in ((P, 2 * I), (P, I), (P, H), (M, H)))


def fused_layer(x, topk_ids, weights, token_lora, w13, w2, blocks, *, tiles, lora13, lora2, tracer):
    """The ``fused`` schedule: four launches, the LoRA computed inside the two grouped GEMMs."""
    M, k = topk_ids.shape
    streams = Streams(False, x.device, tracer)
    c1, h, c3, y = buffers(x, M, k, w2.shape[1], w2.shape[2])
    with streams.stage("w13+lora", "main"):
        moe_gemm(x, w13, blocks, c1, top_k=k, tiles=tiles, lora=lora13)
    with streams.stage("act", "main"):
        silu_and_mul(c1, h, top_k=k)
    with streams.stage("w2+lora", "main"):
        moe_gemm(h, w2, blocks, c3, top_k=k, topk_weights=weights, tiles=tiles, lora=lora2)
    with streams.stage("sum", "main"):
        topk_sum(c3, y, top_k=k)
    return y


def epilogue_layer(x, topk_ids, weights, token_lora, w13, w2, lora, plan, lora_ranks, tracer):
    """The ``epilogue`` schedule: each op's shrink once per pair into T, the expand inside the GEMM."""
    M, k = topk_ids.shape
    E, H, I = w2.shape
    P = M * k
    a13, b13, a2, b2 = lora
    L, _, r, _ = a13[0].shape
    streams = Streams(False, x.device, tracer)
    c1, h, c3, y = buffers(x, M, k, H, I)
    tiles = gemm_tiles(P, E)
    blocks = plan.lora_blocks
    ops = (("w13", x, a13, b13, c1, 2, w13, None), ("w2", h, a2, b2, c3, 1, w2, weights))
    for op, src, a, b, out, slices, w, mul in ops:
        cfg = choose_config("two_kernel", P, min(P, L * E), b[0].shape[2], slices, x.device, rank=r)
        t = x.new_empty(slices, P, r)          # written where the expand reads: pairs with an adapter, ranks below
        with streams.stage(f"shrink_{op}", "main"):
            launch_shrink(src, a, t, blocks, cfg.replace(block_m=blocks.block_size), top_k=k, token_rows=op == "w13",
                          lora_ranks=lora_ranks)
        with streams.stage(f"{op}+lora", "main"):
            moe_gemm(src, w, plan.base_blocks, out, top_k=k, topk_weights=mul, tiles=tiles,
                     lora=GemmLoRA(token_lora, a, b, lora_ranks, shrunk=t))
        if op == "w13":
            with streams.stage("act", "main"):
                silu_and_mul(c1, h, top_k=k)
    with streams.stage("sum", "main"):
        topk_sum(c3, y, top_k=k)
    return y
