"""Launcher of the LoRA-in-K tail shrink (``kernels/in_k``).

Shape legend: M tokens, k top-k, E experts, L adapters, r rank, K in, N out, S slices, P = M*k pairs.
"""
from __future__ import annotations

import triton

from .. import rules
from ..op.dispatch import choose_config
from ..kernels.in_k import shrink_tail_kernel
from ..op.paths import _precision


def shrink_parts(src, lora_a, plan, token_lora, top_k: int, tail, n_out: int, r: int, lora_ranks, *,
                 token_rows: bool, one_read: bool):
    """The tail shrink's grid, arguments, constexprs and launch options (``shrink_tail_kernel``'s)."""
    blocks = plan.lora_blocks
    S, P, LR = tail.shape
    L, E, _, K = lora_a[0].shape
    cfg = choose_config("two_kernel", P, min(P, L * E), n_out, S, src.device, rank=r)
    block_r, rank_tiles = cfg.rank_tiling(r)
    both = one_read and S == 2
    grid = (blocks.num_blocks + triton.cdiv(P, rules.FILL_ROWS), (1 if both else S) * rank_tiles)
    args = (src, lora_a[0], lora_a[-1], tail, *blocks.tensors, token_lora.contiguous(),   # [M], read at ptr + t
            blocks.block_lora if lora_ranks is None else lora_ranks.contiguous(),
            P, blocks.num_blocks, top_k, K, r, LR, rank_tiles, src.stride(0), *lora_a[0].stride(), tail.stride(1),
            tail.stride(0))
    meta = dict(BLOCK_M=blocks.block_size, BLOCK_K=cfg.block_k, BLOCK_R=block_r, BLOCK_LR=triton.next_power_of_2(LR),
                FILL_ROWS=rules.FILL_ROWS, DOT_PRECISION=_precision(src), HAS_RANKS=lora_ranks is not None,
                TOKEN_ROWS=token_rows, BOTH_SLICES=both)
    return grid, args, meta, dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def shrink_tail(src, lora_a, plan, token_lora, top_k: int, tail, n_out: int, r: int, lora_ranks, *,
                token_rows: bool = False, one_read: bool = False) -> None:
    """The whole tail [S, P, L*r] (a view: unit column stride) in one launch: the shrink T = A_s src of
    every pair with an adapter in its slot's columns, zeros in every other column; ``src`` holds one
    row per pair, or per token with ``token_rows`` (w13's x); ``one_read`` (two slices): one program
    writes both slices' tile from one read of its rows. Tiles: the LoRA op's shrink tiles (``n_out``
    its output columns per slice). Not what keeps w13's shrink from its byte floor: on the H200 (bf16,
    qwen3-30b-a3b, 4 adapters, one read) these tiles came within 4.5%, 0% and 6.2% of the best of 18
    tilings (BLOCK_M 32/64/128 x BLOCK_K 64/128/256 x 4 warps and 3 stages or 8 and 4) at r 16, M 2048
    and 8192 and r 64, M 8192, where at r 16, M 8192 it took 88 us against a byte floor of about 27 us
    (x, A and T once): every pair reads its token's x row again, top-k times per row in all."""
    grid, args, meta, opts = shrink_parts(src, lora_a, plan, token_lora, top_k, tail, n_out, r, lora_ranks,
                                          token_rows=token_rows, one_read=one_read)
    shrink_tail_kernel[grid](*args, **meta, **opts)
