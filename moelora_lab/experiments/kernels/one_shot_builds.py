"""The one-shot kernel with every build knob, to time what each one buys (``python -m moelora_lab.bench expand``).

Shape legend: M tokens, k top-k, L adapters, E experts, r rank, K in, N out, S slices,
BM = BLOCK_M pairs per block, B blocks.

The same program as the product's ``kernels.one_shot.one_shot_kernel`` (read its docstring first),
built any of the ways it was measured. The product builds it one way, or as the rule
``op.dispatch.one_shot_build_rule`` says, for every knob here:

    BOTH_SLICES    one program does w13's two slices, reading its x rows once for the two shrinks
                   (grid axis 1: N_CHUNKS, not 2*N_CHUNKS). The product: one slice per program.
    CLAMP_RANKS    the masked rank lanes point at row 0, as the kernel once did: the compiler then sees
                   scattered offsets and loads B as given (r fastest) 2 bytes at a time, unpipelined.
                   The product: one contiguous run of offsets (``kernels.common.rank_tile``).
    PREFETCH_OUT   each expand step loads the next step's output tile first. The product: the rule.
    EXPAND_STAGES  the expand loop's pipeline depth (None: num_stages). The product: the rule.
    DOT_PRECISION  "ieee" or "tf32" for fp32 inputs. The product: "ieee" for fp32, from x's dtype.
    TOKEN_ROWS     x has one row per token (pair p reads row p // top_k) or one per pair. The product
                   divides by its ``pairs_per_row`` (k or 1) instead.
    stride_on      the output's column stride. The product: 1 (the op's output has contiguous columns).

Built as the product builds it (BOTH_SLICES and CLAMP_RANKS off, the rule's PREFETCH_OUT and
EXPAND_STAGES, DOT_PRECISION from x's dtype, the output's column stride 1), it compiles to the
product's program.
"""
import triton
import triton.language as tl

from ...kernels.common import block_rows, rank_tile, rank_tile_runs, slice_pointers, slot_rank


@triton.jit
def _shrink(x_base, valid, a0_ptr, a1_ptr, offs_r, r_ok, K, stride_xk, stride_ar, stride_ak,
            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, EVEN_K: tl.constexpr,
            DOT_PRECISION: tl.constexpr, BOTH_SLICES: tl.constexpr):
    """t0[BM, BLOCK_R] = X[rows] @ A0[r-tile]^T in fp32 (and t1 from A1 and the same x tiles with BOTH_SLICES)."""
    offs_k = tl.arange(0, BLOCK_K)
    t0 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    t1 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
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
        t0 = tl.dot(xk, tl.load(a0_ptr + a_off, mask=a_ok, other=0.0), t0, input_precision=DOT_PRECISION)
        if BOTH_SLICES:
            t1 = tl.dot(xk, tl.load(a1_ptr + a_off, mask=a_ok, other=0.0), t1, input_precision=DOT_PRECISION)
    return t0, t1


@triton.jit
def _load_out(out_base, ns, n_hi, valid, read_out, stride_on):
    """The output tile at columns ``ns`` ([BM, BN]): zeros unless ``read_out``; past n_hi nothing is read."""
    return tl.load(out_base + ns[None, :] * stride_on, mask=valid[:, None] & (ns < n_hi)[None, :] & read_out,
                   other=0.0)


@triton.jit
def _expand(t, b_ptr, out_base, weight, n_lo, n_hi, offs_r, r_ok, valid, read_out, stride_bn, stride_br, stride_on,
            BLOCK_N: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr,
            PREFETCH_OUT: tl.constexpr, EXPAND_STAGES: tl.constexpr):
    """out[rows, n_lo:n_hi] = (w *) t @ B^T (+ the output already there where ``read_out``), one
    BLOCK_N tile per step; with PREFETCH_OUT every step loads the next step's output tile before it
    computes its own."""
    offs_n = tl.arange(0, BLOCK_N)
    if PREFETCH_OUT:
        prev = _load_out(out_base, n_lo + offs_n, n_hi, valid, read_out, stride_on)
    for n0 in tl.range(n_lo, n_hi, BLOCK_N, num_stages=EXPAND_STAGES):
        ns = n0 + offs_n
        n_ok = ns < n_hi
        if PREFETCH_OUT:
            prev_next = _load_out(out_base, ns + BLOCK_N, n_hi, valid, read_out, stride_on)
        else:
            prev = _load_out(out_base, ns, n_hi, valid, read_out, stride_on)
        bt = tl.load(b_ptr + ns[None, :] * stride_bn + offs_r[:, None] * stride_br,
                     mask=n_ok[None, :] & r_ok[:, None], other=0.0)                        # [BR, BN]
        acc = tl.dot(t, bt, input_precision=DOT_PRECISION)                                # [BM, BN] fp32
        if MUL_ROUTED_WEIGHT:
            acc = acc * weight[:, None]
        acc += prev.to(tl.float32)
        tl.store(out_base + ns[None, :] * stride_on, acc.to(out_base.dtype.element_ty),
                 mask=valid[:, None] & n_ok[None, :])
        if PREFETCH_OUT:
            prev = prev_next


@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def one_shot_build_kernel(
    # ---- pointers
    x_ptr,             # [M, K] (TOKEN_ROWS) or [M*k, K]; fp32/fp16/bf16
    a0_ptr, a1_ptr,    # LoRA A of slices 0 and 1: [L, E, r, K], x's dtype
    b0_ptr, b1_ptr,    # LoRA B of slices 0 and 1: [L, E, N, r], x's dtype
    out_ptr,           # [M*k, S*N] rows of the [M, k, S*N] output, x's dtype
    topk_weights_ptr,  # [M*k] fp32 routing weight of each pair (read if MUL_ROUTED_WEIGHT)
    sorted_pairs_ptr,  # [B*BM] int32 pair ids, sentinel num_pairs
    block_lora_ptr,    # [B] int32 adapter of each block, -1 = unused
    block_expert_ptr,  # [B] int32 expert of each block
    lora_ranks_ptr,    # [L] int32 actual rank of each slot (read if HAS_RANKS)
    # ---- sizes
    num_pairs, top_k, K, N, R,
    slice_offset,      # output column of this launch's slice 0
    # ---- strides
    stride_xm, stride_xk,
    stride_al, stride_ae, stride_ar, stride_ak,
    stride_bl, stride_be, stride_bn, stride_br,
    stride_om, stride_on,
    # ---- meta-parameters
    N_CHUNKS: tl.constexpr,           # programs sharing one slice's N columns
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    RANK_TILES: tl.constexpr,         # cdiv(r, BLOCK_R)
    TOKEN_ROWS: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, ADD_INPUTS: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_RANKS: tl.constexpr,
    # ---- build knobs (the module docstring)
    BOTH_SLICES: tl.constexpr = False,
    PREFETCH_OUT: tl.constexpr = True,
    EXPAND_STAGES: tl.constexpr = None,
    CLAMP_RANKS: tl.constexpr = False,
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
    r_lim = slot_rank(lora_ranks_ptr, lora, R, HAS_RANKS)
    a_ptr, b_ptr = slice_pointers(slice_id, a0_ptr, a1_ptr, b0_ptr, b1_ptr)
    w_a = lora.to(tl.int64) * stride_al + expert.to(tl.int64) * stride_ae
    w_b = lora.to(tl.int64) * stride_bl + expert.to(tl.int64) * stride_be
    a_ptr += w_a
    b_ptr += w_b

    pairs, valid, x_rows = block_rows(sorted_pairs_ptr, block, num_pairs, top_k, BLOCK_M, TOKEN_ROWS)
    weight = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + pairs, mask=valid, other=0.0)          # [BM] fp32

    chunk_len = tl.cdiv(tl.cdiv(N, N_CHUNKS), BLOCK_N) * BLOCK_N
    n_lo = chunk * chunk_len
    n_hi = tl.minimum(n_lo + chunk_len, N)
    x_base = x_ptr + x_rows.to(tl.int64)[:, None] * stride_xm                     # [BM, 1]
    out_base = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + (slice_offset + slice_id * N) * stride_on

    for rt in range(RANK_TILES):
        if rank_tile_runs(rt, r_lim, BLOCK_R, HAS_RANKS):
            offs_r, r_ok = rank_tile(rt * BLOCK_R, r_lim, BLOCK_R, CLAMP_RANKS)
            if ADD_INPUTS:
                read_out = rt >= 0                   # the caller's output ...
            else:
                read_out = rt > 0                    # ... or the earlier rank tiles' sums
            t0, t1 = _shrink(x_base, valid, a_ptr, a1_ptr + w_a, offs_r, r_ok, K, stride_xk, stride_ar, stride_ak,
                             BLOCK_M, BLOCK_K, BLOCK_R, EVEN_K, DOT_PRECISION, BOTH_SLICES)
            _expand(t0.to(x_ptr.dtype.element_ty), b_ptr, out_base, weight, n_lo, n_hi, offs_r, r_ok, valid, read_out,
                    stride_bn, stride_br, stride_on, BLOCK_N, MUL_ROUTED_WEIGHT, DOT_PRECISION, PREFETCH_OUT,
                    EXPAND_STAGES)
            if BOTH_SLICES:
                _expand(t1.to(x_ptr.dtype.element_ty), b1_ptr + w_b, out_base + N * stride_on, weight, n_lo, n_hi,
                        offs_r, r_ok, valid, read_out, stride_bn, stride_br, stride_on, BLOCK_N, MUL_ROUTED_WEIGHT,
                        DOT_PRECISION, PREFETCH_OUT, EXPAND_STAGES)
            if RANK_TILES > 1:
                tl.debug_barrier()   # the next rank tile re-reads what other threads of this program stored
