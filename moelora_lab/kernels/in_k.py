"""w2's LoRA in K: the kernels that put the shrink of each pair into the w2 GEMM's own input.

Shape legend: M tokens, k top-k, E experts, L adapters, r rank, I expert intermediate, P = M*k pairs,
BM = BLOCK_M pairs per block, B blocks.

The w2 GEMM computes h @ w2^T per pair. Widen both operands by L*r columns: h_ext = [h | T2] with T2
holding, for a pair of adapter l, its shrink A2[l, e] h in columns l*r .. l*r + r and zeros
elsewhere, and w2_ext = [w2 | B2 of every adapter] (packed once). Then h_ext @ w2_ext^T is the base
output plus the pair's own LoRA: the LoRA rides the GEMM's pipelined K loop as a few more K steps,
with no delta buffer, no join and no kernel change to the GEMM.

``act_tail_kernel`` writes h and the zero tail in one pass (the activation reads c1 anyway);
``shrink_tail_kernel`` then writes each pair's shrink into its adapter's columns of the tail.
"""
import triton
import triton.language as tl

from .common import block_rows, rank_tile, slot_rank


@triton.jit
def act_tail_kernel(
    c1_ptr,            # [P, 2I] base gate | up, x's dtype
    delta_ptr,         # [P, 2I] w13's LoRA delta, written only for pairs with an adapter (read if HAS_DELTA)
    token_lora_ptr,    # [M] int32, -1 = no adapter
    h_ptr,             # [P, W] out: h in columns [0, I), zeros in [I, W); x's dtype
    top_k, I, W, stride_c, stride_d, stride_h,
    BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr,
):
    """Program (pair, column tile): h_ext[p, :I] = silu(gate + dg) * (up + du); h_ext[p, I:W] = 0."""
    pair = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    row = c1_ptr + pair.to(tl.int64) * stride_c
    gate = tl.load(row + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(row + I + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_DELTA:
        has = tl.load(token_lora_ptr + pair // top_k) >= 0
        drow = delta_ptr + pair.to(tl.int64) * stride_d
        gate += tl.load(drow + cols, mask=ok & has, other=0.0).to(tl.float32)
        up += tl.load(drow + I + cols, mask=ok & has, other=0.0).to(tl.float32)
    h = tl.where(ok, gate / (1.0 + tl.exp(-gate)) * up, 0.0)
    tl.store(h_ptr + pair.to(tl.int64) * stride_h + cols, h.to(h_ptr.dtype.element_ty), mask=cols < W)


@triton.jit
def shrink_tail_kernel(
    h_ptr,             # [P, >= I] activations (the first I columns of h_ext), x's dtype
    a_ptr,             # LoRA A of w2: [L, E, r, I], x's dtype
    tail_ptr,          # [P, L*r] view of h_ext's tail (row stride stride_tm), zeros where not written
    sorted_pairs_ptr, block_lora_ptr, block_expert_ptr,   # BlockList by (adapter, expert): [B*BM], [B], [B]
    lora_ranks_ptr,    # [L] int32 actual rank of each slot (read if HAS_RANKS)
    num_pairs, I, R,
    stride_hm, stride_al, stride_ae, stride_ar, stride_ak, stride_tm,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_RANKS: tl.constexpr,
):
    """Program (block, rank tile): tail[rows, l*R + r-tile] = h[rows] @ A[l, e, r-tile]^T."""
    block = tl.program_id(0)
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
