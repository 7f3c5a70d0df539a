"""Decode-sized MoE-LoRA: one pair at a time as two GEMVs on CUDA cores, in a persistent grid (the
``small_batch`` path; it never beat the one-shot kernel, so ``auto`` never picks it).

Shape legend: M tokens, k top-k, L adapters, E experts, r rank, K in, N out, S slices.

With a handful of pairs, each with its own (adapter, expert), a 16-row tensor-core tile would be
1/16 useful. Here a work item is (pair, slice, N chunk): the shrink t = A x is a multiply-and-reduce
over K, kept as a [BLOCK_R, BLOCK_K] partial sum and reduced once after the K loop; the expand
out = B t reduces over the rank. A fixed number of programs strides over the work items, so the
grid does not grow with M. Ranks wider than BLOCK_R loop over rank tiles, adding into the output
as in the one-shot kernel.
"""
import triton
import triton.language as tl

from ...kernels.common import rank_tile, rank_tile_runs, slice_pointers, slot_rank


@triton.jit
def small_batch_kernel(
    # ---- pointers
    x_ptr,             # [M, K] (TOKEN_ROWS) or [M*k, K]; fp32/fp16/bf16
    a0_ptr, a1_ptr,    # LoRA A of slices 0 and 1: [L, E, r, K], x's dtype
    b0_ptr, b1_ptr,    # LoRA B of slices 0 and 1: [L, E, N, r], x's dtype
    out_ptr,           # [M*k, S*N] rows of the [M, k, S*N] output, x's dtype
    topk_weights_ptr,  # [M*k] fp32 routing weight of each pair (read if MUL_ROUTED_WEIGHT)
    topk_ids_ptr,      # [M*k] int32 expert of each pair
    token_lora_ptr,    # [M] int32 adapter of each token, -1 = none
    lora_ranks_ptr,    # [L] int32 actual rank of each slot (read if HAS_RANKS)
    # ---- sizes
    num_pairs, top_k, K, N, R,
    slice_offset,      # output column of this launch's slice 0
    num_work,          # work items: pairs * slices * N chunks
    # ---- strides
    stride_xm, stride_xk,
    stride_al, stride_ae, stride_ar, stride_ak,
    stride_bl, stride_be, stride_bn, stride_br,
    stride_om, stride_on,
    # ---- meta-parameters
    NUM_SLICES: tl.constexpr, N_CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    RANK_TILES: tl.constexpr,
    TOKEN_ROWS: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, ADD_INPUTS: tl.constexpr,
    HAS_RANKS: tl.constexpr,
):
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = tl.arange(0, BLOCK_N)
    chunk_len = tl.cdiv(tl.cdiv(N, N_CHUNKS), BLOCK_N) * BLOCK_N
    for work in range(tl.program_id(0), num_work, tl.num_programs(0)):    # persistent loop
        pair = work // (N_CHUNKS * NUM_SLICES)          # work items: (pair, slice, chunk)
        slice_id = (work // N_CHUNKS) % NUM_SLICES
        chunk = work % N_CHUNKS
        lora = tl.load(token_lora_ptr + pair // top_k)
        if lora >= 0:
            expert = tl.load(topk_ids_ptr + pair)
            r_lim = slot_rank(lora_ranks_ptr, lora, R, HAS_RANKS)
            a_ptr, b_ptr = slice_pointers(slice_id, a0_ptr, a1_ptr, b0_ptr, b1_ptr)
            a_ptr += lora.to(tl.int64) * stride_al + expert.to(tl.int64) * stride_ae
            b_ptr += lora.to(tl.int64) * stride_bl + expert.to(tl.int64) * stride_be
            x_row = pair // top_k if TOKEN_ROWS else pair
            x_base = x_ptr + x_row.to(tl.int64) * stride_xm
            out_base = out_ptr + pair.to(tl.int64) * stride_om + (slice_offset + slice_id * N) * stride_on
            n_lo = chunk * chunk_len
            n_hi = tl.minimum(n_lo + chunk_len, N)
            if MUL_ROUTED_WEIGHT:
                weight = tl.load(topk_weights_ptr + pair)
            for rt in range(RANK_TILES):
                if rank_tile_runs(rt, r_lim, BLOCK_R, HAS_RANKS):
                    offs_r, r_ok = rank_tile(rt * BLOCK_R, r_lim, BLOCK_R)
                    part = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
                    for k0 in range(0, K, BLOCK_K):
                        ks = k0 + offs_k
                        k_ok = ks < K
                        xk = tl.load(x_base + ks * stride_xk, mask=k_ok, other=0.0).to(tl.float32)        # [BK]
                        ak = tl.load(a_ptr + offs_r[:, None] * stride_ar + ks[None, :] * stride_ak,
                                     mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)     # [BR, BK]
                        part += ak * xk[None, :]
                    t = tl.sum(part, axis=1).to(x_ptr.dtype.element_ty).to(tl.float32)   # [BR], same rounding as one-shot
                    for n0 in range(n_lo, n_hi, BLOCK_N):
                        ns = n0 + offs_n
                        n_ok = ns < n_hi
                        bt = tl.load(b_ptr + ns[:, None] * stride_bn + offs_r[None, :] * stride_br,
                                     mask=n_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)     # [BN, BR]
                        acc = tl.sum(bt * t[None, :], axis=1)                                          # [BN]
                        if MUL_ROUTED_WEIGHT:
                            acc = acc * weight
                        out = out_base + ns * stride_on
                        if ADD_INPUTS:
                            acc += tl.load(out, mask=n_ok, other=0.0).to(tl.float32)
                        elif rt > 0:
                            acc += tl.load(out, mask=n_ok, other=0.0).to(tl.float32)
                        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_ok)
                    if RANK_TILES > 1:
                        tl.debug_barrier()
