"""LoRA in K: the kernel that puts the shrink of each pair into a grouped GEMM's own input.

Shape legend: M tokens, k top-k, E experts, L adapters, r rank, K in (H for w13, I for w2), S slices,
P = M*k pairs, BM = BLOCK_M pairs per block, B blocks.

The w2 GEMM computes h @ w2^T per pair. Widen both operands by L*r columns: h_ext = [h | T2] with T2
holding, for a pair of adapter l, its shrink A2[l, e] h in columns l*r .. l*r + r and zeros
elsewhere, and w2_ext = [w2 | B2 of every adapter] (packed once). Then h_ext @ w2_ext^T is the base
output plus the pair's own LoRA: the LoRA rides the GEMM's pipelined K loop as a few more K steps,
with no delta buffer, no join and no kernel change to the GEMM.

The activation (``base_moe.silu_and_mul_kernel``) writes h into the first I columns of h_ext;
``shrink_tail_kernel`` writes the whole tail in one launch: each pair's shrink into its adapter's
columns (one program per block of pairs of one adapter and expert, as the two-kernel path's shrink),
zeros everywhere else (fill programs over all pairs, which skip exactly the columns a block program
writes, so no element is written twice).

``act_shrink_kernel`` does the activation and the w2 shrink in one pass instead: one program per
block of the base GEMM's list (one expert, adapters mixed) computes h chunk by chunk, stores it and
multiplies it by the stacked A2 rows of every adapter the block holds (as the in-GEMM LoRA does),
then writes each row's own adapter's columns of the tail and zeros in the rest: h is never read back.

w13 works the same way with two differences: its input x has one row per token, so the tail T1
[S, P, L*r] (one per slice: gate, up) lives in its own buffer and the GEMM reads its last K steps
from there (``moe_gemm_kernel``'s X_TAIL), and the shrink reads x by token (TOKEN_ROWS).
"""
import triton
import triton.language as tl

from .common import block_rows, rank_tile, slice_pointers, slot_rank


@triton.jit
def _fill(tail_ptr, token_lora_ptr, lora_ranks_ptr, f, num_pairs, top_k, R, LR, stride_tm,
          BLOCK_LR: tl.constexpr, FILL_ROWS: tl.constexpr, HAS_RANKS: tl.constexpr):
    """Zeros into the tail of pairs f*FILL_ROWS.., except the columns of their own adapter's ranks."""
    pairs = f * FILL_ROWS + tl.arange(0, FILL_ROWS)
    ok = pairs < num_pairs
    lora = tl.load(token_lora_ptr + pairs // top_k, mask=ok, other=-1).to(tl.int32)            # [FR]
    r_lim = tl.zeros_like(lora) + R
    if HAS_RANKS:
        r_lim = tl.minimum(tl.load(lora_ranks_ptr + lora, mask=lora >= 0, other=0), R)
    cols = tl.arange(0, BLOCK_LR)
    first = lora * R
    own = (lora[:, None] >= 0) & (cols[None, :] >= first[:, None]) & (cols[None, :] < (first + r_lim)[:, None])
    zero = tl.zeros((FILL_ROWS, BLOCK_LR), dtype=tail_ptr.dtype.element_ty)
    tl.store(tail_ptr + pairs.to(tl.int64)[:, None] * stride_tm + cols[None, :], zero,
             mask=ok[:, None] & (cols < LR)[None, :] & ~own)


@triton.jit
def shrink_tail_kernel(
    h_ptr,             # [P, >= K] (w2: h, the first I columns of h_ext) or [M, K] (TOKEN_ROWS: w13's x)
    a0_ptr, a1_ptr,    # LoRA A of slices 0 and 1: [L, E, r, K] (K = I for w2, H for w13); slice 0 twice if S == 1
    tail_ptr,          # [S, P, L*r] (row stride stride_tm, slice stride stride_ts), h's dtype; every element written
    sorted_pairs_ptr, block_lora_ptr, block_expert_ptr,   # BlockList by (adapter, expert): [B*BM], [B], [B]
    token_lora_ptr,    # [M] int32/int64 adapter of each token, -1 = none
    lora_ranks_ptr,    # [L] int32 actual rank of each slot (read if HAS_RANKS)
    num_pairs, num_blocks, top_k, K, R, LR, rank_tiles,
    stride_hm, stride_al, stride_ae, stride_ar, stride_ak, stride_tm, stride_ts,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_LR: tl.constexpr,
    FILL_ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_RANKS: tl.constexpr, TOKEN_ROWS: tl.constexpr = False,
    BOTH_SLICES: tl.constexpr = False,   # S == 2: one program writes both slices' tile from one read of its rows
):
    """Program (block, slice * rank tiles + rank tile): tail[s, rows, l*R + r-tile] = h[rows] @ A_s[l, e,
    r-tile]^T (with BOTH_SLICES, program (block, rank tile) writes slices 0 and 1). Programs past the
    blocks (rank tile 0 of each slice): zeros into FILL_ROWS pairs' tails, but for their own columns."""
    block = tl.program_id(0)
    slice_id, rt = tl.program_id(1) // rank_tiles, tl.program_id(1) % rank_tiles
    tail_ptr += slice_id.to(tl.int64) * stride_ts
    if block >= num_blocks:
        if rt == 0:
            _fill(tail_ptr, token_lora_ptr, lora_ranks_ptr, block - num_blocks, num_pairs, top_k, R, LR, stride_tm,
                  BLOCK_LR, FILL_ROWS, HAS_RANKS)
            if BOTH_SLICES:
                _fill(tail_ptr + stride_ts, token_lora_ptr, lora_ranks_ptr, block - num_blocks, num_pairs, top_k, R,
                      LR, stride_tm, BLOCK_LR, FILL_ROWS, HAS_RANKS)
        return
    lora = tl.load(block_lora_ptr + block)
    if lora < 0:
        return
    r_lim = slot_rank(lora_ranks_ptr, lora, R, HAS_RANKS)
    if rt * BLOCK_R >= r_lim:
        return                                           # past the adapter's rank: the tail keeps its zeros
    expert = tl.load(block_expert_ptr + block)
    a_ptr, _ = slice_pointers(slice_id, a0_ptr, a1_ptr, a0_ptr, a1_ptr)
    a_off = lora.to(tl.int64) * stride_al + expert.to(tl.int64) * stride_ae      # A[l, e] in either slice
    pairs, valid, rows = block_rows(sorted_pairs_ptr, block, num_pairs, top_k, BLOCK_M, TOKEN_ROWS)
    offs_r, r_ok = rank_tile(rt * BLOCK_R, r_lim, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    if BOTH_SLICES:
        acc1 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < K
        hk = tl.load(h_ptr + rows.to(tl.int64)[:, None] * stride_hm + ks[None, :], mask=valid[:, None] & k_ok[None, :],
                     other=0.0)                                                          # [BM, BK]
        a_tile = a_off + offs_r[None, :] * stride_ar + ks[:, None] * stride_ak
        a_ok = r_ok[None, :] & k_ok[:, None]
        acc = tl.dot(hk, tl.load(a_ptr + a_tile, mask=a_ok, other=0.0), acc, input_precision=DOT_PRECISION)
        if BOTH_SLICES:
            acc1 = tl.dot(hk, tl.load(a1_ptr + a_tile, mask=a_ok, other=0.0), acc1, input_precision=DOT_PRECISION)
    tail = tail_ptr + pairs.to(tl.int64)[:, None] * stride_tm + (lora * R + offs_r)[None, :]
    tl.store(tail, acc.to(tail_ptr.dtype.element_ty), mask=valid[:, None] & r_ok[None, :])
    if BOTH_SLICES:
        tl.store(tail + stride_ts, acc1.to(tail_ptr.dtype.element_ty), mask=valid[:, None] & r_ok[None, :])


@triton.jit
def act_shrink_kernel(
    c1_ptr,            # [P, 2I] the w13 GEMM's output per pair (gate | up), x's dtype
    delta_ptr,         # [P, 2I] w13's LoRA delta, written only for pairs with an adapter (read if HAS_DELTA)
    a_ptr,             # LoRA A of w2: [L, E, r, I], x's dtype
    h_ptr,             # [P, I + L*r] h_ext out, x's dtype: h, then the tail; every element of a listed pair written
    sorted_pairs_ptr, block_expert_ptr,   # BlockList by expert (the base GEMM's): [B*BM] sentinel P, [B]
    token_lora_ptr,    # [M] int32 adapter of each token, -1 = none
    lora_ranks_ptr,    # [L] int32 actual rank of each slot (read if HAS_RANKS)
    num_pairs, top_k, I, R, num_loras,
    stride_c, stride_d, stride_h, stride_al, stride_ae, stride_ar, stride_ak,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_LR: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_DELTA: tl.constexpr, HAS_RANKS: tl.constexpr,
):
    """Program (block of one expert's pairs): h = silu(gate) * up (+ the w13 delta) into h_ext's first I
    columns, and in the same pass the w2 shrink of every row into the tail: the block's adapters' A2
    rows stacked as BLOCK_LR columns, each row keeping its own adapter's (zeros in the others)."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    pairs, valid, _ = block_rows(sorted_pairs_ptr, block, num_pairs, top_k, BLOCK_M, False)
    cols = tl.arange(0, BLOCK_LR)
    col_l, col_r = cols // R, cols % R
    row_l = tl.load(token_lora_ptr + pairs // top_k, mask=valid, other=-1)                     # [BM]
    hit = (row_l[:, None] == col_l[None, :]) & valid[:, None]                                   # [BM, LR]
    col_ok = (tl.max(hit.to(tl.int32), axis=0) > 0) & (col_l < num_loras)
    col_ok = col_ok & (col_r < slot_rank(lora_ranks_ptr, tl.where(col_ok, col_l, 0), R, HAS_RANKS))
    a_cols = (a_ptr + expert.to(tl.int64) * stride_ae + tl.where(col_ok, col_l, 0).to(tl.int64) * stride_al
              + tl.where(col_ok, col_r, 0) * stride_ar)
    c_rows = c1_ptr + pairs.to(tl.int64)[:, None] * stride_c
    h_rows = h_ptr + pairs.to(tl.int64)[:, None] * stride_h
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_LR), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        ks = k0 + offs_k
        ok = valid[:, None] & (ks < I)[None, :]
        gate = tl.load(c_rows + ks[None, :], mask=ok, other=0.0).to(tl.float32)                # [BM, BK]
        up = tl.load(c_rows + I + ks[None, :], mask=ok, other=0.0).to(tl.float32)
        if HAS_DELTA:
            d_rows = delta_ptr + pairs.to(tl.int64)[:, None] * stride_d
            has = ok & (row_l >= 0)[:, None]
            gate += tl.load(d_rows + ks[None, :], mask=has, other=0.0).to(tl.float32)
            up += tl.load(d_rows + I + ks[None, :], mask=has, other=0.0).to(tl.float32)
        h = (gate / (1.0 + tl.exp(-gate)) * up).to(h_ptr.dtype.element_ty)
        tl.store(h_rows + ks[None, :], h, mask=ok)
        ak = tl.load(a_cols[None, :] + ks[:, None] * stride_ak, mask=col_ok[None, :] & (ks < I)[:, None],
                     other=0.0)                                                                  # [BK, LR]
        acc = tl.dot(h, ak, acc, input_precision=DOT_PRECISION)
    tail = tl.where(hit & col_ok[None, :], acc, 0.0).to(h_ptr.dtype.element_ty)
    tl.store(h_rows + I + cols[None, :], tail, mask=valid[:, None] & (cols < num_loras * R)[None, :])
