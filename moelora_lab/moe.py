"""Launchers of the base MoE kernels (grouped GEMM, activation, top-k sum).

Shape legend: M tokens, k top-k, E experts, K in, N out, H hidden, I expert intermediate, P = M*k pairs.
"""
from __future__ import annotations

import torch
import triton

from ._backend import INTERPRET
from .kernels.base_moe import moe_gemm_kernel, silu_and_mul_kernel, topk_sum_kernel
from .routing import BlockList


def gemm_tiles(num_pairs: int, num_experts: int) -> dict:
    """Tiles of the grouped GEMM: BLOCK_M from the pairs each expert gets on average."""
    if INTERPRET:
        return dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, num_warps=1, num_stages=1)
    per_expert = num_pairs / num_experts
    block_m = 16 if per_expert <= 16 else (32 if per_expert <= 32 else (64 if per_expert <= 96 else 128))
    return dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=64, num_warps=4 if block_m <= 64 else 8, num_stages=3)


def moe_gemm(x: torch.Tensor, w: torch.Tensor, blocks: BlockList, out: torch.Tensor, *, top_k: int,
             topk_weights: torch.Tensor | None = None, tiles: dict | None = None) -> torch.Tensor:
    """out[p] = (w_p *) W[e_p] @ x_row(p) for every pair, over expert-sorted ``blocks``.

    x: [M, K] token rows or [P, K] pair rows; w: [E, N, K]; out: [P, N]; topk_weights: [P] fp32 or None.
    """
    E, N, K = w.shape
    P = out.shape[0]
    tiles = dict(tiles or gemm_tiles(P, E))
    if tiles["BLOCK_M"] != blocks.block_size:
        raise ValueError(f"blocks: block size {blocks.block_size} != BLOCK_M {tiles['BLOCK_M']}; build them with "
                         "block_list(..., block_size=gemm_tiles(...)['BLOCK_M'])")
    warps, stages = tiles.pop("num_warps"), tiles.pop("num_stages")
    grid = (blocks.num_blocks, triton.cdiv(N, tiles["BLOCK_N"]))
    mul = topk_weights is not None
    moe_gemm_kernel[grid](
        x, w, out, topk_weights if mul else out, blocks.sorted_pairs, blocks.block_expert,
        P, top_k, K, N, x.stride(0), x.stride(1), *w.stride(), out.stride(0), out.stride(1),
        TOKEN_ROWS=x.shape[0] != P or top_k == 1, MUL_ROUTED_WEIGHT=mul,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages, **tiles)
    return out


def _block(n: int) -> int:
    return min(1024 if not INTERPRET else 4096, triton.next_power_of_2(n))


def _rowwise(kernel, src, dst, rows: int, cols: int, top_k: int, delta, token_lora):
    """Launch one (row, column tile) epilogue kernel, with or without the LoRA delta."""
    block = _block(cols)
    has = delta is not None
    kernel[(rows, triton.cdiv(cols, block))](
        src, delta if has else src, token_lora if has else src, dst, top_k, cols, src.stride(0),
        delta.stride(0) if has else 0, dst.stride(0), BLOCK=block, HAS_DELTA=has)
    return dst


def silu_and_mul(c1: torch.Tensor, h: torch.Tensor, *, top_k: int, delta: torch.Tensor | None = None,
                 token_lora: torch.Tensor | None = None) -> torch.Tensor:
    """h = silu(gate) * up of c1 [P, 2I] (plus the LoRA delta of pairs with an adapter) into h [P, I]."""
    return _rowwise(silu_and_mul_kernel, c1, h, h.shape[0], h.shape[1], top_k, delta, token_lora)


def topk_sum(c3: torch.Tensor, y: torch.Tensor, *, top_k: int, delta: torch.Tensor | None = None,
             token_lora: torch.Tensor | None = None) -> torch.Tensor:
    """y[t] = sum_j c3[t*k + j] (plus the LoRA delta of tokens with an adapter) into y [M, H]."""
    return _rowwise(topk_sum_kernel, c3, y, y.shape[0], y.shape[1], top_k, delta, token_lora)
