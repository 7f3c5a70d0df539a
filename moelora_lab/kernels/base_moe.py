"""The base MoE layer's kernels: grouped GEMM over expert-sorted blocks, activation, top-k sum.

Shape legend: M tokens, k top-k, E experts, K in, N out, H hidden, I expert intermediate,
P = M*k pairs, BM = BLOCK_M pairs per block, B blocks.

The activation and the top-k sum are where the dual-stream layer joins the LoRA stream: they read
the LoRA delta only for pairs whose token has an adapter (HAS_DELTA), so the delta buffers need no
zero-fill and no separate add pass.
"""
import triton
import triton.language as tl

from .common import block_rows


@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def moe_gemm_kernel(
    x_ptr,             # [M, K] (TOKEN_ROWS) or [P, K]; fp32/fp16/bf16
    w_ptr,             # [E, N, K] expert weights, x's dtype
    out_ptr,           # [P, N] one row per pair, x's dtype
    topk_weights_ptr,  # [P] fp32 (read if MUL_ROUTED_WEIGHT)
    sorted_pairs_ptr,  # [B*BM] int32 pairs grouped by expert, sentinel P
    block_expert_ptr,  # [B] int32 expert of each block, -1 = unused
    num_pairs, top_k, K, N,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    TOKEN_ROWS: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (block, N tile): out[rows, n-tile] = (w *) X[rows] @ W[expert, n-tile, :]^T."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    pairs, valid, x_rows = block_rows(sorted_pairs_ptr, block, num_pairs, top_k, BLOCK_M, TOKEN_ROWS)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_base = x_ptr + x_rows.to(tl.int64)[:, None] * stride_xm
    w_base = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        if EVEN_K:
            xk = tl.load(x_base + ks[None, :] * stride_xk, mask=valid[:, None], other=0.0)
            wk = tl.load(w_base + ks[:, None] * stride_wk, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = ks < K
            xk = tl.load(x_base + ks[None, :] * stride_xk, mask=valid[:, None] & k_ok[None, :], other=0.0)
            wk = tl.load(w_base + ks[:, None] * stride_wk, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(xk, wk, acc, input_precision=DOT_PRECISION)                  # [BM, BK] @ [BK, BN]
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
    BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr,
):
    """Program (pair, column tile): h = silu(gate + dg) * (up + du), the delta only where there is one."""
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
    h = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(h_ptr + pair.to(tl.int64) * stride_h + cols, h.to(h_ptr.dtype.element_ty), mask=ok)


@triton.jit
def topk_sum_kernel(
    c3_ptr,            # [P, H] weighted base down projection of each pair
    delta_ptr,         # [P, H] weighted LoRA delta, written only for pairs with an adapter
    token_lora_ptr,    # [M] int32
    y_ptr,             # [M, H] output
    top_k, H, stride_c, stride_d, stride_y,
    BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr,
):
    """Program (token, column tile): y[t] = sum_j c3[t*k+j] (+ delta[t*k+j] if the token has an adapter)."""
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    if HAS_DELTA:
        has = tl.load(token_lora_ptr + token) >= 0
    for j in range(top_k):
        pair = (token * top_k + j).to(tl.int64)
        acc += tl.load(c3_ptr + pair * stride_c + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_DELTA:
            acc += tl.load(delta_ptr + pair * stride_d + cols, mask=ok & has, other=0.0).to(tl.float32)
    tl.store(y_ptr + token.to(tl.int64) * stride_y + cols, acc.to(y_ptr.dtype.element_ty), mask=ok)
