"""The ``in_join`` schedule: the LoRA inside the layer's activation and top-k sum (``kernels/in_join``).

Shape legend: M tokens, E experts, k top-k, L adapters, r rank (R = the weights' rank dim), H hidden,
I expert intermediate, P = M*k pairs, NT column tiles of the activation.

Five launches, one of them LoRA: the w13 shrink T1 [2, P, R] (the two-kernel path's shrink, on the
side stream beside the w13 GEMM where streams run); the activation adds B13 T1 and writes, beside h,
each column tile's share of the w2 shrink (T2 [P, NT, R], float32); the top-k sum adds w B2 T2. No
delta is written or read back, and nothing LoRA runs between the w2 GEMM and the sum.
"""
from __future__ import annotations

import torch
import triton

from .kernels.in_join import act_lora_kernel, sum_lora_kernel
from ..layer.streams import Streams
from ..layer.table import LayerCall
from ..layer.two_kernel import buffers
from ..base_moe import moe_gemm
from ..op.paths import launch_shrink

# a [BLOCK, BLOCK_R] weight tile of at most this many elements per program (32 float32 per thread of 4 warps)
TILE_ELEMENTS = 4096
# The activation's tiles: on the H200 (bf16, qwen3-30b-a3b, M = 1, 4, 16, r 16 / 64; the probe
# scripts/probes/join_tiles.py, data/history/join_tiles_313694704f.csv) column tiles of 64 with 2 warps were
# within 0.3 us of the fastest of 16..128 x 1..4 warps at M <= 4 and up to 4.8 us faster than 128 columns
# with 4 warps at M = 16.
ACT_WIDEST, ACT_WARPS = 64, 2


def join_block(cols: int, tile_rows: int, widest: int = 128) -> int:
    """Columns per program of the join kernels: a power of two from 16 to ``widest``, the weight tile
    (``tile_rows`` rows of ranks, times the columns) within TILE_ELEMENTS."""
    return max(16, min(widest, triton.next_power_of_2(cols), TILE_ELEMENTS // tile_rows))


def _unit_stride(*vectors):
    """The join kernels read the i-th element of each [P] or [M] vector at ptr + i: contiguous copies of any
    strided view (the tensors themselves when they already are, and None stays None)."""
    return [v if v is None else v.contiguous() for v in vectors]


def act_lora(c1, t1, w13_lora_b, w2_lora_a, topk_ids, token_lora, lora_ranks, h, *, block: int | None = None,
             num_warps: int = ACT_WARPS):
    """h [P, I] = silu(gate + Bg T1g) * (up + Bu T1u) and T2 [P, NT, R] float32, each column tile's A2 h
    (``block`` columns per program, a power of two >= 16; default by :func:`join_block`)."""
    P, I = h.shape
    R = w2_lora_a[0].shape[2]
    block_r = triton.next_power_of_2(R)
    if block is None:
        block = join_block(I, block_r, ACT_WIDEST)
    elif not isinstance(block, int) or block < 16 or block & (block - 1):
        raise ValueError(f"block: expected a power of two >= 16 (columns per program), got {block!r}")
    nt = triton.cdiv(I, block)
    t2 = torch.empty(P, nt, R, dtype=torch.float32, device=h.device)
    bg, bu = w13_lora_b
    if bg.stride() != bu.stride():               # one set of strides serves both slices
        bg, bu = bg.contiguous(), bu.contiguous()
    a2 = w2_lora_a[0]
    has_ranks = lora_ranks is not None
    topk_ids, token_lora, lora_ranks = _unit_stride(topk_ids, token_lora, lora_ranks)
    act_lora_kernel[(P, nt)](
        c1, t1, bg, bu, a2, topk_ids, token_lora, lora_ranks if has_ranks else token_lora, h, t2,
        P // token_lora.shape[0], I, R, c1.stride(0), t1.stride(0), t1.stride(1), *bg.stride(), *a2.stride(),
        h.stride(0), t2.stride(0), t2.stride(1), BLOCK=block, BLOCK_R=block_r, HAS_RANKS=has_ranks,
        num_warps=num_warps)
    return t2


def sum_lora(c3, t2, w2_lora_b, topk_ids, weights, token_lora, lora_ranks, y):
    """y [M, H] = sum over a token's pairs of c3 + w B2 (sum of T2's tiles)."""
    M, H = y.shape
    k = c3.shape[0] // M
    R, nt = w2_lora_b[0].shape[3], t2.shape[1]
    block_r, block_j = triton.next_power_of_2(R), triton.next_power_of_2(k)
    block = join_block(H, block_r * block_j)
    block_t = max(1, min(triton.next_power_of_2(nt), TILE_ELEMENTS // (block_r * block_j)))
    b2 = w2_lora_b[0]
    has_ranks = lora_ranks is not None
    topk_ids, weights, token_lora, lora_ranks = _unit_stride(topk_ids, weights, token_lora, lora_ranks)
    sum_lora_kernel[(M, triton.cdiv(H, block))](
        c3, t2, b2, topk_ids, weights, token_lora, lora_ranks if has_ranks else token_lora, y,
        H, R, nt, c3.stride(0), t2.stride(0), t2.stride(1), *b2.stride(), y.stride(0),
        TOP_K=k, BLOCK=block, BLOCK_R=block_r, BLOCK_J=block_j, BLOCK_T=block_t, HAS_RANKS=has_ranks)
    return y


def run(call: LayerCall) -> torch.Tensor:
    """The ``in_join`` schedule: w13's shrink beside its GEMM, the rest of the LoRA in the two joins."""
    M, k, E, H, I, L, R = call.dims
    x, plan, lora_ranks, token_lora, weights = call.x, call.plan, call.lora_ranks, call.token_lora32, call.weights
    P = M * k
    a13, b13, a2, b2 = call.lora
    ids = call.topk_ids.reshape(-1)
    streams = Streams(call.dual, x.device, call.tracer, call.side_priority)
    c1, h, c3, y = buffers(x, M, k, H, I)
    t1 = x.new_empty(2, P, R)                    # written where the activation reads: pairs with an adapter, ranks below
    tiles = plan.tiles
    fork = streams.fork()
    with streams.stage("base_w13", "main"):
        moe_gemm(x, call.w13, plan.base_blocks, c1, top_k=k, tiles=tiles)
    with streams.side("shrink_w13", fork):
        launch_shrink(x, a13, t1, plan.lora_blocks, plan.lora_config, top_k=k, token_rows=True,
                      lora_ranks=lora_ranks, one_read=True)
    streams.join()
    with streams.stage("act+lora", "main"):
        t2 = act_lora(c1, t1, b13, a2, ids, token_lora, lora_ranks, h)
    with streams.stage("base_w2", "main"):
        moe_gemm(h, call.w2, plan.base_blocks, c3, top_k=k, topk_weights=weights, tiles=tiles)
    with streams.stage("sum+lora", "main"):
        sum_lora(c3, t2, b2, ids, weights, token_lora, lora_ranks, y)
    return y
