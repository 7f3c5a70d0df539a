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

(A single pass that computed h block by block over the base GEMM's list and multiplied it at once by
the stacked A2 rows of the block's adapters, so that h is never read back, measured 1.4-2.8x slower
on the H200 than the activation and this shrink as two launches, M = 512 to 8192, r 16 and 32, over
BLOCK_K 32 / 64, 4 / 8 warps and 1-3 stages: one program per block of up to 128 pairs streams its
rows serially, where the activation's one program per pair keeps far more loads in flight.)

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
    # ---- pointers
    h_ptr,             # [P, >= K] (w2: h, the first I columns of h_ext) or [M, K] (TOKEN_ROWS: w13's x); fp32/fp16/bf16
    a0_ptr, a1_ptr,    # LoRA A of slices 0 and 1: [L, E, r, K], h's dtype (K = I for w2, H for w13);
                       # slice 0 twice if S == 1
    tail_ptr,          # [S, P, L*r] (row stride stride_tm, slice stride stride_ts), h's dtype; every element written
    sorted_pairs_ptr, block_lora_ptr, block_expert_ptr,   # BlockList by (adapter, expert): [B*BM], [B], [B] int32
    token_lora_ptr,    # [M] int32/int64 adapter of each token, -1 = none
    lora_ranks_ptr,    # [L] int32 actual rank of each slot (read if HAS_RANKS)
    # ---- sizes
    num_pairs, num_blocks, top_k, K, R, LR, rank_tiles,
    # ---- strides (the columns of h and of the tail are contiguous)
    stride_hm, stride_al, stride_ae, stride_ar, stride_ak, stride_tm, stride_ts,
    # ---- meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_LR: tl.constexpr,
    FILL_ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_RANKS: tl.constexpr, TOKEN_ROWS: tl.constexpr = False,
    BOTH_SLICES: tl.constexpr = False,   # S == 2: one program writes both slices' tile from one read of its rows
):
    """Program (block, slice * rank tiles + rank tile): tail[s, rows, l*R + r-tile] = h[rows] @ A_s[l, e,
    r-tile]^T (with BOTH_SLICES, program (block, rank tile) writes slices 0 and 1). Programs past the
    blocks (rank tile 0 of each slice): zeros into FILL_ROWS pairs' tails, but for their own columns."""
    _shrink_tail_program(tl.program_id(0), tl.program_id(1), h_ptr, a0_ptr, a1_ptr, tail_ptr, sorted_pairs_ptr,
                         block_lora_ptr, block_expert_ptr, token_lora_ptr, lora_ranks_ptr, num_pairs, num_blocks, top_k,
                         K, R, LR, rank_tiles, stride_hm, stride_al, stride_ae, stride_ar, stride_ak, stride_tm,
                         stride_ts, BLOCK_M, BLOCK_K, BLOCK_R, BLOCK_LR, FILL_ROWS, DOT_PRECISION, HAS_RANKS,
                         TOKEN_ROWS, BOTH_SLICES)


@triton.jit
def _shrink_tail_program(block, column, h_ptr, a0_ptr, a1_ptr, tail_ptr, sorted_pairs_ptr, block_lora_ptr,
                         block_expert_ptr, token_lora_ptr, lora_ranks_ptr, num_pairs, num_blocks, top_k, K, R, LR,
                         rank_tiles, stride_hm, stride_al, stride_ae, stride_ar, stride_ak, stride_tm, stride_ts,
                         BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_LR: tl.constexpr, FILL_ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         HAS_RANKS: tl.constexpr, TOKEN_ROWS: tl.constexpr, BOTH_SLICES: tl.constexpr):
    """The work of ``shrink_tail_kernel``'s program (block, column), wherever it is launched from."""
    slice_id, rt = column // rank_tiles, column % rank_tiles
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

