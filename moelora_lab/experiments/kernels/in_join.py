"""The LoRA inside the layer's two join kernels: the activation and the top-k sum (the ``in_join`` schedule).

Shape legend: M tokens, E experts, k top-k, L adapters, r rank (R = the weights' rank dim), H hidden,
I expert intermediate, P = M*k pairs, NT column tiles of the activation.

At a few pairs per expert the LoRA is all latency: its weights are a few MB, its FLOPs nothing, yet
two streams still pay an event join, a delta written and read back, and a w2 LoRA kernel that
must end before the top-k sum can start. Here the only LoRA launch is w13's shrink (T1 [2, P, r],
on the side stream beside the w13 GEMM); everything else rides on the kernels the layer runs anyway:

    act:  gate += B13g[l, e] T1g,  up += B13u[l, e] T1u,  h = silu(gate) * up,
          T2 partial[p, tile] = A2[l, e][:, tile] h[tile]        (one row of r per column tile)
    sum:  y[t] = sum_j c3[t*k + j] + w_j B2[l, e_j] (sum over tiles of T2 partial[t*k + j])

Both are per-pair matrix-vector products on the CUDA cores (no tensor-core tile fits one row), so
this suits small M; the pairs of one (adapter, expert) each read its B and A again (from L2).
"""
import triton
import triton.language as tl

from ...kernels.common import adapter_lanes


@triton.jit
def act_lora_kernel(
    c1_ptr,            # [P, 2I] base gate | up, x's dtype
    t1_ptr,            # [2, P, R] w13 shrink, x's dtype: written for pairs with an adapter, ranks < the slot's
    bg_ptr, bu_ptr,    # w13 LoRA B, gate and up slices: [L, E, I, R]
    a2_ptr,            # w2 LoRA A: [L, E, R, I]
    topk_ids_ptr,      # [P] expert of each pair (int32 or int64)
    token_lora_ptr,    # [M] int32, -1 = no adapter
    lora_ranks_ptr,    # [L] int32 actual rank of each slot (read if HAS_RANKS)
    h_ptr,             # [P, I] activation out, x's dtype
    t2_ptr,            # [P, NT, R] float32 partial w2 shrink: written for pairs with an adapter, ranks < the slot's
    top_k, I, R,
    stride_c, stride_ts, stride_tp, stride_bl, stride_be, stride_bn, stride_br,
    stride_al, stride_ae, stride_ar, stride_ak, stride_h, stride_2p, stride_2t,
    BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, HAS_RANKS: tl.constexpr,
):
    """Program (pair, column tile): h = silu(gate + dg) * (up + du) and this tile's share of T2."""
    pair = tl.program_id(0)
    tile = tl.program_id(1)
    cols = tile * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    # A warp stalls only at a load's first use, and nothing LoRA can be read before the adapter id and
    # the expert are known: so every load that does not need them is issued first, with no use in between
    # (two round trips to memory, not one per line); what the shrink did not write drops out below.
    lora = tl.load(token_lora_ptr + pair // top_k)
    expert = tl.load(topk_ids_ptr + pair)
    row = c1_ptr + pair.to(tl.int64) * stride_c
    gate = tl.load(row + cols, mask=ok, other=0.0)
    up = tl.load(row + I + cols, mask=ok, other=0.0)
    offs_r = tl.arange(0, BLOCK_R)
    t_row = t1_ptr + pair.to(tl.int64) * stride_tp + offs_r
    tg = tl.load(t_row, mask=offs_r < R, other=0.0)                      # the pair's row of T1, both slices
    tu = tl.load(t_row + stride_ts, mask=offs_r < R, other=0.0)
    lora, r_ok = adapter_lanes(lora_ranks_ptr, lora, offs_r, R, HAS_RANKS)
    w_off = lora.to(tl.int64) * stride_bl + expert.to(tl.int64) * stride_be
    b_off = w_off + cols[:, None] * stride_bn + offs_r[None, :] * stride_br                   # [BLOCK, BLOCK_R]
    b_ok = ok[:, None] & r_ok[None, :]
    bg = tl.load(bg_ptr + b_off, mask=b_ok, other=0.0)
    bu = tl.load(bu_ptr + b_off, mask=b_ok, other=0.0)
    a_off = (lora.to(tl.int64) * stride_al + expert.to(tl.int64) * stride_ae + offs_r[:, None] * stride_ar
             + cols[None, :] * stride_ak)
    a2 = tl.load(a2_ptr + a_off, mask=r_ok[:, None] & ok[None, :], other=0.0)                # [BLOCK_R, BLOCK]
    # the expand of w13, then the activation
    tg = tl.where(r_ok, tg.to(tl.float32), 0.0)
    tu = tl.where(r_ok, tu.to(tl.float32), 0.0)
    gate = gate.to(tl.float32) + tl.sum(bg.to(tl.float32) * tg[None, :], axis=1)
    up = up.to(tl.float32) + tl.sum(bu.to(tl.float32) * tu[None, :], axis=1)
    h = (gate / (1.0 + tl.exp(-gate)) * up).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + pair.to(tl.int64) * stride_h + cols, h, mask=ok)
    # the shrink of w2 over this tile's columns, from h as the w2 GEMM reads it (rounded to x's dtype)
    part = tl.sum(a2.to(tl.float32) * h.to(tl.float32)[None, :], axis=1)                      # [BLOCK_R]
    tl.store(t2_ptr + pair.to(tl.int64) * stride_2p + tile * stride_2t + offs_r, part, mask=r_ok)


@triton.jit
def sum_lora_kernel(
    c3_ptr,            # [P, H] weighted base down projection of each pair, x's dtype
    t2_ptr,            # [P, NT, R] float32 partial w2 shrink (act_lora_kernel)
    b2_ptr,            # w2 LoRA B: [L, E, H, R]
    topk_ids_ptr,      # [P] expert of each pair
    weights_ptr,       # [P] float32 routing weight of each pair
    token_lora_ptr,    # [M] int32, -1 = no adapter
    lora_ranks_ptr,    # [L] int32 (read if HAS_RANKS)
    y_ptr,             # [M, H] output, x's dtype
    H, R, NT,
    stride_c, stride_2p, stride_2t, stride_bl, stride_be, stride_bn, stride_br, stride_y,
    TOP_K: tl.constexpr, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr,
    BLOCK_T: tl.constexpr, HAS_RANKS: tl.constexpr,
):
    """Program (token, column tile): y[t] = sum_j c3[t*k+j] + w_j B2[l, e_j] T2[t*k+j] where the token has an adapter.

    At a few tokens this kernel is latency, not bytes: a warp stalls at the first use of a load, so
    the k pairs are one axis of every tile ([BLOCK_J, ...]) and all their loads are issued together;
    only B2's address waits, for the adapter and the experts."""
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    offs_j = tl.arange(0, BLOCK_J)
    j_ok = offs_j < TOP_K
    pairs = token.to(tl.int64) * TOP_K + offs_j
    lora = tl.load(token_lora_ptr + token)
    experts = tl.load(topk_ids_ptr + pairs, mask=j_ok, other=0).to(tl.int64)
    w = tl.load(weights_ptr + pairs, mask=j_ok, other=0.0)
    c3 = tl.load(c3_ptr + pairs[:, None] * stride_c + cols[None, :], mask=j_ok[:, None] & ok[None, :], other=0.0)
    offs_r = tl.arange(0, BLOCK_R)
    offs_t = tl.arange(0, BLOCK_T)
    lora, r_ok = adapter_lanes(lora_ranks_ptr, lora, offs_r, R, HAS_RANKS)
    t = tl.zeros((BLOCK_J, BLOCK_R), dtype=tl.float32)
    for t0 in range(0, NT, BLOCK_T):            # one step unless the act ran more than BLOCK_T column tiles
        tt = t0 + offs_t
        # only what the act wrote: a token with an adapter, ranks below its slot's (the rest is uninitialised)
        parts = tl.load(t2_ptr + pairs[:, None, None] * stride_2p + tt[None, :, None] * stride_2t
                        + offs_r[None, None, :],
                        mask=j_ok[:, None, None] & (tt < NT)[None, :, None] & r_ok[None, None, :], other=0.0)
        t += tl.sum(parts, axis=1)                                                   # [BLOCK_J, BLOCK_R]
    acc = tl.sum(c3.to(tl.float32), axis=0)
    t = tl.where(j_ok[:, None] & r_ok[None, :], t * w[:, None], 0.0)         # rows the act never wrote drop out
    b = tl.load(b2_ptr + lora.to(tl.int64) * stride_bl + experts[:, None, None] * stride_be
                + cols[None, :, None] * stride_bn + offs_r[None, None, :] * stride_br,
                mask=j_ok[:, None, None] & ok[None, :, None] & r_ok[None, None, :], other=0.0)  # [J, BLOCK, R]
    acc += tl.sum(tl.sum(b.to(tl.float32) * t[:, None, :], axis=2), axis=0)
    tl.store(y_ptr + token.to(tl.int64) * stride_y + cols, acc.to(y_ptr.dtype.element_ty), mask=ok)
