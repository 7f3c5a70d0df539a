"""Fused one-shot MoE-LoRA: shrink into registers, expand from them; the rank tile never touches HBM.

Shape legend: M tokens, k top-k, L adapters, E experts, r rank, K in, N out, S slices,
BM = BLOCK_M pairs per block, B blocks.

One program owns one block of BM pairs that share an (adapter, expert), one slice and one chunk of
the N columns. For each rank tile of BLOCK_R columns it computes T = X @ A^T as an fp32 [BM, BLOCK_R]
register tile, casts it to the activation dtype and multiplies it by B^T tile by tile along N. Ranks
wider than one register tile (r > BLOCK_R) loop over rank tiles; every tile after the first adds its
partial product into the output rows this program owns, so any rank works and the fusion is kept
(the output rows are re-read once per extra rank tile, never T).

The expand walks N one tile at a time; each step loads a B tile and the output tile it adds to. The
compiler pipelines the B tiles (they feed the dot, and their rank offsets are one contiguous run:
``kernels.common.rank_tile``) but not the output tiles (the loop stores into what it loads), so each
step may load the next step's output tile before it computes its own (``PREFETCH_OUT``). Whether it
does, and how deep the expand loop is pipelined (``EXPAND_STAGES``), is the measured rule
``op.dispatch.one_shot_build_rule``. The other ways this kernel was once built (both w13 slices in one
program, rank offsets clamped as they were) lost, and live on in
``moelora_lab.experiments.kernels.one_shot_builds``, which ``python -m moelora_lab.bench expand``
times against this build.
"""
import triton
import triton.language as tl

from .common import block_rows, rank_tile, rank_tile_runs, slice_pointers, slot_rank


@triton.jit
def _shrink(x_base, valid, a_ptr, offs_r, r_ok, K, stride_xk, stride_ar, stride_ak,
            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, EVEN_K: tl.constexpr,
            DOT_PRECISION: tl.constexpr):
    """t[BM, BLOCK_R] = X[rows] @ A[r-tile]^T in fp32 (x_base: [BM, 1] pointers to the block's x rows;
    a_ptr: A[l, e] of this program's slice)."""
    offs_k = tl.arange(0, BLOCK_K)
    t = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        a_off = offs_r[None, :] * stride_ar + ks[:, None] * stride_ak                  # [BK, BR]
        if EVEN_K:
            x_ok = valid[:, None]
            a_ok = r_ok[None, :]
        else:
            x_ok = valid[:, None] & (ks < K)[None, :]
            a_ok = r_ok[None, :] & (ks < K)[:, None]
        xk = tl.load(x_base + ks[None, :] * stride_xk, mask=x_ok, other=0.0)           # [BM, BK]
        t = tl.dot(xk, tl.load(a_ptr + a_off, mask=a_ok, other=0.0), t, input_precision=DOT_PRECISION)
    return t


@triton.jit
def _load_out(out_base, ns, n_hi, valid, read_out):
    """The output tile at columns ``ns`` ([BM, BN]; the output's columns are contiguous): zeros unless
    ``read_out``; past n_hi nothing is read."""
    return tl.load(out_base + ns[None, :], mask=valid[:, None] & (ns < n_hi)[None, :] & read_out, other=0.0)


@triton.jit
def _expand(t, b_ptr, out_base, weight, n_lo, n_hi, offs_r, r_ok, valid, read_out, stride_bn, stride_br,
            BLOCK_N: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr,
            PREFETCH_OUT: tl.constexpr, EXPAND_STAGES: tl.constexpr):
    """out[rows, n_lo:n_hi] = (w *) t @ B^T (+ the output already there where ``read_out``), one
    BLOCK_N tile per step. The compiler pipelines the B tiles (they feed the dot) but not the output
    tiles (it stores into what it loads): with PREFETCH_OUT every step loads the next step's output
    tile before it computes its own, so that load's latency hides behind the step."""
    offs_n = tl.arange(0, BLOCK_N)
    if PREFETCH_OUT:
        prev = _load_out(out_base, n_lo + offs_n, n_hi, valid, read_out)
    for n0 in tl.range(n_lo, n_hi, BLOCK_N, num_stages=EXPAND_STAGES):
        ns = n0 + offs_n
        n_ok = ns < n_hi
        if PREFETCH_OUT:
            prev_next = _load_out(out_base, ns + BLOCK_N, n_hi, valid, read_out)
        else:
            prev = _load_out(out_base, ns, n_hi, valid, read_out)
        bt = tl.load(b_ptr + ns[None, :] * stride_bn + offs_r[:, None] * stride_br,
                     mask=n_ok[None, :] & r_ok[:, None], other=0.0)                        # [BR, BN]
        acc = tl.dot(t, bt, input_precision=DOT_PRECISION)                                # [BM, BN] fp32
        if MUL_ROUTED_WEIGHT:
            acc = acc * weight[:, None]
        acc += prev.to(tl.float32)
        tl.store(out_base + ns[None, :], acc.to(out_base.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])
        if PREFETCH_OUT:
            prev = prev_next


@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def one_shot_kernel(
    # ---- pointers
    x_ptr,             # [M, K] token rows (pairs_per_row = k) or [M*k, K] pair rows (pairs_per_row = 1); fp32/fp16/bf16
    a0_ptr, a1_ptr,    # LoRA A of slices 0 and 1: [L, E, r, K], x's dtype (slice 0 twice when one is left)
    b0_ptr, b1_ptr,    # LoRA B of slices 0 and 1: [L, E, N, r], x's dtype (slice 0 twice when one is left)
    out_ptr,           # [M*k, S*N] rows of the [M, k, S*N] output, x's dtype, columns contiguous
    topk_weights_ptr,  # [M*k] fp32 routing weight of each pair (read if MUL_ROUTED_WEIGHT)
    sorted_pairs_ptr,  # [B*BM] int32 pair ids, sentinel num_pairs
    block_lora_ptr,    # [B] int32 adapter of each block, -1 = unused
    block_expert_ptr,  # [B] int32 expert of each block
    lora_ranks_ptr,    # [L] int32 actual rank of each slot (read if HAS_RANKS)
    # ---- sizes
    num_pairs,         # M*k, the sentinel of sorted_pairs
    pairs_per_row,     # pairs that read one x row: k (token rows) or 1 (pair rows; Triton compiles an argument
                       # equal to 1 as a constant, so the divide by it folds away)
    K, N, R,
    slice_offset,      # output column of this launch's slice 0 (launches take two slices at a time)
    # ---- strides (the output's column stride is 1)
    stride_xm, stride_xk,
    stride_al, stride_ae, stride_ar, stride_ak,
    stride_bl, stride_be, stride_bn, stride_br,
    stride_om,
    # ---- meta-parameters
    N_CHUNKS: tl.constexpr,           # programs sharing one slice's N columns
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    RANK_TILES: tl.constexpr,         # cdiv(r, BLOCK_R)
    MUL_ROUTED_WEIGHT: tl.constexpr, ADD_INPUTS: tl.constexpr, EVEN_K: tl.constexpr, HAS_RANKS: tl.constexpr,
    PREFETCH_OUT: tl.constexpr = True,   # load each expand step's output tile one step ahead (the rule's choice)
    EXPAND_STAGES: tl.constexpr = None,  # the expand loop's pipeline depth, None: num_stages (the rule's choice)
):
    tl.static_assert(BLOCK_R >= 16, "tl.dot needs an inner size of at least 16: pad BLOCK_R")
    tl.static_assert(BLOCK_M >= 16, "tl.dot needs at least 16 rows: use BLOCK_M >= 16")
    # exact fp32 products for fp32 inputs; the precision is moot for 16-bit ones
    DOT_PRECISION: tl.constexpr = "ieee" if x_ptr.dtype.element_ty == tl.float32 else "tf32"
    block = tl.program_id(0)
    slice_id = tl.program_id(1) // N_CHUNKS
    chunk = tl.program_id(1) % N_CHUNKS
    lora = tl.load(block_lora_ptr + block)
    if lora < 0:
        return                                           # unused block: nothing to do
    expert = tl.load(block_expert_ptr + block)
    r_lim = slot_rank(lora_ranks_ptr, lora, R, HAS_RANKS)   # a rank-8 adapter in a rank-64 slot reads 8 rows
    a_ptr, b_ptr = slice_pointers(slice_id, a0_ptr, a1_ptr, b0_ptr, b1_ptr)
    w_a = lora.to(tl.int64) * stride_al + expert.to(tl.int64) * stride_ae
    w_b = lora.to(tl.int64) * stride_bl + expert.to(tl.int64) * stride_be
    a_ptr += w_a
    b_ptr += w_b

    # pair p reads x row p // pairs_per_row
    pairs, valid, x_rows = block_rows(sorted_pairs_ptr, block, num_pairs, pairs_per_row, BLOCK_M, True)
    weight = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + pairs, mask=valid, other=0.0)          # [BM] fp32

    chunk_len = tl.cdiv(tl.cdiv(N, N_CHUNKS), BLOCK_N) * BLOCK_N
    n_lo = chunk * chunk_len
    n_hi = tl.minimum(n_lo + chunk_len, N)
    x_base = x_ptr + x_rows.to(tl.int64)[:, None] * stride_xm                     # [BM, 1]
    out_base = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + (slice_offset + slice_id * N)

    for rt in range(RANK_TILES):
        if rank_tile_runs(rt, r_lim, BLOCK_R, HAS_RANKS):
            offs_r, r_ok = rank_tile(rt * BLOCK_R, r_lim, BLOCK_R)
            if ADD_INPUTS:
                read_out = rt >= 0                   # the caller's output ...
            else:
                read_out = rt > 0                    # ... or the earlier rank tiles' sums
            # ---- shrink: t[BM, BLOCK_R] = X[rows, :] @ A[lora, expert, r-tile, :]^T, fp32 in registers
            t = _shrink(x_base, valid, a_ptr, offs_r, r_ok, K, stride_xk, stride_ar, stride_ak,
                        BLOCK_M, BLOCK_K, BLOCK_R, EVEN_K, DOT_PRECISION)
            # ---- expand: out[rows, n-tile] (+)= w * t @ B[lora, expert, n-tile, r-tile]^T
            _expand(t.to(x_ptr.dtype.element_ty), b_ptr, out_base, weight, n_lo, n_hi, offs_r, r_ok, valid, read_out,
                    stride_bn, stride_br, BLOCK_N, MUL_ROUTED_WEIGHT, DOT_PRECISION, PREFETCH_OUT, EXPAND_STAGES)
            if RANK_TILES > 1:
                tl.debug_barrier()   # the next rank tile re-reads what other threads of this program stored
