"""Fused one-shot MoE-LoRA: shrink into registers, expand from them; the rank tile never touches HBM.

Shape legend: M tokens, k top-k, L adapters, E experts, r rank, K in, N out, S slices,
BM = BLOCK_M pairs per block, B blocks.

One program owns one block of BM pairs that share an (adapter, expert), one slice and one chunk of
the N columns. For each rank tile of BLOCK_R columns it computes T = X @ A^T as an fp32
[BM, BLOCK_R] register tile, casts it to the activation dtype and multiplies it by B^T tile by tile
along N. Ranks wider than one register tile (r > BLOCK_R) loop over rank tiles; every tile after the
first adds its partial product into the output rows this program owns, so any rank works and
the fusion is kept (the output rows are re-read once per extra rank tile, never T).
"""
import triton
import triton.language as tl

from .common import block_rows, rank_tile, rank_tile_runs, slice_pointers, slot_rank


@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def one_shot_kernel(
    x_ptr,             # [M, K] (TOKEN_ROWS) or [M*k, K]; fp32/fp16/bf16
    a0_ptr, a1_ptr,    # LoRA A of slices 0 and 1: [L, E, r, K], x's dtype
    b0_ptr, b1_ptr,    # LoRA B of slices 0 and 1: [L, E, N, r], x's dtype
    out_ptr,           # [M*k, S*N] rows of the [M, k, S*N] output, x's dtype
    topk_weights_ptr,  # [M*k] fp32 routing weight of each pair (read if MUL_ROUTED_WEIGHT)
    sorted_pairs_ptr,  # [B*BM] int32 pair ids, sentinel num_pairs
    block_lora_ptr,    # [B] int32 adapter of each block, -1 = unused
    block_expert_ptr,  # [B] int32 expert of each block
    lora_ranks_ptr,    # [L] int32 actual rank of each slot (read if HAS_RANKS)
    num_pairs, top_k, K, N, R, slice_offset,
    stride_xm, stride_xk,
    stride_al, stride_ae, stride_ar, stride_ak,
    stride_bl, stride_be, stride_bn, stride_br,
    stride_om, stride_on,
    N_CHUNKS: tl.constexpr,           # programs sharing one slice's N columns
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    RANK_TILES: tl.constexpr,         # cdiv(r, BLOCK_R)
    TOKEN_ROWS: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, ADD_INPUTS: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_RANKS: tl.constexpr,
):
    tl.static_assert(BLOCK_R >= 16, "tl.dot needs an inner size of at least 16: pad BLOCK_R")
    tl.static_assert(BLOCK_M >= 16, "tl.dot needs at least 16 rows: use BLOCK_M >= 16")
    block = tl.program_id(0)
    slice_id = tl.program_id(1) // N_CHUNKS
    chunk = tl.program_id(1) % N_CHUNKS
    lora = tl.load(block_lora_ptr + block)
    if lora < 0:
        return                                           # unused block: nothing to do
    expert = tl.load(block_expert_ptr + block)
    r_lim = slot_rank(lora_ranks_ptr, lora, R, HAS_RANKS)   # a rank-8 adapter in a rank-64 slot reads 8 rows
    a_ptr, b_ptr = slice_pointers(slice_id, a0_ptr, a1_ptr, b0_ptr, b1_ptr)
    a_ptr += lora.to(tl.int64) * stride_al + expert.to(tl.int64) * stride_ae
    b_ptr += lora.to(tl.int64) * stride_bl + expert.to(tl.int64) * stride_be

    pairs, valid, x_rows = block_rows(sorted_pairs_ptr, block, num_pairs, top_k, BLOCK_M, TOKEN_ROWS)
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + pairs, mask=valid, other=0.0)          # [BM] fp32

    chunk_len = tl.cdiv(tl.cdiv(N, N_CHUNKS), BLOCK_N) * BLOCK_N
    n_lo = chunk * chunk_len
    n_hi = tl.minimum(n_lo + chunk_len, N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = tl.arange(0, BLOCK_N)
    x_base = x_ptr + x_rows.to(tl.int64)[:, None] * stride_xm                     # [BM, 1]
    out_base = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + (slice_offset + slice_id * N) * stride_on

    for rt in range(RANK_TILES):
        if rank_tile_runs(rt, r_lim, BLOCK_R, HAS_RANKS):
            offs_r, r_ok = rank_tile(rt * BLOCK_R, r_lim, BLOCK_R)
            # ---- shrink: t[BM, BLOCK_R] = X[rows, :] @ A[lora, expert, r-tile, :]^T, fp32 in registers
            t = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + offs_k
                if EVEN_K:
                    xk = tl.load(x_base + ks[None, :] * stride_xk, mask=valid[:, None], other=0.0)
                    ak = tl.load(a_ptr + offs_r[None, :] * stride_ar + ks[:, None] * stride_ak,
                                 mask=r_ok[None, :], other=0.0)
                else:
                    k_ok = ks < K
                    xk = tl.load(x_base + ks[None, :] * stride_xk, mask=valid[:, None] & k_ok[None, :], other=0.0)
                    ak = tl.load(a_ptr + offs_r[None, :] * stride_ar + ks[:, None] * stride_ak,
                                 mask=r_ok[None, :] & k_ok[:, None], other=0.0)
                t = tl.dot(xk, ak, t, input_precision=DOT_PRECISION)                  # [BM, BK] @ [BK, BR]
            t = t.to(x_ptr.dtype.element_ty)
            # ---- expand: out[rows, n-tile] (+)= w * t @ B[lora, expert, n-tile, r-tile]^T
            for n0 in range(n_lo, n_hi, BLOCK_N):
                ns = n0 + offs_n
                n_ok = ns < n_hi
                bt = tl.load(b_ptr + ns[None, :] * stride_bn + offs_r[:, None] * stride_br,
                             mask=n_ok[None, :] & r_ok[:, None], other=0.0)            # [BR, BN]
                acc = tl.dot(t, bt, input_precision=DOT_PRECISION)                     # [BM, BN] fp32
                if MUL_ROUTED_WEIGHT:
                    acc = acc * weight[:, None]
                mask = valid[:, None] & n_ok[None, :]
                out = out_base + ns[None, :] * stride_on
                if ADD_INPUTS:
                    acc += tl.load(out, mask=mask, other=0.0).to(tl.float32)
                elif rt > 0:
                    acc += tl.load(out, mask=mask, other=0.0).to(tl.float32)       # earlier rank tiles
                tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
            if RANK_TILES > 1:
                tl.debug_barrier()   # the next rank tile re-reads what other threads of this program stored
