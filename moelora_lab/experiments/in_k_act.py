"""The ``in_k_act`` schedule: ``in_k`` with the activation in the w13 GEMM's epilogue (not yet measured).

Shape legend: M tokens, k top-k, E experts, L adapters, r rank, H hidden, I expert intermediate,
P = M*k pairs, S = 2 slices.

In ``in_k`` the w13 GEMM already carries the LoRA (its K widened by each pair's shrink), so its output
c1 [P, 2I] is final the moment it is stored, and the activation only reads it back to write h. Here
the GEMM's programs own matching column tiles of gate and up and write h = silu(gate) * up into the
first I columns of h_ext themselves (``kernels/gemm_act``): c1 is neither written nor read
(2 * P * 2I elements less through memory) and one launch goes. The rest is ``in_k``'s: w2's shrink
into h_ext's tail, the w2 GEMM over h_ext, the top-k sum.

What it trades: each program holds two accumulators, so at the same registers its tiles are half as
wide (BLOCK_N / 2 of the plan's), and W's gate and up rows come in two streams of loads.
``python -m moelora_lab.bench layer --variants in_k in_k_act ...`` times it beside ``in_k``.
"""
from __future__ import annotations

import torch
import triton

from ..base_moe import _check_tail, block_tiles, launch_tiles
from ..blocks import BlockList
from ..layer.in_k import shrink_w13, w2_and_sum
from ..layer.in_k_launch import shrink_tail
from ..layer.table import LayerCall
from .kernels.gemm_act import gemm_act_kernel


def gemm_act(x: torch.Tensor, w: torch.Tensor, blocks: BlockList, h: torch.Tensor, *, top_k: int, tiles: dict,
             x_tail: torch.Tensor | None = None) -> torch.Tensor:
    """h[p] = silu(gate) * up of (W[e_p] @ x_row(p)) for every pair, gate the first I rows of W and up the next I,
    over expert-sorted ``blocks``, with the plan's ``tiles`` (their BLOCK_N split between the two halves).
    x: [M, K] token rows or [P, K] pair rows; w: [E, 2I, K] (with ``x_tail`` [2, P, C]: [E, 2I, tail_at + C],
    as ``moe_gemm`` takes them); h: [P, I] (a view with unit column stride). Inputs are trusted."""
    E, N, K = w.shape
    I, P = N // 2, h.shape[0]
    tail_at = _check_tail(x, w, x_tail, P, tiles["BLOCK_K"]) if x_tail is not None else K
    tiles, half = block_tiles(tiles, blocks)
    tiles["BLOCK_N"] = max(16, tiles["BLOCK_N"] // 2)    # two accumulators in the registers of one
    tiles, warps, stages, w_tma, w_desc = launch_tiles(tiles, w)
    grid = (blocks.num_blocks * triton.cdiv(I, tiles["BLOCK_N"]),)
    tail_off = (x_tail.data_ptr() - x.data_ptr()) // x.element_size() if x_tail is not None else 0
    gemm_act_kernel[grid](
        x, w, w_desc, h, blocks.sorted_pairs, blocks.block_expert,
        P, top_k, K, I, blocks.num_blocks, x.shape[1], tail_at, tail_off,
        x.stride(0), x.stride(1), *w.stride(), h.stride(0), h.stride(1),
        *(x_tail.stride()[:2] if x_tail is not None else (0, 0)),
        TOKEN_ROWS=x.shape[0] != P or top_k == 1, W_TMA=w_tma, X_TAIL=x_tail is not None, HALF_TAIL=half,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages, **tiles)
    return h


def run(call: LayerCall) -> torch.Tensor:
    """y [M, H]: w13's shrink into its tail, the w13 GEMM with the activation into h_ext, then ``in_k``'s w2 half."""
    M, k, E, H, I, L, r = call.dims
    w2_lora_a = call.lora[2]
    x, t13, streams = shrink_w13(call)
    h_ext = x.new_empty(M * k, I + L * r)
    with streams.stage("w13+lora+act", "main"):
        gemm_act(x, call.in_k.w13_ext, call.plan.base_blocks, h_ext[:, :I], top_k=k, tiles=call.plan.tiles,
                 x_tail=t13)
    with streams.stage("shrink_w2", "main"):
        shrink_tail(h_ext, [w2_lora_a[0]], call.plan, call.token_lora32, k, h_ext[:, I:].unsqueeze(0), H, r,
                    call.lora_ranks)
    return w2_and_sum(h_ext, call.in_k.w2_ext, call.plan, call.token_lora32, call.weights, streams, M, k, H)
