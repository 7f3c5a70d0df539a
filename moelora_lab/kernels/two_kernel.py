"""The two-kernel MoE-LoRA path: shrink writes the rank intermediate to HBM, expand reads it back.

Shape legend: M tokens, k top-k, L adapters, E experts, r rank, K in, N out, S slices,
BM = BLOCK_M pairs per block, B blocks.

This is the "before" picture. Per call it moves the intermediate T [S, M*k, r] twice:
``shrink_kernel`` writes the rows of the pairs that have an adapter, ``expand_kernel`` reads them
back (the launcher allocates T uninitialised: the expand reads only what the shrink wrote). The tiles are sane (tensor-core dots, blocks of BM pairs sharing
one (adapter, expert) weight), so what separates it from the one-shot kernel is the round trip and
the extra launches, not sloppiness.
"""
import triton
import triton.language as tl

from .common import block_rows, rank_tile, slice_pointers, slot_rank


@triton.jit
def shrink_kernel(
    # ---- pointers
    x_ptr,             # [M, K] (TOKEN_ROWS) or [M*k, K]; fp32/fp16/bf16
    a0_ptr, a1_ptr,    # LoRA A of slices 0 and 1: [L, E, r, K], x's dtype
    t_ptr,             # [S, M*k, r] intermediate, x's dtype (uninitialised; written here)
    sorted_pairs_ptr, block_lora_ptr, block_expert_ptr,   # BlockList: [B*BM], [B], [B] int32
    lora_ranks_ptr,    # [L] int32 actual rank of each slot (read if HAS_RANKS)
    # ---- sizes
    num_pairs, top_k, K, R,
    # ---- strides
    stride_xm, stride_xk,
    stride_al, stride_ae, stride_ar, stride_ak,
    stride_ts, stride_tm, stride_tr,
    # ---- meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    TOKEN_ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_RANKS: tl.constexpr,
    BOTH_SLICES: tl.constexpr = False,   # one program shrinks slices 0 and 1 from one read of its x rows
):
    """Program (block, slice, rank tile): T[s, rows, r-tile] = X[rows] @ A[l, e, r-tile]^T; with
    BOTH_SLICES, program (block, 0, rank tile) writes the tile of both slices (x read once, not twice)."""
    block = tl.program_id(0)
    slice_id = tl.program_id(1)
    lora = tl.load(block_lora_ptr + block)
    if lora < 0:
        return
    r_lim = slot_rank(lora_ranks_ptr, lora, R, HAS_RANKS)
    if tl.program_id(2) * BLOCK_R >= r_lim:
        return                                           # past the adapter's rank: never read
    expert = tl.load(block_expert_ptr + block)
    a_ptr, _ = slice_pointers(slice_id, a0_ptr, a1_ptr, a0_ptr, a1_ptr)
    a_off = lora.to(tl.int64) * stride_al + expert.to(tl.int64) * stride_ae      # A[l, e] in either slice
    a_ptr += a_off
    pairs, valid, x_rows = block_rows(sorted_pairs_ptr, block, num_pairs, top_k, BLOCK_M, TOKEN_ROWS)

    offs_r, r_ok = rank_tile(tl.program_id(2) * BLOCK_R, r_lim, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    if BOTH_SLICES:
        acc1 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < K
        xk = tl.load(x_ptr + x_rows.to(tl.int64)[:, None] * stride_xm + ks[None, :] * stride_xk,
                     mask=valid[:, None] & k_ok[None, :], other=0.0)                   # [BM, BK]
        a_tile = offs_r[None, :] * stride_ar + ks[:, None] * stride_ak
        a_ok = r_ok[None, :] & k_ok[:, None]
        acc = tl.dot(xk, tl.load(a_ptr + a_tile, mask=a_ok, other=0.0), acc, input_precision=DOT_PRECISION)
        if BOTH_SLICES:                                                                # the same x tile, slice 1's A
            acc1 = tl.dot(xk, tl.load(a1_ptr + a_off + a_tile, mask=a_ok, other=0.0), acc1,
                          input_precision=DOT_PRECISION)
    t = t_ptr + slice_id * stride_ts + pairs.to(tl.int64)[:, None] * stride_tm + offs_r[None, :] * stride_tr
    t_ok = valid[:, None] & r_ok[None, :]
    tl.store(t, acc.to(t_ptr.dtype.element_ty), mask=t_ok)                             # the HBM round trip
    if BOTH_SLICES:
        tl.store(t + stride_ts, acc1.to(t_ptr.dtype.element_ty), mask=t_ok)


@triton.jit
def expand_kernel(
    # ---- pointers
    t_ptr,             # [S, M*k, r] intermediate written by shrink_kernel, x's dtype
    b0_ptr, b1_ptr,    # LoRA B of slices 0 and 1: [L, E, N, r], x's dtype
    out_ptr,           # [M*k, S*N] rows of the [M, k, S*N] output, x's dtype
    topk_weights_ptr,  # [M*k] fp32 routing weight of each pair (read if MUL_ROUTED_WEIGHT)
    sorted_pairs_ptr, block_lora_ptr, block_expert_ptr,   # BlockList: [B*BM], [B], [B] int32
    lora_ranks_ptr,    # [L] int32 actual rank of each slot (read if HAS_RANKS)
    # ---- sizes
    num_pairs, N, R,
    slice_offset,      # output column of this launch's slice 0
    # ---- strides
    stride_ts, stride_tm, stride_tr,
    stride_bl, stride_be, stride_bn, stride_br,
    stride_om, stride_on,
    # ---- meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr, ADD_INPUTS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_RANKS: tl.constexpr,
):
    """Program (block, slice, N tile): out[rows, n-tile] (+)= w * T[s, rows] @ B[l, e, n-tile]^T."""
    block = tl.program_id(0)
    slice_id = tl.program_id(1)
    lora = tl.load(block_lora_ptr + block)
    if lora < 0:
        return
    expert = tl.load(block_expert_ptr + block)
    r_lim = slot_rank(lora_ranks_ptr, lora, R, HAS_RANKS)
    _, b_ptr = slice_pointers(slice_id, b0_ptr, b1_ptr, b0_ptr, b1_ptr)
    b_ptr += lora.to(tl.int64) * stride_bl + expert.to(tl.int64) * stride_be
    pairs, valid, _ = block_rows(sorted_pairs_ptr, block, num_pairs, 1, BLOCK_M, False)

    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, r_lim, BLOCK_R):
        rs = r0 + offs_r
        r_ok = rs < r_lim
        t = tl.load(t_ptr + slice_id * stride_ts + pairs.to(tl.int64)[:, None] * stride_tm + rs[None, :] * stride_tr,
                    mask=valid[:, None] & r_ok[None, :], other=0.0)                    # [BM, BR] from HBM
        bt = tl.load(b_ptr + offs_n[None, :] * stride_bn + rs[:, None] * stride_br,
                     mask=n_ok[None, :] & r_ok[:, None], other=0.0)                    # [BR, BN]
        acc = tl.dot(t, bt, acc, input_precision=DOT_PRECISION)
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + (slice_offset + slice_id * N + offs_n[None, :]) * stride_on
    mask = valid[:, None] & n_ok[None, :]
    if ADD_INPUTS:
        acc += tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
