"""The schedules that add the LoRA inside the base grouped GEMMs: ``fused`` and ``epilogue``.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, H hidden, I expert intermediate,
S slices, P = M*k pairs.

``fused``: the GEMM's K loop also shrinks (all the block's adapters, stacked L*r columns) and its
epilogue expands: four launches, no LoRA buffer at all, but every N tile recomputes the shrink.
``epilogue``: each op's shrink runs once per pair (the two-kernel path's ``shrink_kernel``) into
T [S, P, r], the only LoRA bytes in HBM, and the GEMM expands it before its K loop (the schedule is named
for where the expand first ran, after the loop, 7-12% slower): one dot of K = L*r per
output tile, no delta written or read back, no join. Both need L*r <= ``rules.MAX_FUSED_COLUMNS``.
Both launch the grouped GEMM with the LoRA inside it (``moe_gemm_lora``, ``kernels/in_gemm``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from .._backend import on_device
from ..blocks import BlockList
from ..op.dispatch import choose_config
from ..layer.streams import Streams
from ..layer.table import LayerCall
from ..layer.two_kernel import buffers
from ..base_moe import block_tiles, fused_columns, gemm_tiles, launch_tiles, silu_and_mul, topk_sum
from ..op.paths import _precision, launch_shrink
from .kernels.in_gemm import moe_gemm_lora_kernel


class GemmLoRA(NamedTuple):
    """The LoRA to compute inside a grouped GEMM: per-token adapter ids [M] int32 (-1 = none), A [L, E, r, K]
    and B [L, E, N/S, r] per slice, optional ranks [L] int32; ``shrunk``: T = A x [S, P, r] made beforehand
    (``paths.launch_shrink``), so the GEMM only expands."""

    token_lora: torch.Tensor
    lora_a: list
    lora_b: list
    lora_ranks: torch.Tensor | None = None
    shrunk: torch.Tensor | None = None


def moe_gemm_lora(x: torch.Tensor, w: torch.Tensor, blocks: BlockList, out: torch.Tensor, lora: GemmLoRA, *,
                  top_k: int, topk_weights: torch.Tensor | None = None, tiles: dict | None = None) -> torch.Tensor:
    """out[p] = (w_p *) (W[e_p] @ x_row(p) + B[l, e_p] @ A[l, e_p] @ x_row(p)) for every pair, over
    expert-sorted ``blocks``, the LoRA term only for pairs whose token has an adapter l (``kernels/in_gemm``).
    Arguments and ``tiles`` as for ``base_moe.moe_gemm`` (no x tail); needs L*r <= ``rules.MAX_FUSED_COLUMNS``."""
    E, N, K = w.shape
    P = out.shape[0]
    tiles, half = block_tiles(tiles or gemm_tiles(P, E), blocks)
    tiles, warps, stages, w_tma, w_desc = launch_tiles(tiles, w)
    mul = topk_weights is not None
    if mul:
        topk_weights = topk_weights.contiguous()    # [P], read at topk_weights_ptr + pair
    token_lora = lora.token_lora.contiguous()       # [M], read at token_lora_ptr + token
    has_ranks = lora.lora_ranks is not None
    L, _, R, _ = lora.lora_a[0].shape
    n_slice = lora.lora_b[0].shape[2]
    a, b = (lora.lora_a[0], lora.lora_a[-1]), (lora.lora_b[0], lora.lora_b[-1])
    t = lora.shrunk
    grid = (blocks.num_blocks * (N // n_slice) * triton.cdiv(n_slice, tiles["BLOCK_N"]),)
    with on_device(x):
        moe_gemm_lora_kernel[grid](
            x, w, w_desc, out, topk_weights if mul else out, blocks.sorted_pairs, blocks.block_expert, token_lora,
            *a, *b, lora.lora_ranks.contiguous() if has_ranks else blocks.block_expert, w if t is None else t,
            P, top_k, K, N, blocks.num_blocks, L, R, n_slice,
            x.stride(0), x.stride(1), *w.stride(), out.stride(0), out.stride(1), *a[0].stride(), *b[0].stride(),
            *(t.stride() if t is not None else (0, 0, 0)),
            BLOCK_LR=fused_columns(L, R), TOKEN_ROWS=x.shape[0] != P or top_k == 1, MUL_ROUTED_WEIGHT=mul,
            HAS_RANKS=has_ranks, W_TMA=w_tma, T_IN=t is not None, HALF_TAIL=half, DOT_PRECISION=_precision(x),
            num_warps=warps, num_stages=stages, **tiles)
    return out


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
        moe_gemm_lora(x, call.w13, plan.base_blocks, c1, lora13, top_k=k, tiles=plan.tiles)
    with streams.stage("act", "main"):
        silu_and_mul(c1, h, top_k=k)
    with streams.stage("w2+lora", "main"):
        moe_gemm_lora(h, call.w2, plan.base_blocks, c3, lora2, top_k=k, topk_weights=call.weights, tiles=plan.tiles)
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
            moe_gemm_lora(src, w, plan.base_blocks, out, GemmLoRA(token_lora, a, b, lora_ranks, shrunk=t), top_k=k,
                          topk_weights=mul, tiles=tiles)
        if op == "w13":
            with streams.stage("act", "main"):
                silu_and_mul(c1, h, top_k=k)
    with streams.stage("sum", "main"):
        topk_sum(c3, y, top_k=k)
    return y
