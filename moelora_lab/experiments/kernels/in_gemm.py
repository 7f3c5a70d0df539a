"""The grouped GEMM with the LoRA inside it: the kernel of the ``fused`` and ``epilogue`` schedules.

Shape legend: M tokens, k top-k, E experts, K in, N out, L adapters, r rank (R = the weights' rank dim),
S slices, P = M*k pairs, BM = BLOCK_M pairs per block, BN = BLOCK_N, BK = BLOCK_K, LR = BLOCK_LR, B blocks.

The base GEMM's program (``kernels/base_moe.moe_gemm_kernel``, from whose pieces this one is built)
also computes the LoRA of every row in the same pass: the shrink of all the block's adapters rides
along the K loop on the x tile already in registers (A is stacked as LR >= L*r columns, and columns of
adapters no row uses are never loaded), and the expand is one more dot into the accumulator. No extra
launch, no delta buffer, no join. The shrink is recomputed by every N tile and covers all adapters
present in the block, so it pays where the GEMM waits on memory (small M), not where it is
compute-bound. (A variant that branched at run time to a narrow shrink for blocks with a single
adapter measured slower on the H200: the three loops cost more than the columns they saved.) With
T_IN the shrink T = A x was computed beforehand, once per pair, by the two-kernel path's shrink, and
only the expand runs here, before the K loop: one dot of K = L*r per output tile.
"""
import triton
import triton.language as tl

from ...kernels.base_moe import half_tile, store_tile, tile_operands, w_tile, x_tile
from ...kernels.common import gemm_tile, slice_pointers, slot_rank


@triton.jit
def _expand(acc, t, hit, col_ok, col_l, col_r, b_ptr, expert, n_local, n_ok, stride_be, stride_bl, stride_br,
            stride_bn, dtype: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc += T (each row's own adapter's stacked columns only) @ B[adapter, e, n-tile, rank]^T."""
    t = tl.where(hit & col_ok[None, :], t, 0.0).to(dtype)
    bt = tl.load(b_ptr + expert.to(tl.int64) * stride_be + col_l.to(tl.int64)[:, None] * stride_bl
                 + col_r[:, None] * stride_br + n_local[None, :] * stride_bn,
                 mask=col_ok[:, None] & n_ok[None, :], other=0.0)                     # [LR, BN]
    return tl.dot(t, bt, acc, input_precision=DOT_PRECISION)


@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def moe_gemm_lora_kernel(
    # pointers: the base GEMM's (``moe_gemm_kernel``'s) x [M or P, K] (fp32/fp16/bf16), w [E, N, K] and its
    # TMA descriptor, out [P, N] (x's dtype), topk weights [P] fp32, blocks by expert [B*BM] and [B] int32
    x_ptr, w_ptr, w_desc, out_ptr, topk_weights_ptr, sorted_pairs_ptr, block_expert_ptr,
    # and the LoRA's
    token_lora_ptr,    # [M] int32 adapter of each token, -1 = none
    a0_ptr, a1_ptr,    # LoRA A of slices 0 and 1: [L, E, R, K], x's dtype (slice 0 twice when S = 1)
    b0_ptr, b1_ptr,    # LoRA B of slices 0 and 1: [L, E, N/S, R], x's dtype
    lora_ranks_ptr,    # [L] int32 actual rank of each slot (read if HAS_RANKS)
    t_ptr,             # [S, P, R] the shrink computed beforehand, x's dtype (read if T_IN)
    # sizes
    num_pairs, top_k, K, N, num_blocks, num_loras, R,
    n_slice,           # columns per slice: N / S
    # strides
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    stride_al, stride_ae, stride_ar, stride_ak, stride_bl, stride_be, stride_bn, stride_br,
    stride_ts, stride_tp, stride_tr,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_LR: tl.constexpr,           # >= L*r: the stacked (adapter, rank) columns of the LoRA shrink
    TOKEN_ROWS: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_RANKS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    W_TMA: tl.constexpr,              # W tiles through the tensor memory accelerator (Hopper and later)
    T_IN: tl.constexpr,               # read the shrink from t_ptr, expand before the K loop
    HALF_TAIL: tl.constexpr = False,  # a block whose second half is padding runs a BM / 2 tile
):
    """Program (block, N tile): out[rows, n-tile] = (w *) (X[rows] @ W[e, n-tile]^T + LoRA of each row).

    Programs are numbered, W tiles loaded and half tiles run as ``moe_gemm_kernel``'s; neighbours in
    time also share the block's A rows through L2."""
    block, slice_id, n0 = gemm_tile(tl.program_id(0), N, n_slice, num_blocks, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    start = block * BLOCK_M
    if half_tile(sorted_pairs_ptr, start, num_pairs, BLOCK_M, HALF_TAIL):
        _lora_tile(start, expert, slice_id, n0, x_ptr, w_ptr, w_desc, out_ptr, topk_weights_ptr, sorted_pairs_ptr,
                   token_lora_ptr, a0_ptr, a1_ptr, b0_ptr, b1_ptr, lora_ranks_ptr, t_ptr, num_pairs, top_k, K, N,
                   num_loras, R, n_slice, stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_om,
                   stride_on, stride_al, stride_ae, stride_ar, stride_ak, stride_bl, stride_be, stride_bn, stride_br,
                   stride_ts, stride_tp, stride_tr, BLOCK_M // 2, BLOCK_N, BLOCK_K, BLOCK_LR, TOKEN_ROWS,
                   MUL_ROUTED_WEIGHT, EVEN_K, HAS_RANKS, DOT_PRECISION, W_TMA, T_IN)
    else:
        _lora_tile(start, expert, slice_id, n0, x_ptr, w_ptr, w_desc, out_ptr, topk_weights_ptr, sorted_pairs_ptr,
                   token_lora_ptr, a0_ptr, a1_ptr, b0_ptr, b1_ptr, lora_ranks_ptr, t_ptr, num_pairs, top_k, K, N,
                   num_loras, R, n_slice, stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_om,
                   stride_on, stride_al, stride_ae, stride_ar, stride_ak, stride_bl, stride_be, stride_bn, stride_br,
                   stride_ts, stride_tp, stride_tr, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_LR, TOKEN_ROWS,
                   MUL_ROUTED_WEIGHT, EVEN_K, HAS_RANKS, DOT_PRECISION, W_TMA, T_IN)


@triton.jit
def _lora_tile(start, expert, slice_id, n0, x_ptr, w_ptr, w_desc, out_ptr, topk_weights_ptr, sorted_pairs_ptr,
               token_lora_ptr, a0_ptr, a1_ptr, b0_ptr, b1_ptr, lora_ranks_ptr, t_ptr, num_pairs, top_k, K, N,
               num_loras, R, n_slice, stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_om, stride_on,
               stride_al, stride_ae, stride_ar, stride_ak, stride_bl, stride_be, stride_bn, stride_br,
               stride_ts, stride_tp, stride_tr,
               BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_LR: tl.constexpr,
               TOKEN_ROWS: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr,
               HAS_RANKS: tl.constexpr, DOT_PRECISION: tl.constexpr, W_TMA: tl.constexpr, T_IN: tl.constexpr):
    """One output tile of ``moe_gemm_lora_kernel``: the BM pairs from slot ``start`` of ``expert``'s blocks."""
    pairs, valid, x_rows, n_local, n_ok, offs_n, offs_k, x_base, w_base, w_row0 = tile_operands(
        start, expert, slice_id, n0, x_ptr, w_ptr, sorted_pairs_ptr, num_pairs, top_k, N, n_slice, stride_xm,
        stride_we, stride_wn, BM, BLOCK_N, BLOCK_K, TOKEN_ROWS)
    acc = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
    # column c of the stacked shrink is rank c % r of adapter c // r; it is kept for a row only
    # if that row's token uses the adapter, and loaded only if some row of the block does
    cols = tl.arange(0, BLOCK_LR)
    col_l, col_r = cols // R, cols % R
    row_l = tl.load(token_lora_ptr + pairs // top_k, mask=valid, other=-1)                    # [BM]
    hit = (row_l[:, None] == col_l[None, :]) & valid[:, None]                                  # [BM, LR]
    col_ok = (tl.max(hit.to(tl.int32), axis=0) > 0) & (col_l < num_loras)
    col_ok = col_ok & (col_r < slot_rank(lora_ranks_ptr, tl.where(col_ok, col_l, 0), R, HAS_RANKS))
    col_l, col_r = tl.where(col_ok, col_l, 0), tl.where(col_ok, col_r, 0)
    a_ptr, b_ptr = slice_pointers(slice_id, a0_ptr, a1_ptr, b0_ptr, b1_ptr)
    if T_IN:
        # the shrink came from HBM: expand before the K loop, where its loads overlap the pipeline's
        # first loads of x and W (after the loop nothing hides them: measured 7-12% slower on the H200)
        t = tl.load(t_ptr + slice_id * stride_ts + pairs.to(tl.int64)[:, None] * stride_tp
                    + col_r[None, :] * stride_tr, mask=hit & col_ok[None, :], other=0.0)
        acc = _expand(acc, t, hit, col_ok, col_l, col_r, b_ptr, expert, n_local, n_ok, stride_be, stride_bl,
                      stride_br, stride_bn, x_ptr.dtype.element_ty, DOT_PRECISION)
    else:
        a_cols = a_ptr + expert.to(tl.int64) * stride_ae + col_l.to(tl.int64) * stride_al + col_r * stride_ar
        t = tl.zeros((BM, BLOCK_LR), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        xk = x_tile(x_base, ks, valid, K, stride_xk, EVEN_K)
        wk = w_tile(w_base, w_desc, w_row0, k0, ks, n_ok, K, stride_wk, EVEN_K, W_TMA)
        acc = tl.dot(xk, wk, acc, input_precision=DOT_PRECISION)                  # [BM, BK] @ [BK, BN]
        if not T_IN:
            if EVEN_K:
                ak = tl.load(a_cols[None, :] + ks[:, None] * stride_ak, mask=col_ok[None, :], other=0.0)
            else:
                ak = tl.load(a_cols[None, :] + ks[:, None] * stride_ak,
                             mask=col_ok[None, :] & (ks < K)[:, None], other=0.0)
            t = tl.dot(xk, ak, t, input_precision=DOT_PRECISION)                  # [BM, BK] @ [BK, LR]
    if not T_IN:
        acc = _expand(acc, t, hit, col_ok, col_l, col_r, b_ptr, expert, n_local, n_ok, stride_be, stride_bl,
                      stride_br, stride_bn, x_ptr.dtype.element_ty, DOT_PRECISION)
    store_tile(acc, pairs, valid, offs_n, n_ok, out_ptr, topk_weights_ptr, stride_om, stride_on, MUL_ROUTED_WEIGHT)
