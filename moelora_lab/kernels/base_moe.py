"""The base MoE layer's kernels: grouped GEMM over expert-sorted blocks, activation, top-k sum.

Shape legend: M tokens, k top-k, E experts, K in, N out, H hidden, I expert intermediate,
L adapters, r rank, S slices, P = M*k pairs, BM = BLOCK_M pairs per block, B blocks.

With HAS_LORA the grouped GEMM also computes the LoRA of every row in the same pass ("in-GEMM
LoRA"): the shrink of all the block's adapters rides along the K loop on the x tile already in
registers (A is stacked as BLOCK_LR = L*r columns, and columns of adapters no row uses are never
loaded), and the expand is one more dot into the accumulator. No extra launch, no delta buffer, no
join. The shrink is recomputed by every N tile and covers all adapters present in the block, so it
pays where the GEMM waits on memory (small M), not where it is compute-bound. (A variant that
branched at run time to a narrow shrink for blocks with a single adapter measured slower on the
H200: the three loops cost more than the columns they saved.) With T_IN the shrink T = A x was
computed beforehand, once per pair, by the two-kernel path's shrink, and only the expand runs here,
before the K loop: one dot of K = L*r per output tile.

The activation and the top-k sum are where the dual-stream layer joins the LoRA stream: they read
the LoRA delta only for pairs whose token has an adapter (HAS_DELTA), so the delta buffers need no
zero-fill and no separate add pass.
"""
import triton
import triton.language as tl

from .common import gemm_tile, rows_at, slice_pointers, slot_rank


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
def moe_gemm_kernel(
    x_ptr,             # [M, K] (TOKEN_ROWS) or [P, K]; fp32/fp16/bf16
    w_ptr,             # [E, N, K] expert weights, x's dtype
    w_desc,            # TMA descriptor of W viewed [E*N, K], box [BLOCK_N, BLOCK_K] (read if W_TMA)
    out_ptr,           # [P, N] one row per pair, x's dtype
    topk_weights_ptr,  # [P] fp32 (read if MUL_ROUTED_WEIGHT)
    sorted_pairs_ptr,  # [B*BM] int32 pairs grouped by expert, sentinel P
    block_expert_ptr,  # [B] int32 expert of each block, -1 = unused
    token_lora_ptr,    # [M] int32 adapter of each token, -1 = none (read if HAS_LORA)
    a0_ptr, a1_ptr,    # LoRA A of slices 0 and 1: [L, E, r, K], x's dtype (read if HAS_LORA)
    b0_ptr, b1_ptr,    # LoRA B of slices 0 and 1: [L, E, N/S, r], x's dtype (read if HAS_LORA)
    lora_ranks_ptr,    # [L] int32 actual rank of each slot (read if HAS_RANKS)
    t_ptr,             # [S, P, r] the shrink computed beforehand, x's dtype (read if T_IN)
    num_pairs, top_k, K, N, num_blocks, num_loras, R,
    n_slice,           # columns per slice: N (no LoRA, or S = 1) or N / 2 (w13 with LoRA)
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    stride_al, stride_ae, stride_ar, stride_ak, stride_bl, stride_be, stride_bn, stride_br,
    stride_ts, stride_tp, stride_tr,
    x_cols,            # X_TAIL: x's own columns (<= tail_at); K - tail_at tail columns follow
    tail_at,           # X_TAIL: the K step where the tail starts (a multiple of BLOCK_K)
    tail_off,          # X_TAIL: the tail T [S, P, K - tail_at] as an element offset from x_ptr (unit column stride)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_LR: tl.constexpr,           # >= L*r: the stacked (adapter, rank) columns of the LoRA shrink
    TOKEN_ROWS: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_LORA: tl.constexpr, HAS_RANKS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    W_TMA: tl.constexpr,              # W tiles through the tensor memory accelerator (Hopper and later)
    T_IN: tl.constexpr,               # with HAS_LORA: read the shrink from t_ptr, expand before the K loop
    X_TAIL: tl.constexpr = False,     # K steps from tail_at on read the pair's row of T (LoRA in K), not x
    HALF_TAIL: tl.constexpr = False,  # a block whose second half is padding runs a BLOCK_M / 2 tile
):
    """Program (block, N tile): out[rows, n-tile] = (w *) (X[rows] @ W[e, n-tile]^T + LoRA of each row).

    Programs are numbered GROUP_M blocks at a time, N tiles inside a group, so neighbours in time
    share x rows (and, with HAS_LORA, the block's A rows) through L2. With W_TMA the W tile is one
    bulk copy of BLOCK_N rows of the [E*N, K] view (rows past the tile's N are read but never stored;
    rows and columns past the tensor arrive as zeros). With X_TAIL, x is widened by each pair's own
    row of T: one K loop whose steps past tail_at read T (pair rows) instead of x (token rows), by
    switching the rows' offsets, so the LoRA rides the same pipeline (x's columns unit-strided).
    With HALF_TAIL, the last block of an expert whose pairs end in its first half (its slot BLOCK_M / 2
    holds the sentinel: a group's pairs fill its blocks from the front) multiplies a tile of half the
    rows, so the padding rows an expert's last block computes are at most BLOCK_M / 2 - 1, not BLOCK_M - 1.
    """
    block, slice_id, n0 = gemm_tile(tl.program_id(0), N, n_slice, num_blocks, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    start = block * BLOCK_M
    half = False
    if HALF_TAIL:
        half = tl.load(sorted_pairs_ptr + start + BLOCK_M // 2) >= num_pairs
    if half:
        _block_tile(start, expert, slice_id, n0, x_ptr, w_ptr, w_desc, out_ptr, topk_weights_ptr, sorted_pairs_ptr,
                    token_lora_ptr, a0_ptr, a1_ptr, b0_ptr, b1_ptr, lora_ranks_ptr, t_ptr, num_pairs, top_k, K, N,
                    num_loras, R, n_slice, stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_om,
                    stride_on, stride_al, stride_ae, stride_ar, stride_ak, stride_bl, stride_be, stride_bn, stride_br,
                    stride_ts, stride_tp, stride_tr, x_cols, tail_at, tail_off, BLOCK_M // 2, BLOCK_N, BLOCK_K,
                    BLOCK_LR, TOKEN_ROWS, MUL_ROUTED_WEIGHT, EVEN_K, HAS_LORA, HAS_RANKS, DOT_PRECISION, W_TMA, T_IN,
                    X_TAIL)
    else:
        _block_tile(start, expert, slice_id, n0, x_ptr, w_ptr, w_desc, out_ptr, topk_weights_ptr, sorted_pairs_ptr,
                    token_lora_ptr, a0_ptr, a1_ptr, b0_ptr, b1_ptr, lora_ranks_ptr, t_ptr, num_pairs, top_k, K, N,
                    num_loras, R, n_slice, stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_om,
                    stride_on, stride_al, stride_ae, stride_ar, stride_ak, stride_bl, stride_be, stride_bn, stride_br,
                    stride_ts, stride_tp, stride_tr, x_cols, tail_at, tail_off, BLOCK_M, BLOCK_N, BLOCK_K,
                    BLOCK_LR, TOKEN_ROWS, MUL_ROUTED_WEIGHT, EVEN_K, HAS_LORA, HAS_RANKS, DOT_PRECISION, W_TMA, T_IN,
                    X_TAIL)


@triton.jit
def _block_tile(start, expert, slice_id, n0, x_ptr, w_ptr, w_desc, out_ptr, topk_weights_ptr, sorted_pairs_ptr,
                token_lora_ptr, a0_ptr, a1_ptr, b0_ptr, b1_ptr, lora_ranks_ptr, t_ptr, num_pairs, top_k, K, N,
                num_loras, R, n_slice, stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_om, stride_on,
                stride_al, stride_ae, stride_ar, stride_ak, stride_bl, stride_be, stride_bn, stride_br,
                stride_ts, stride_tp, stride_tr, x_cols, tail_at, tail_off,
                BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_LR: tl.constexpr,
                TOKEN_ROWS: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr,
                HAS_LORA: tl.constexpr, HAS_RANKS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                W_TMA: tl.constexpr, T_IN: tl.constexpr, X_TAIL: tl.constexpr):
    """One output tile of ``moe_gemm_kernel``: the BM pairs from slot ``start`` of ``expert``'s blocks."""
    pairs, valid, x_rows = rows_at(sorted_pairs_ptr, start, num_pairs, top_k, BM, TOKEN_ROWS)
    n_local = n0 + tl.arange(0, BLOCK_N)
    n_ok = n_local < n_slice
    offs_n = slice_id * n_slice + n_local
    offs_k = tl.arange(0, BLOCK_K)
    x_base = x_ptr + x_rows.to(tl.int64)[:, None] * stride_xm
    w_base = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
    acc = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
    if HAS_LORA:
        # column c of the stacked shrink is rank c % r of adapter c // r; it is kept for a row only
        # if that row's token uses the adapter, and loaded only if some row of the block does
        cols = tl.arange(0, BLOCK_LR)
        col_l, col_r = cols // R, cols % R
        row_l = tl.load(token_lora_ptr + pairs // top_k, mask=valid, other=-1)                # [BM]
        hit = (row_l[:, None] == col_l[None, :]) & valid[:, None]                              # [BM, LR]
        col_ok = (tl.max(hit.to(tl.int32), axis=0) > 0) & (col_l < num_loras)
        col_ok = col_ok & (col_r < slot_rank(lora_ranks_ptr, tl.where(col_ok, col_l, 0), R, HAS_RANKS))
        col_l, col_r = tl.where(col_ok, col_l, 0), tl.where(col_ok, col_r, 0)
        a_ptr, b_ptr = slice_pointers(slice_id, a0_ptr, a1_ptr, b0_ptr, b1_ptr)
        if not T_IN:
            a_cols = a_ptr + expert.to(tl.int64) * stride_ae + col_l.to(tl.int64) * stride_al + col_r * stride_ar
            t = tl.zeros((BM, BLOCK_LR), dtype=tl.float32)
    if HAS_LORA and T_IN:
        # the shrink came from HBM: expand before the K loop, where its loads overlap the pipeline's
        # first loads of x and W (after the loop nothing hides them: measured 7-12% slower on the H200)
        t = tl.load(t_ptr + slice_id * stride_ts + pairs.to(tl.int64)[:, None] * stride_tp
                    + col_r[None, :] * stride_tr, mask=hit & col_ok[None, :], other=0.0)
        acc = _expand(acc, t, hit, col_ok, col_l, col_r, b_ptr, expert, n_local, n_ok, stride_be, stride_bl,
                      stride_br, stride_bn, x_ptr.dtype.element_ty, DOT_PRECISION)
    w_row0 = expert * N + slice_id * n_slice + n0                                    # the tile's first W row
    if X_TAIL:
        x_off = x_rows.to(tl.int64) * stride_xm                                               # [BM]
        t_off = tail_off + slice_id.to(tl.int64) * stride_ts + pairs.to(tl.int64) * stride_tp   # [BM]
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        if X_TAIL:
            tail = k0 >= tail_at
            cols = tl.where(tail, ks - tail_at, ks)
            xk = tl.load(x_ptr + tl.where(tail, t_off, x_off)[:, None] + cols[None, :],
                         mask=valid[:, None] & (cols < tl.where(tail, K - tail_at, x_cols))[None, :], other=0.0)
        elif EVEN_K:
            xk = tl.load(x_base + ks[None, :] * stride_xk, mask=valid[:, None], other=0.0)
        else:
            xk = tl.load(x_base + ks[None, :] * stride_xk, mask=valid[:, None] & (ks < K)[None, :], other=0.0)
        if W_TMA:
            wk = w_desc.load([w_row0, k0]).T                                              # [BK, BN]
        elif EVEN_K:
            wk = tl.load(w_base + ks[:, None] * stride_wk, mask=n_ok[None, :], other=0.0)
        else:
            wk = tl.load(w_base + ks[:, None] * stride_wk, mask=n_ok[None, :] & (ks < K)[:, None], other=0.0)
        acc = tl.dot(xk, wk, acc, input_precision=DOT_PRECISION)                  # [BM, BK] @ [BK, BN]
        if HAS_LORA and not T_IN:
            if EVEN_K:
                ak = tl.load(a_cols[None, :] + ks[:, None] * stride_ak, mask=col_ok[None, :], other=0.0)
            else:
                ak = tl.load(a_cols[None, :] + ks[:, None] * stride_ak,
                             mask=col_ok[None, :] & (ks < K)[:, None], other=0.0)
            t = tl.dot(xk, ak, t, input_precision=DOT_PRECISION)                  # [BM, BK] @ [BK, LR]
    if HAS_LORA and not T_IN:
        acc = _expand(acc, t, hit, col_ok, col_l, col_r, b_ptr, expert, n_local, n_ok, stride_be, stride_bl,
                      stride_br, stride_bn, x_ptr.dtype.element_ty, DOT_PRECISION)
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def silu_and_mul_kernel(
    c1_ptr,            # [P, 2I] base gate | up, x's dtype
    delta_ptr,         # [P, 2I] LoRA delta, written only for pairs with an adapter (read if HAS_DELTA)
    token_lora_ptr,    # [M] int32, -1 = no adapter
    h_ptr,             # [P, I] activation out, x's dtype
    top_k, I, stride_c, stride_d, stride_h,
    BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr, DELTA_EARLY: tl.constexpr = False,
):
    """Program (pair, column tile): h = silu(gate + dg) * (up + du), the delta only where there is one.

    DELTA_EARLY (few pairs, where this kernel is latency): the delta row is loaded before the adapter id
    is known and dropped by a select where the pair has none: one round trip to memory, not two, for the
    price of reading rows never written. Otherwise the load is masked by the adapter: no such row is read."""
    pair = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    row = c1_ptr + pair.to(tl.int64) * stride_c
    gate = tl.load(row + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(row + I + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_DELTA:
        has = tl.load(token_lora_ptr + pair // top_k) >= 0
        drow = delta_ptr + pair.to(tl.int64) * stride_d
        if DELTA_EARLY:
            dg = tl.load(drow + cols, mask=ok, other=0.0)
            du = tl.load(drow + I + cols, mask=ok, other=0.0)
            gate += tl.where(has, dg.to(tl.float32), 0.0)
            up += tl.where(has, du.to(tl.float32), 0.0)
        else:
            gate += tl.load(drow + cols, mask=ok & has, other=0.0).to(tl.float32)
            up += tl.load(drow + I + cols, mask=ok & has, other=0.0).to(tl.float32)
    h = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(h_ptr + pair.to(tl.int64) * stride_h + cols, h.to(h_ptr.dtype.element_ty), mask=ok)


@triton.jit
def topk_sum_kernel(
    c3_ptr,            # [P, H] weighted base down projection of each pair
    delta_ptr,         # [P, H] weighted LoRA delta, written only for pairs with an adapter
    token_lora_ptr,    # [M] int32
    y_ptr,             # [M, H] output
    top_k, H, stride_c, stride_d, stride_y,
    BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr, BLOCK_J: tl.constexpr, ROWS_AS_TILE: tl.constexpr,
):
    """Program (token, column tile): y[t] = sum_j c3[t*k+j] (+ delta[t*k+j] if the token has an adapter).

    ROWS_AS_TILE (few pairs): the token's k rows are one axis of a [BLOCK_J, BLOCK] tile, so all their
    loads are in flight at once, and the delta, loaded before the adapter id is known, is dropped by a
    select where the token has none (rows never written are read, not used); a loop over the rows waits
    for each row before it asks for the next, and at a few tokens this kernel is that latency. Otherwise
    (many pairs, where the loop's programs hide each other's waits) a loop, the delta load masked by the
    adapter."""
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if ROWS_AS_TILE:
        offs_j = tl.arange(0, BLOCK_J)
        ok = (offs_j < top_k)[:, None] & (cols < H)[None, :]
        pairs = token.to(tl.int64) * top_k + offs_j
        rows = tl.load(c3_ptr + pairs[:, None] * stride_c + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        if HAS_DELTA:
            lora = tl.load(token_lora_ptr + token)
            d = tl.load(delta_ptr + pairs[:, None] * stride_d + cols[None, :], mask=ok, other=0.0)
            rows += tl.where(lora >= 0, d.to(tl.float32), 0.0)
        acc = tl.sum(rows, axis=0)
    else:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        if HAS_DELTA:
            has = tl.load(token_lora_ptr + token) >= 0
        for j in range(top_k):
            pair = (token * top_k + j).to(tl.int64)
            acc += tl.load(c3_ptr + pair * stride_c + cols, mask=cols < H, other=0.0).to(tl.float32)
            if HAS_DELTA:
                acc += tl.load(delta_ptr + pair * stride_d + cols, mask=(cols < H) & has, other=0.0).to(tl.float32)
    tl.store(y_ptr + token.to(tl.int64) * stride_y + cols, acc.to(y_ptr.dtype.element_ty), mask=cols < H)
