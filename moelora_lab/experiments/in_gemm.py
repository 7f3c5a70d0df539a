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

from ..op.dispatch import choose_config
from ..layer.streams import Streams
from ..layer.table import LayerCall
from ..layer.two_kernel import buffers
from ..base_moe import GemmLoRA, moe_gemm, silu_and_mul, topk_sum
from ..op.paths import launch_shrink


def run_fused(call: LayerCall) -> torch.Tensor:
    """The ``fused`` schedule: four launches, the LoRA computed inside the two grouped GEMMs."""
    M, k, E, H, I, L, r = call.dims
    x, plan = call.x, call.plan
    a13, b13, a2, b2 = call.lora
    lora13 = GemmLoRA(call.token_lora32, a13, b13, call.lora_ranks)
    lora2 = GemmLoRA(call.token_lora32, a2, b2, call.lora_ranks)
    streams = Streams(False, x.device, call.tracer)
    c1, h, c3, y = buffers(x, M, k, H, I)
    with streams.stage("w13+lora", "main"):
        moe_gemm(x, call.w13, plan.base_blocks, c1, top_k=k, tiles=plan.tiles, lora=lora13)
    with streams.stage("act", "main"):
        silu_and_mul(c1, h, top_k=k)
    with streams.stage("w2+lora", "main"):
        moe_gemm(h, call.w2, plan.base_blocks, c3, top_k=k, topk_weights=call.weights, tiles=plan.tiles, lora=lora2)
    with streams.stage("sum", "main"):
        topk_sum(c3, y, top_k=k)
    return y


def run_epilogue(call: LayerCall) -> torch.Tensor:
    """The ``epilogue`` schedule: each op's shrink once per pair into T, the expand inside the GEMM."""
    M, k, E, H, I, L, r = call.dims
    x, plan, lora_ranks, token_lora = call.x, call.plan, call.lora_ranks, call.token_lora32
    P = M * k
    a13, b13, a2, b2 = call.lora
    streams = Streams(False, x.device, call.tracer)
    c1, h, c3, y = buffers(x, M, k, H, I)
    tiles = plan.tiles
    blocks = plan.lora_blocks
    ops = (("w13", x, a13, b13, c1, 2, call.w13, None), ("w2", h, a2, b2, c3, 1, call.w2, call.weights))
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
