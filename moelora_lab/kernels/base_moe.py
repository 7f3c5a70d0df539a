"""The base MoE layer's kernels: grouped GEMM over expert-sorted blocks, activation, top-k sum.

Shape legend: M tokens, k top-k, E experts, K in, N out, H hidden, I expert intermediate,
S slices, P = M*k pairs, BM = BLOCK_M pairs per block, BN = BLOCK_N, BK = BLOCK_K, B blocks.

The grouped GEMM's pieces (``half_tile``, ``tile_operands``, ``x_tile``, ``w_tile``, ``store_tile``) are
also those of the experiments' GEMM that carries the LoRA inside (``experiments/kernels/in_gemm``).

The activation and the top-k sum are where the dual-stream layer joins the LoRA stream: they read
the LoRA delta only for pairs whose token has an adapter (HAS_DELTA), so the delta buffers need no
zero-fill and no separate add pass.
"""
import triton
import triton.language as tl

from .common import gemm_tile, rows_at


@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def moe_gemm_kernel(
    # pointers
    x_ptr,             # [M, K] (TOKEN_ROWS) or [P, K]; fp32/fp16/bf16
    w_ptr,             # [E, N, K] expert weights, x's dtype
    w_desc,            # TMA descriptor of W viewed [E*N, K], box [BN, BK] (read if W_TMA)
    out_ptr,           # [P, N] one row per pair, x's dtype
    topk_weights_ptr,  # [P] fp32 (read if MUL_ROUTED_WEIGHT)
    sorted_pairs_ptr,  # [B*BM] int32 pairs grouped by expert, sentinel P
    block_expert_ptr,  # [B] int32 expert of each block, -1 = unused
    # sizes
    num_pairs, top_k, K, N, num_blocks,
    n_slice,           # columns per slice: N, or N / S with an x tail of S slices
    x_cols,            # X_TAIL: x's own columns (<= tail_at); K - tail_at tail columns follow
    tail_at,           # X_TAIL: the K step where the tail starts (a multiple of BK)
    tail_off,          # X_TAIL: the tail T [S, P, K - tail_at] as an element offset from x_ptr (unit column stride)
    # strides
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    stride_ts, stride_tp,             # X_TAIL: T's slice and pair strides
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TOKEN_ROWS: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    W_TMA: tl.constexpr,              # W tiles through the tensor memory accelerator (Hopper and later)
    X_TAIL: tl.constexpr = False,     # K steps from tail_at on read the pair's row of T (LoRA in K), not x
    HALF_TAIL: tl.constexpr = False,  # a block whose second half is padding runs a BM / 2 tile
):
    """Program (block, N tile): out[rows, n-tile] = (w *) X[rows] @ W[e, n-tile]^T.

    Programs are numbered GROUP_M blocks at a time, N tiles inside a group, so neighbours in time
    share x rows through L2. With W_TMA the W tile is one bulk copy of BN rows of the [E*N, K] view
    (rows past the tile's N are read but never stored; rows and columns past the tensor arrive as
    zeros). With X_TAIL, x is widened by each pair's own row of T: one K loop whose steps past tail_at
    read T (pair rows) instead of x (token rows), by switching the rows' offsets, so the LoRA rides the
    same pipeline (x's columns unit-strided). With HALF_TAIL, the last block of an expert whose pairs
    end in its first half (its slot BM / 2 holds the sentinel: a group's pairs fill its blocks from the
    front) multiplies a tile of half the rows, so the padding rows an expert's last block computes are
    at most BM / 2 - 1, not BM - 1.
    """
    block, slice_id, n0 = gemm_tile(tl.program_id(0), N, n_slice, num_blocks, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    start = block * BLOCK_M
    if half_tile(sorted_pairs_ptr, start, num_pairs, BLOCK_M, HALF_TAIL):
        _block_tile(start, expert, slice_id, n0, x_ptr, w_ptr, w_desc, out_ptr, topk_weights_ptr, sorted_pairs_ptr,
                    num_pairs, top_k, K, N, n_slice, x_cols, tail_at, tail_off, stride_xm, stride_xk, stride_we,
                    stride_wn, stride_wk, stride_om, stride_on, stride_ts, stride_tp, BLOCK_M // 2, BLOCK_N, BLOCK_K,
                    TOKEN_ROWS, MUL_ROUTED_WEIGHT, EVEN_K, DOT_PRECISION, W_TMA, X_TAIL)
    else:
        _block_tile(start, expert, slice_id, n0, x_ptr, w_ptr, w_desc, out_ptr, topk_weights_ptr, sorted_pairs_ptr,
                    num_pairs, top_k, K, N, n_slice, x_cols, tail_at, tail_off, stride_xm, stride_xk, stride_we,
                    stride_wn, stride_wk, stride_om, stride_on, stride_ts, stride_tp, BLOCK_M, BLOCK_N, BLOCK_K,
                    TOKEN_ROWS, MUL_ROUTED_WEIGHT, EVEN_K, DOT_PRECISION, W_TMA, X_TAIL)


@triton.jit
def _block_tile(start, expert, slice_id, n0, x_ptr, w_ptr, w_desc, out_ptr, topk_weights_ptr, sorted_pairs_ptr,
                num_pairs, top_k, K, N, n_slice, x_cols, tail_at, tail_off, stride_xm, stride_xk, stride_we,
                stride_wn, stride_wk, stride_om, stride_on, stride_ts, stride_tp,
                BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TOKEN_ROWS: tl.constexpr,
                MUL_ROUTED_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                W_TMA: tl.constexpr, X_TAIL: tl.constexpr):
    """One output tile of ``moe_gemm_kernel``: the BM pairs from slot ``start`` of ``expert``'s blocks."""
    pairs, valid, x_rows, n_local, n_ok, offs_n, offs_k, x_base, w_base, w_row0 = tile_operands(
        start, expert, slice_id, n0, x_ptr, w_ptr, sorted_pairs_ptr, num_pairs, top_k, N, n_slice, stride_xm,
        stride_we, stride_wn, BM, BLOCK_N, BLOCK_K, TOKEN_ROWS)
    acc = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
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
        else:
            xk = x_tile(x_base, ks, valid, K, stride_xk, EVEN_K)
        wk = w_tile(w_base, w_desc, w_row0, k0, ks, n_ok, K, stride_wk, EVEN_K, W_TMA)
        acc = tl.dot(xk, wk, acc, input_precision=DOT_PRECISION)                  # [BM, BK] @ [BK, BN]
    store_tile(acc, pairs, valid, offs_n, n_ok, out_ptr, topk_weights_ptr, stride_om, stride_on, MUL_ROUTED_WEIGHT)


@triton.jit
def half_tile(sorted_pairs_ptr, start, num_pairs, BLOCK_M: tl.constexpr, HALF_TAIL: tl.constexpr):
    """Whether the block from slot ``start`` runs a tile of BLOCK_M / 2 rows: with HALF_TAIL, where its pairs
    end in its first half (its slot BLOCK_M / 2 holds the sentinel); without, the constant False."""
    half = False
    if HALF_TAIL:
        half = tl.load(sorted_pairs_ptr + start + BLOCK_M // 2) >= num_pairs
    return half


@triton.jit
def tile_operands(start, expert, slice_id, n0, x_ptr, w_ptr, sorted_pairs_ptr, num_pairs, top_k, N, n_slice,
                  stride_xm, stride_we, stride_wn, BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  TOKEN_ROWS: tl.constexpr):
    """The rows and columns of the output tile of BM pairs from slot ``start`` and N tile ``n0`` of slice
    ``slice_id``, and where its loads start: (pairs [BM], valid [BM], x_rows [BM], n_local [BN] (columns
    in the slice), n_ok [BN], offs_n [BN] (columns of out), offs_k [BK], x_base [BM, 1] and w_base [1, BN]
    (pointers), w_row0 (the tile's first row of W viewed [E*N, K]))."""
    pairs, valid, x_rows = rows_at(sorted_pairs_ptr, start, num_pairs, top_k, BM, TOKEN_ROWS)
    n_local = n0 + tl.arange(0, BLOCK_N)
    n_ok = n_local < n_slice
    offs_n = slice_id * n_slice + n_local
    offs_k = tl.arange(0, BLOCK_K)
    x_base = x_ptr + x_rows.to(tl.int64)[:, None] * stride_xm
    w_base = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
    w_row0 = expert * N + slice_id * n_slice + n0
    return pairs, valid, x_rows, n_local, n_ok, offs_n, offs_k, x_base, w_base, w_row0


@triton.jit
def x_tile(x_base, ks, valid, K, stride_xk, EVEN_K: tl.constexpr):
    """The [BM, BK] tile of x at columns ``ks``: zeros in rows past the block's pairs and columns past K."""
    if EVEN_K:
        xk = tl.load(x_base + ks[None, :] * stride_xk, mask=valid[:, None], other=0.0)
    else:
        xk = tl.load(x_base + ks[None, :] * stride_xk, mask=valid[:, None] & (ks < K)[None, :], other=0.0)
    return xk


@triton.jit
def w_tile(w_base, w_desc, w_row0, k0, ks, n_ok, K, stride_wk, EVEN_K: tl.constexpr, W_TMA: tl.constexpr):
    """The [BK, BN] tile of W^T at columns ``ks`` (from ``k0``): by TMA, or by pointer with zeros past the
    slice's columns and past K."""
    if W_TMA:
        wk = w_desc.load([w_row0, k0]).T
    elif EVEN_K:
        wk = tl.load(w_base + ks[:, None] * stride_wk, mask=n_ok[None, :], other=0.0)
    else:
        wk = tl.load(w_base + ks[:, None] * stride_wk, mask=n_ok[None, :] & (ks < K)[:, None], other=0.0)
    return wk


@triton.jit
def store_tile(acc, pairs, valid, offs_n, n_ok, out_ptr, topk_weights_ptr, stride_om, stride_on,
               MUL_ROUTED_WEIGHT: tl.constexpr):
    """out[pairs, offs_n] = acc [BM, BN] (times each pair's routing weight with MUL_ROUTED_WEIGHT), in out's
    dtype; rows past the block's pairs and columns past the slice are not stored."""
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
