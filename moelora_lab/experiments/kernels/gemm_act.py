"""The w13 grouped GEMM with the activation in its epilogue: the kernel of the ``in_k_act`` schedule.

Shape legend: M tokens, k top-k, E experts, K in, I expert intermediate (w13 has N = 2I rows: gate | up),
S = 2 slices, C tail columns, P = M*k pairs, BM = BLOCK_M pairs per block, BN = BLOCK_N, BK = BLOCK_K,
B blocks.

The base layer writes c1 [P, 2I] from the w13 GEMM and reads it back in the activation: 2 * P * 2I
elements through memory and one more launch. Here one program owns the same BN columns of the gate and
of the up half, multiplies them from one x tile (two dots, two accumulators) and stores
h = silu(gate) * up [P, I] straight from registers: c1 never exists. With X_TAIL (the LoRA in K), the
K steps past ``tail_at`` read the pair's row of its slice's tail T [S, P, C] instead of x, gate from
slice 0 and up from slice 1, in a second loop after x's.

Bit for bit what the separate kernels compute: each accumulator is rounded to h's dtype (as c1 stores
it) before the activation, which then runs the same float32 arithmetic as ``silu_and_mul_kernel``.
"""
import triton
import triton.language as tl

from ...kernels.base_moe import half_tile, w_tile
from ...kernels.common import gemm_tile, rows_at


@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0,
                    "EVEN_X": lambda args: args["x_cols"] % args["BLOCK_K"] == 0})
@triton.jit
def gemm_act_kernel(
    # pointers
    x_ptr,             # [M, x_cols] token rows (TOKEN_ROWS) or [P, x_cols]; fp32/fp16/bf16
    w_ptr,             # [E, 2I, K] expert weights (gate rows, then up rows), x's dtype
    w_desc,            # TMA descriptor of W viewed [E*2I, K], box [BN, BK] (read if W_TMA)
    h_ptr,             # [P, I] activation out, x's dtype
    sorted_pairs_ptr,  # [B*BM] int32 pairs grouped by expert, sentinel P
    block_expert_ptr,  # [B] int32 expert of each block, -1 = unused
    # sizes
    num_pairs, top_k, K, I, num_blocks,
    x_cols,            # x's columns (<= tail_at; the K steps from x_cols to tail_at multiply zeros and are skipped)
    tail_at,           # the K step where the tail starts (a multiple of BK; K without X_TAIL)
    tail_off,          # X_TAIL: the tail T [2, P, K - tail_at] as an element offset from x_ptr (unit column stride)
    # strides
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_hm, stride_hn,
    stride_ts, stride_tp,             # X_TAIL: T's slice and pair strides
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TOKEN_ROWS: tl.constexpr, EVEN_K: tl.constexpr, EVEN_X: tl.constexpr, DOT_PRECISION: tl.constexpr,
    W_TMA: tl.constexpr, X_TAIL: tl.constexpr, HALF_TAIL: tl.constexpr,
):
    """Program (block, N tile of I): h[rows, n-tile] = silu(X[rows] @ W[e, n-tile]^T) * (X[rows] @ W[e, I + n-tile]^T).
    With HALF_TAIL, a block whose second half is padding runs a tile of BM / 2 rows (as the base GEMM does)."""
    block, _, n0 = gemm_tile(tl.program_id(0), I, I, num_blocks, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    start = block * BLOCK_M
    if half_tile(sorted_pairs_ptr, start, num_pairs, BLOCK_M, HALF_TAIL):
        _act_tile(start, expert, n0, x_ptr, w_ptr, w_desc, h_ptr, sorted_pairs_ptr, num_pairs, top_k, K, I, x_cols,
                  tail_at, tail_off, stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_hm, stride_hn,
                  stride_ts, stride_tp, BLOCK_M // 2, BLOCK_N, BLOCK_K, TOKEN_ROWS, EVEN_K, EVEN_X, DOT_PRECISION,
                  W_TMA, X_TAIL)
    else:
        _act_tile(start, expert, n0, x_ptr, w_ptr, w_desc, h_ptr, sorted_pairs_ptr, num_pairs, top_k, K, I, x_cols,
                  tail_at, tail_off, stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_hm, stride_hn,
                  stride_ts, stride_tp, BLOCK_M, BLOCK_N, BLOCK_K, TOKEN_ROWS, EVEN_K, EVEN_X, DOT_PRECISION,
                  W_TMA, X_TAIL)


@triton.jit
def _act_tile(start, expert, n0, x_ptr, w_ptr, w_desc, h_ptr, sorted_pairs_ptr, num_pairs, top_k, K, I, x_cols,
              tail_at, tail_off, stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_hm, stride_hn,
              stride_ts, stride_tp, BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              TOKEN_ROWS: tl.constexpr, EVEN_K: tl.constexpr, EVEN_X: tl.constexpr, DOT_PRECISION: tl.constexpr,
              W_TMA: tl.constexpr, X_TAIL: tl.constexpr):
    """One tile of ``gemm_act_kernel``: the BM pairs from slot ``start`` of ``expert``'s blocks, columns n0 .. n0+BN."""
    pairs, valid, x_rows = rows_at(sorted_pairs_ptr, start, num_pairs, top_k, BM, TOKEN_ROWS)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    w_gate = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn          # [1, BN]
    w_up = w_gate + I * stride_wn
    row_gate = expert * 2 * I + n0                    # the tiles' first rows of W viewed [E*2I, K]
    row_up = row_gate + I
    x_base = x_ptr + x_rows.to(tl.int64)[:, None] * stride_xm                                 # [BM, 1]
    acc_g = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
    # x's own columns (W's columns from x_cols to tail_at are the pack's zeros: skipped, and x is never read
    # past its columns): one x tile feeds both halves
    for k0 in range(0, x_cols, BLOCK_K):
        ks = k0 + offs_k
        if EVEN_X:
            xk = tl.load(x_base + ks[None, :] * stride_xk, mask=valid[:, None], other=0.0)
        else:
            xk = tl.load(x_base + ks[None, :] * stride_xk, mask=valid[:, None] & (ks < x_cols)[None, :], other=0.0)
        wg = w_tile(w_gate, w_desc, row_gate, k0, ks, n_ok, K, stride_wk, EVEN_K, W_TMA)
        wu = w_tile(w_up, w_desc, row_up, k0, ks, n_ok, K, stride_wk, EVEN_K, W_TMA)
        acc_g = tl.dot(xk, wg, acc_g, input_precision=DOT_PRECISION)                        # [BM, BK] @ [BK, BN]
        acc_u = tl.dot(xk, wu, acc_u, input_precision=DOT_PRECISION)
    if X_TAIL:                                        # the tail's columns: each half reads its slice's row
        t_off = tail_off + pairs.to(tl.int64) * stride_tp        # [BM] element offsets from x_ptr, in int64
        t_gate = x_ptr + t_off[:, None]                                                      # [BM, 1]
        t_up = x_ptr + (t_off + stride_ts)[:, None]
        for k0 in range(tail_at, K, BLOCK_K):
            ks = k0 + offs_k
            cols = ks - tail_at
            m = valid[:, None] & (cols < K - tail_at)[None, :]
            tg = tl.load(t_gate + cols[None, :], mask=m, other=0.0)
            tu = tl.load(t_up + cols[None, :], mask=m, other=0.0)
            wg = w_tile(w_gate, w_desc, row_gate, k0, ks, n_ok, K, stride_wk, EVEN_K, W_TMA)
            wu = w_tile(w_up, w_desc, row_up, k0, ks, n_ok, K, stride_wk, EVEN_K, W_TMA)
            acc_g = tl.dot(tg, wg, acc_g, input_precision=DOT_PRECISION)
            acc_u = tl.dot(tu, wu, acc_u, input_precision=DOT_PRECISION)
    dtype = h_ptr.dtype.element_ty
    gate = acc_g.to(dtype).to(tl.float32)             # as c1 would hold them
    up = acc_u.to(dtype).to(tl.float32)
    h = gate / (1.0 + tl.exp(-gate)) * up
    out = h_ptr + pairs.to(tl.int64)[:, None] * stride_hm + offs_n[None, :] * stride_hn
    tl.store(out, h.to(dtype), mask=valid[:, None] & n_ok[None, :])
