"""LoRA in K with the shrink beside its GEMM: one launch whose first programs shrink and whose later
programs multiply, waiting for the shrink only before their tail K steps.

Shape legend: M tokens, k top-k, E experts, L adapters, r rank, K in, N out, S slices,
P = M*k pairs, BM = BLOCK_M pairs per block, B blocks.

``layer_in_k`` runs each LoRA op as two launches in series: ``shrink_tail_kernel`` writes the tail
T (each pair's A x, in its adapter's columns, zeros elsewhere), then the grouped GEMM reads T in its
last K steps. The GEMM's base K steps (all of x, all of W's own columns) do not need T, yet wait for
the whole shrink. Here both are programs of one grid. Each program draws a ticket from a counter:
tickets below ``num_shrink`` do the work of one shrink program and then count themselves done
(release), the others are GEMM tiles that run their base K steps, wait until every shrink program is
done (acquire), then run their tail K steps. The ticket, not the program id, decides the work: a
GEMM program that waits exists only after every shrink program was handed out to a running program,
and shrink programs wait on nothing, so the wait always ends (no assumption on the order in which
the hardware starts programs). Should the counts ever disagree, a tile stops waiting after MAX_SPINS
reads and writes NaN, which every check of the output catches, rather than hang the GPU.

Measured on the H200 (``bench in_k``, data/h200/layer_in_k.csv), it loses to the two launches in series
from M = 512 on: one launch has one set of resources, so every shrink program reserves the GEMM's
pipeline buffers (at large M about 192 KiB of shared memory, one program per SM, where the shrink alone
runs six or more per SM) and the shrink, bound by the latency of its row gathers, runs slower; its
programs hold the SMs first and the GEMM tiles follow, so nothing overlaps. Kept as the measured
experiment appendix A1 (section 7) reads, not used by any schedule.
"""
import triton
import triton.language as tl

from ...kernels.common import block_rows, gemm_tile
from ...kernels.in_k import _shrink_tail_program


@triton.jit
def _gemm_tail_program(pid, x_ptr, w_ptr, w_desc, out_ptr, topk_weights_ptr, sorted_pairs_ptr, block_expert_ptr,
                       done_ptr, num_shrink, num_pairs, top_k, N, num_blocks, n_slice, x_cols, tail_at, tail_cols,
                       tail_off, stride_xm, stride_we, stride_wn, stride_om, stride_ts, stride_tp,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       TOKEN_ROWS: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, W_TMA: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, MAX_SPINS: tl.constexpr):
    """GEMM tile ``pid`` (numbered as ``moe_gemm_kernel``'s programs): x's K steps, the wait, T's K steps."""
    block, slice_id, n0 = gemm_tile(pid, N, n_slice, num_blocks, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + block)
    if expert >= 0:
        pairs, valid, x_rows = block_rows(sorted_pairs_ptr, block, num_pairs, top_k, BLOCK_M, TOKEN_ROWS)
        n_local = n0 + tl.arange(0, BLOCK_N)
        n_ok = n_local < n_slice
        offs_n = slice_id * n_slice + n_local
        offs_k = tl.arange(0, BLOCK_K)
        w_base = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
        w_row0 = expert * N + slice_id * n_slice + n0
        x_off = x_rows.to(tl.int64)[:, None] * stride_xm
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, x_cols, BLOCK_K):                       # x's own columns: no wait
            ks = k0 + offs_k
            k_ok = ks < x_cols
            xk = tl.load(x_ptr + x_off + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            if W_TMA:
                wk = w_desc.load([w_row0, k0]).T                  # columns past x's meet zeros of xk
            else:
                wk = tl.load(w_base + ks[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            acc = tl.dot(xk, wk, acc, input_precision=DOT_PRECISION)
        done = tl.atomic_add(done_ptr, 0, sem="acquire")
        spins = 0
        while (done < num_shrink) & (spins < MAX_SPINS):          # every shrink program has written its part
            done = tl.atomic_add(done_ptr, 0, sem="acquire")
            spins += 1
        tl.debug_barrier()
        if done < num_shrink:          # never reached when the counts are right: a NaN tile, not a hung GPU
            acc += float("nan")
        t_off = tail_off + slice_id.to(tl.int64) * stride_ts + pairs.to(tl.int64)[:, None] * stride_tp
        for c0 in range(0, tail_cols, BLOCK_K):                    # the pair's own row of T
            cs = c0 + offs_k
            c_ok = cs < tail_cols
            tk = tl.load(x_ptr + t_off + cs[None, :], mask=valid[:, None] & c_ok[None, :], other=0.0)
            if W_TMA:
                wk = w_desc.load([w_row0, tail_at + c0]).T
            else:
                wk = tl.load(w_base + (tail_at + cs)[:, None], mask=n_ok[None, :] & c_ok[:, None], other=0.0)
            acc = tl.dot(tk, wk, acc, input_precision=DOT_PRECISION)
        if MUL_ROUTED_WEIGHT:
            acc = acc * tl.load(topk_weights_ptr + pairs, mask=valid, other=0.0)[:, None]
        out = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def gemm_after_shrink_kernel(
    counters_ptr,      # [2] int32, zero before the launch: tickets handed out, shrink programs done
    num_shrink,        # shrink programs: (lora blocks + fill programs) * shrink_columns
    shrink_columns,    # the shrink grid's second dimension (slices * rank tiles, or rank tiles)
    # the shrink (``kernels/in_k.shrink_tail_kernel``'s arguments, s_ where the GEMM has its own)
    h_ptr,             # [P, >= K] (w2: h_ext) or [M, K] (S_TOKEN_ROWS: w13's x), x's dtype
    a0_ptr, a1_ptr,    # LoRA A of slices 0 and 1: [L, E, r, K], x's dtype; slice 0 twice if S == 1
    tail_ptr,          # [S, P, L*r] the tail T, x's dtype; every element written
    s_sorted_pairs_ptr, s_block_lora_ptr, s_block_expert_ptr,   # by (adapter, expert): [B*BM], [B], [B] int32
    token_lora_ptr,    # [M] int32 adapter of each token, -1 = none
    lora_ranks_ptr,    # [L] int32 actual rank of each slot (read if HAS_RANKS)
    s_num_pairs, s_num_blocks, s_top_k, K, R, LR, rank_tiles, stride_hm, stride_al, stride_ae,
    stride_ar, stride_ak, stride_tm, stride_ts,
    # the GEMM (``moe_gemm_kernel``'s, X_TAIL only):
    #   out[p] = (w *) (x_row(p) @ W[e, :, :x_cols]^T + T[s, p] @ W[e, :, tail_at:]^T)
    x_ptr,             # [M, >= x_cols] token rows (TOKEN_ROWS) or [P, >= x_cols], unit column stride
    w_ptr, w_desc,     # [E, N, tail_at + tail_cols] widened weight (unit column stride); its TMA descriptor
    out_ptr,           # [P, N], x's dtype
    topk_weights_ptr,  # [P] fp32 (read if MUL_ROUTED_WEIGHT)
    sorted_pairs_ptr, block_expert_ptr,                    # BlockList by expert: [B*BM], [B] int32
    num_pairs, top_k, N, num_blocks, n_slice, x_cols, tail_at, tail_cols,
    tail_off,          # T [S, P, tail_cols] (= tail_ptr) as an element offset from x_ptr
    stride_xm, stride_we, stride_wn, stride_om, stride_gts, stride_gtp,
    S_BLOCK_M: tl.constexpr, S_BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_LR: tl.constexpr,
    FILL_ROWS: tl.constexpr, HAS_RANKS: tl.constexpr, S_TOKEN_ROWS: tl.constexpr, BOTH_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TOKEN_ROWS: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, W_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
    MAX_SPINS: tl.constexpr = 1 << 22,   # reads of the done counter before a tile gives up (NaN), about seconds
):
    """Program with ticket t: shrink program (t // shrink_columns, t % shrink_columns) for t < num_shrink,
    else GEMM tile t - num_shrink."""
    ticket = tl.atomic_add(counters_ptr, 1)
    if ticket < num_shrink:
        _shrink_tail_program(ticket // shrink_columns, ticket % shrink_columns, h_ptr, a0_ptr, a1_ptr, tail_ptr,
                             s_sorted_pairs_ptr, s_block_lora_ptr, s_block_expert_ptr, token_lora_ptr, lora_ranks_ptr,
                             s_num_pairs, s_num_blocks, s_top_k, K, R, LR, rank_tiles, stride_hm, stride_al, stride_ae,
                             stride_ar, stride_ak, stride_tm, stride_ts, S_BLOCK_M, S_BLOCK_K, BLOCK_R, BLOCK_LR,
                             FILL_ROWS, DOT_PRECISION, HAS_RANKS, S_TOKEN_ROWS, BOTH_SLICES)
        tl.debug_barrier()                                 # every thread's stores, then one release
        tl.atomic_add(counters_ptr + 1, 1, sem="release")
    else:
        _gemm_tail_program(ticket - num_shrink, x_ptr, w_ptr, w_desc, out_ptr, topk_weights_ptr, sorted_pairs_ptr,
                           block_expert_ptr, counters_ptr + 1, num_shrink, num_pairs, top_k, N, num_blocks, n_slice,
                           x_cols, tail_at, tail_cols, tail_off, stride_xm, stride_we, stride_wn, stride_om,
                           stride_gts, stride_gtp, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, TOKEN_ROWS, MUL_ROUTED_WEIGHT,
                           W_TMA, DOT_PRECISION, MAX_SPINS)
