"""The ``small_batch`` path of the op: a persistent per-pair GEMV for decode-sized work, no block list.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, K in, N out, S slices, P = M*k pairs.

In the H200 sweep of the op's paths it never won (1.2-2.5x slower than the one-shot kernel even at
M = 1: a 1/16-full tensor-core tile still beats CUDA-core reductions; data/h200/README.md), so ``auto``
never picks it. It stays a row of the op's table
(``op.paths.PATHS``, status ``experiment``), which names :func:`launch` by import path, so
``moe_lora(path="small_batch")`` and ``python -m moelora_lab.bench kernels`` still run it. The kernel
is ``experiments/kernels/small_batch.py``.
"""
from __future__ import annotations

import torch
import triton

from ..op.dispatch import KernelConfig, choose_config, num_sms
from ..op.paths import LoRACall, _slice_pairs, _slices
from .kernels.small_batch import small_batch_kernel


def launch(call: LoRACall, cfg: KernelConfig | None = None) -> None:
    """The path's launcher (``op.paths.LoRAPath.launch``): on a validated call, with no device synchronisation.
    A fixed number of programs (``cfg.programs``, by default two per SM) strides over the work items
    (pair, slice, N chunk) of each launch of two slices."""
    x, out2d, weights = call.x, call.out2d, call.weights()
    M, k, L, E, R, K, N, S = call.dims
    cfg = cfg or choose_config("small_batch", M * k, M * k, N, S, x.device, rank=R)
    block_r, rank_tiles = cfg.rank_tiling(R)
    block_k = max(16, min(cfg.block_k, 8192 // block_r))       # keep the [BR, BK] partial sum small
    n_chunks = min(cfg.n_chunks, triton.cdiv(N, cfg.block_n))
    ids = call.topk_ids.reshape(-1).to(torch.int32).contiguous()
    token_lora = call.token_lora.to(torch.int32).contiguous()
    for s0, ns in _slice_pairs(S):
        work = M * k * ns * n_chunks
        programs = min(work, cfg.programs or 2 * num_sms(x.device))
        small_batch_kernel[(programs,)](
            x, *_slices(call.lora_a, s0), *_slices(call.lora_b, s0), out2d, weights, ids, token_lora,
            call.ranks_or(token_lora), M * k, k, K, N, R, s0 * N, work,
            x.stride(0), x.stride(1), *call.lora_a[0].stride(), *call.lora_b[0].stride(), *out2d.stride(),
            NUM_SLICES=ns, N_CHUNKS=n_chunks, BLOCK_N=cfg.block_n, BLOCK_K=block_k, BLOCK_R=block_r,
            RANK_TILES=rank_tiles, TOKEN_ROWS=call.token_rows, MUL_ROUTED_WEIGHT=call.mul_routed_weight,
            ADD_INPUTS=call.add_inputs, HAS_RANKS=call.lora_ranks is not None, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
