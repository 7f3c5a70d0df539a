"""Launchers of the LoRA-in-K kernels: the tail shrink alone (``kernels/in_k``) and the tail shrink and
its grouped GEMM as one launch (``kernels/in_k_overlap``).

Shape legend: M tokens, k top-k, E experts, L adapters, r rank, K in, N out, S slices, P = M*k pairs.
"""
from __future__ import annotations

import torch
import triton

from .. import rules
from ..op.dispatch import choose_config
from ..kernels.in_k import shrink_tail_kernel
from ..kernels.in_k_overlap import gemm_after_shrink_kernel
from ..base_moe import gemm_tiles, launch_tiles
from ..op.paths import _precision

# The rule this module applies, also readable and settable under its old name here (``in_k_launch.FILL_ROWS``).
rules.expose(__name__, ("FILL_ROWS",))


def _shrink_parts(src, lora_a, plan, token_lora, top_k: int, tail, n_out: int, r: int, lora_ranks, *,
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
    grid, args, meta, opts = _shrink_parts(src, lora_a, plan, token_lora, top_k, tail, n_out, r, lora_ranks,
                                           token_rows=token_rows, one_read=one_read)
    shrink_tail_kernel[grid](*args, **meta, **opts)


def gemm_after_shrink(src, lora_a, plan, token_lora, top_k: int, tail, n_out: int, r: int, lora_ranks, x, w_ext,
                      out, *, x_cols: int, tail_at: int, topk_weights=None, token_rows: bool = False,
                      one_read: bool = False, counters: torch.Tensor | None = None,
                      max_spins: int | None = None) -> torch.Tensor:
    """:func:`shrink_tail` and then ``moe_gemm(x, w_ext, plan.base_blocks, out, x_tail=tail)`` as one
    launch (``kernels/in_k_overlap``): the GEMM tiles wait for the shrink only before their tail K
    steps. ``x`` [M or P, >= x_cols] with unit column stride; ``tail`` [S, P, C] (a view of x's buffer
    or its own, unit column stride, element-aligned with x); w_ext [E, N, tail_at + C] with x's
    weights in columns [0, x_cols) (zeros up to tail_at) and the tail's from tail_at. Tiles: the
    GEMM's rule (``gemm_tiles``; its warps and stages for the whole launch) and the shrink's.
    ``counters``: int32 [2] zeros on x's device (made here if None); after the launch they hold the
    tickets drawn and the shrink programs done. ``max_spins``: the kernel's MAX_SPINS (its default if None)."""
    s_grid, s_args, s_meta, _ = _shrink_parts(src, lora_a, plan, token_lora, top_k, tail, n_out, r, lora_ranks,
                                              token_rows=token_rows, one_read=one_read)
    E, N, K = w_ext.shape
    S, P, C = tail.shape
    offset = tail.data_ptr() - x.data_ptr()
    if K != tail_at + C or x.stride(-1) != 1 or tail.stride(2) != 1 or offset % x.element_size():
        raise ValueError(f"w_ext, tail: expected w_ext [E, N, tail_at + C] = [.., .., {tail_at + C}] and unit column "
                         f"strides, element-aligned with x; got w_ext {tuple(w_ext.shape)}")
    tiles, warps, stages, w_tma, w_desc = launch_tiles(gemm_tiles(P, E), w_ext)
    blocks = plan.base_blocks
    if tiles["BLOCK_M"] != blocks.block_size:
        raise ValueError(f"plan: base blocks of {blocks.block_size} pairs, but the GEMM's tiles take "
                         f"{tiles['BLOCK_M']}; build the plan with plan_layer for this routing")
    n_slice = N // S
    n_gemm = blocks.num_blocks * S * triton.cdiv(n_slice, tiles["BLOCK_N"])
    n_shrink = s_grid[0] * s_grid[1]
    if counters is None:
        counters = torch.zeros(2, dtype=torch.int32, device=x.device)
    elif counters.dtype != torch.int32 or counters.shape != (2,) or counters.device != x.device:
        raise ValueError(f"counters: expected int32 [2] zeros on {x.device}, got {counters.dtype} "
                         f"{tuple(counters.shape)} on {counters.device}")
    mul = topk_weights is not None
    s_meta = {("S_" + k if k in ("BLOCK_M", "BLOCK_K", "TOKEN_ROWS") else k): v for k, v in s_meta.items()}
    gemm_after_shrink_kernel[(n_shrink + n_gemm,)](
        counters, n_shrink, s_grid[1], *s_args,
        x, w_ext, w_desc, out,
        topk_weights if mul else out, blocks.sorted_pairs, blocks.block_expert,
        P, top_k, N, blocks.num_blocks, n_slice, x_cols, tail_at, C, offset // x.element_size(),
        x.stride(0), w_ext.stride(0), w_ext.stride(1), out.stride(0), tail.stride(0), tail.stride(1),
        **s_meta, **tiles, TOKEN_ROWS=x.shape[0] != P or top_k == 1, MUL_ROUTED_WEIGHT=mul, W_TMA=w_tma,
        num_warps=warps, num_stages=stages, **({} if max_spins is None else dict(MAX_SPINS=max_spins)))
    return out
