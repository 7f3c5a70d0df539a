"""w2's LoRA in K: the kernels that put the shrink of each pair into the w2 GEMM's own input.

Shape legend: M tokens, k top-k, E experts, L adapters, r rank, I expert intermediate, P = M*k pairs,
BM = BLOCK_M pairs per block, B blocks.

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
"""
import triton
import triton.language as tl

from .common import block_rows, rank_tile, slot_rank


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
    h_ptr,             # [P, >= I] activations (the first I columns of h_ext), x's dtype
    a_ptr,             # LoRA A of w2: [L, E, r, I], x's dtype
    tail_ptr,          # [P, L*r] view of h_ext's tail (row stride stride_tm), x's dtype; every element written
    sorted_pairs_ptr, block_lora_ptr, block_expert_ptr,   # BlockList by (adapter, expert): [B*BM], [B], [B]
    token_lora_ptr,    # [M] int32/int64 adapter of each token, -1 = none
    lora_ranks_ptr,    # [L] int32 actual rank of each slot (read if HAS_RANKS)
    num_pairs, num_blocks, top_k, I, R, LR,
    stride_hm, stride_al, stride_ae, stride_ar, stride_ak, stride_tm,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_LR: tl.constexpr,
    FILL_ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_RANKS: tl.constexpr,
):
    """Program (block, rank tile): tail[rows, l*R + r-tile] = h[rows] @ A[l, e, r-tile]^T. Programs
    past the blocks (rank tile 0 only): zeros into FILL_ROWS pairs' tails, but for their own columns."""
    block = tl.program_id(0)
    if block >= num_blocks:
        if tl.program_id(1) == 0:
            _fill(tail_ptr, token_lora_ptr, lora_ranks_ptr, block - num_blocks, num_pairs, top_k, R, LR, stride_tm,
                  BLOCK_LR, FILL_ROWS, HAS_RANKS)
        return
    lora = tl.load(block_lora_ptr + block)
    if lora < 0:
        return
    r_lim = slot_rank(lora_ranks_ptr, lora, R, HAS_RANKS)
    if tl.program_id(1) * BLOCK_R >= r_lim:
        return                                           # past the adapter's rank: the tail keeps its zeros
    expert = tl.load(block_expert_ptr + block)
    a = a_ptr + lora.to(tl.int64) * stride_al + expert.to(tl.int64) * stride_ae
    pairs, valid, rows = block_rows(sorted_pairs_ptr, block, num_pairs, 1, BLOCK_M, False)
    offs_r, r_ok = rank_tile(tl.program_id(1) * BLOCK_R, r_lim, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < I
        hk = tl.load(h_ptr + rows.to(tl.int64)[:, None] * stride_hm + ks[None, :], mask=valid[:, None] & k_ok[None, :],
                     other=0.0)                                                          # [BM, BK]
        ak = tl.load(a + offs_r[None, :] * stride_ar + ks[:, None] * stride_ak, mask=r_ok[None, :] & k_ok[:, None],
                     other=0.0)                                                          # [BK, BR]
        acc = tl.dot(hk, ak, acc, input_precision=DOT_PRECISION)
    tail = tail_ptr + pairs.to(tl.int64)[:, None] * stride_tm + (lora * R + offs_r)[None, :]
    tl.store(tail, acc.to(tail_ptr.dtype.element_ty), mask=valid[:, None] & r_ok[None, :])
