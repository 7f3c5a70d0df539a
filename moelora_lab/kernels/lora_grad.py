"""The backward of the MoE-LoRA op in two kernels, the rank intermediates through HBM, and the pieces the
one-shot backward (``lora_grad_one_shot.py``, the rank intermediates in registers) shares with it.

Shape legend: M tokens, k top-k, L adapters, E experts, r rank, K in, N out, S slices, P = M*k pairs,
BM = BLOCK_M pairs per block, B blocks, G rows of the group table, c bytes per activation element.

Per pair p of adapter l and expert e, slice s (the spec: ``moe_lora_backward_reference`` in
``moelora_lab/reference.py``), with the output's gradient G_p and dY = w_p? * G_p:

    T = A x_p   GB = Bᵀ G_p   dT = w_p? * GB   dw_p += GB·T   dB += dY Tᵀ   dA += dT x_pᵀ   dx_p += Aᵀ dT

Both designs walk the forward's block list (pairs sorted by (adapter, expert), BM to a block). The sums
over a group's pairs (dA, dB) go through a *group table* built by the launcher without a device read:
``groups`` [G, 4] int32 rows (key = l*E + e or -1, the slot's rank, first, end) and ``group_blocks``, the
block ids of row g at [first, end). One program owns each output tile and adds its blocks in table
order, so every gradient is bit-identical from run to run (the one-shot kernel's ``ATOMIC`` build alone
gives that up). A pair sits in one block: dx and dw rows have one owner too (token rows: the launcher
sums dx over a token's k pairs). Ranks past a slot's rank are never read and get zeros; dx and dw of
pairs without an adapter are the launcher's zeros.

Bytes besides reading x, the output's gradient, A and B (per slice; dx is [P, K] fp32 pair rows, zeros
first, read and written once per rank tile, then summed over k by the launcher for token rows):
``grad_rank_kernel`` (per block) writes T and dT, 2·P·r·c; ``grad_weight_kernel`` (per group and tile
of N or K) reads T again for each N tile of dB and dT for each K tile of dA, P·r·c·(⌈N/BN⌉ + ⌈K/BK⌉):
r/BN of one more read of the gradient and r/BK of one more read of x (both of which it reads once more
as well, x for dA and the gradient for dB); dA and dB are written once. At prefill sizes the dx pair
rows dominate: 4·P·K·4 bytes (zero, read, write, sum) against M·K·4 for dx itself
(``profile.grad_traffic`` counts every term).
"""
import triton
import triton.language as tl

from .common import rank_tile, rows_at

# the GRADS bit mask: which gradients a launch computes (the others are skipped)
GRAD_X = tl.constexpr(1)
GRAD_W = tl.constexpr(2)
GRAD_A = tl.constexpr(4)
GRAD_B = tl.constexpr(8)


@triton.jit
def _t_and_gb(x_base, g_base, valid, a_ptr, b_ptr, offs_r, r_ok, K, N, stride_xk, stride_ar, stride_ak,
              stride_bn, stride_br, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              BLOCK_R: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr):
    """T = X Aᵀ and GB = G B of one slice's rank tile, [BM, BLOCK_R] in ACC (x_base, g_base: [BM, 1]
    pointers to the block's rows of x and of the gradient; a_ptr, b_ptr: A[l, e], B[l, e])."""
    t = tl.zeros((BLOCK_M, BLOCK_R), dtype=ACC)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_base + ks[None, :] * stride_xk, mask=valid[:, None] & (ks < K)[None, :], other=0.0)
        at = tl.load(a_ptr + offs_r[None, :] * stride_ar + ks[:, None] * stride_ak,
                     mask=r_ok[None, :] & (ks < K)[:, None], other=0.0)                        # [BK, BR]
        t = tl.dot(xk, at, t, input_precision=PREC, out_dtype=ACC)
    gb = tl.zeros((BLOCK_M, BLOCK_R), dtype=ACC)
    for n0 in range(0, N, BLOCK_N):
        ns = n0 + tl.arange(0, BLOCK_N)
        gn = tl.load(g_base + ns[None, :], mask=valid[:, None] & (ns < N)[None, :], other=0.0)  # [BM, BN]
        bt = tl.load(b_ptr + ns[:, None] * stride_bn + offs_r[None, :] * stride_br,
                     mask=(ns < N)[:, None] & r_ok[None, :], other=0.0)                        # [BN, BR]
        gb = tl.dot(gn, bt, gb, input_precision=PREC, out_dtype=ACC)
    return t, gb


@triton.jit
def rank_step(x_base, g_base, valid, weight, a0_ptr, a1_ptr, b0_ptr, b1_ptr, offs_r, r_ok, K, N, stride_xk,
              stride_ar, stride_ak, stride_bn, stride_br, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
              TWO_SLICES: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr):
    """One block's rank tile in registers: (T, dT) of slices 0 and 1 (slice 0's again without a second)
    and this tile's part of dw, Σ GB·T over the slices."""
    t0, gb0 = _t_and_gb(x_base, g_base, valid, a0_ptr, b0_ptr, offs_r, r_ok, K, N, stride_xk, stride_ar, stride_ak,
                        stride_bn, stride_br, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R, ACC, PREC)
    dw = tl.sum(gb0 * t0, axis=1)
    t1, gb1 = t0, gb0
    if TWO_SLICES:
        t1, gb1 = _t_and_gb(x_base, g_base + N, valid, a1_ptr, b1_ptr, offs_r, r_ok, K, N, stride_xk, stride_ar,
                            stride_ak, stride_bn, stride_br, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R, ACC, PREC)
        dw += tl.sum(gb1 * t1, axis=1)
    if MUL_ROUTED_WEIGHT:
        gb0 = gb0 * weight[:, None]
        gb1 = gb1 * weight[:, None]
    return t0, gb0, t1, gb1, dw


@triton.jit
def group_row(groups_ptr, g):
    """Row g of the group table: key (l*E + e, -1 for none), rank, first and end index into group_blocks."""
    row = groups_ptr + 4 * g
    return tl.load(row).to(tl.int64), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)


@triton.jit
def pair_weights(w_ptr, pairs, valid, BLOCK_M: tl.constexpr, ACC: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr):
    """[BM] routing weights of the block's pairs (zeros, never read, without MUL_ROUTED_WEIGHT)."""
    if MUL_ROUTED_WEIGHT:
        return tl.load(w_ptr + pairs, mask=valid, other=0.0).to(ACC)
    return tl.zeros((BLOCK_M,), dtype=ACC)


@triton.jit
def add_tile(ptr, val, mask, accumulate, ATOMIC: tl.constexpr):
    """ptr[tile] = val, plus what is there where ``accumulate``; with ATOMIC an atomic add."""
    if ATOMIC:
        tl.atomic_add(ptr, val, mask=mask)
    else:
        if accumulate:
            val += tl.load(ptr, mask=mask, other=0.0)
        tl.store(ptr, val, mask=mask)


@triton.jit
def add_dx(dx_rows, valid, dt0, dt1, a0_ptr, a1_ptr, offs_r, r_ok, K, stride_ar, stride_ak, BLOCK_M: tl.constexpr,
           BLOCK_K: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, TWO_SLICES: tl.constexpr):
    """dx[rows] += dT0 A0 (+ dT1 A1) of one rank tile over all K (dx_rows: [BM, 1] pointers to contiguous rows)."""
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a_off = offs_r[:, None] * stride_ar + ks[None, :] * stride_ak                         # [BR, BK]
        a_ok = r_ok[:, None] & (ks < K)[None, :]
        acc = tl.dot(dt0, tl.load(a0_ptr + a_off, mask=a_ok, other=0.0), tl.zeros((BLOCK_M, BLOCK_K), dtype=ACC),
                     input_precision=PREC, out_dtype=ACC)
        if TWO_SLICES:
            acc = tl.dot(dt1, tl.load(a1_ptr + a_off, mask=a_ok, other=0.0), acc, input_precision=PREC, out_dtype=ACC)
        add_tile(dx_rows + ks[None, :], acc, valid[:, None] & (ks < K)[None, :], True, False)


@triton.jit
def db_part(g_tile, valid, n_ok, weight, t, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, ACC: tl.constexpr,
            PREC: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr):
    """dYᵀ T of one block at one N tile, [BN, BR] in ACC (g_tile: [BM, BN] pointers into the gradient)."""
    gy = tl.load(g_tile, mask=valid[:, None] & n_ok[None, :], other=0.0)                      # [BM, BN]
    if MUL_ROUTED_WEIGHT:
        gy = (gy * weight[:, None]).to(t.dtype)
    return tl.dot(tl.trans(gy), t, tl.zeros((BLOCK_N, BLOCK_R), dtype=ACC), input_precision=PREC, out_dtype=ACC)


@triton.jit
def da_part(dt, x_tile, valid, k_ok, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ACC: tl.constexpr,
            PREC: tl.constexpr):
    """dTᵀ X of one block at one K tile, [BR, BK] in ACC (x_tile: [BM, BK] pointers into x)."""
    xk = tl.load(x_tile, mask=valid[:, None] & k_ok[None, :], other=0.0)                      # [BM, BK]
    return tl.dot(tl.trans(dt), xk, tl.zeros((BLOCK_R, BLOCK_K), dtype=ACC), input_precision=PREC, out_dtype=ACC)


@triton.jit
def grad_rank_kernel(
    # ---- pointers
    x_ptr,             # [M, K] token rows or [P, K] pair rows; fp32/fp16 (fp64 on the interpreter)
    a0_ptr, a1_ptr,    # A of the launch's slices: [L, E, r, K], x's dtype (slice 0 twice when one is left)
    b0_ptr, b1_ptr,    # B of the launch's slices: [L, E, N, r], x's dtype
    g_ptr,             # [P, >= S*N] the output's gradient at the launch's first column, x's dtype, columns contiguous
    w_ptr,             # [P] routing weight of each pair, float (read with MUL_ROUTED_WEIGHT)
    t_ptr,             # [2, NS, P, r] T then dT, x's dtype, contiguous (written where grad_weight_kernel reads)
    dx_ptr,            # [P, K] dx of each pair, fp32 (fp64), contiguous, zeros before the first launch
    dw_ptr,            # [P] dw, dx's dtype, zeros before the first launch
    sorted_pairs_ptr, block_lora_ptr, block_expert_ptr,   # BlockList: [B*BM], [B], [B] int32
    lora_ranks_ptr,    # [L] int32 rank of each slot (<= r)
    # ---- sizes
    num_pairs, pairs_per_row, K, N, R,
    # ---- strides
    stride_xm, stride_xk,
    stride_al, stride_ae, stride_ar, stride_ak,
    stride_bl, stride_be, stride_bn, stride_br,
    stride_gm,
    # ---- meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    TWO_SLICES: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, GRADS: tl.constexpr,
):
    """Program (block): T and dT of its pairs, rank tile by rank tile, to HBM; dx rows (+= dT A over the
    launch's slices) and dw from registers."""
    PREC: tl.constexpr = "ieee" if x_ptr.dtype.element_ty.primitive_bitwidth >= 32 else "tf32"
    ACC: tl.constexpr = dx_ptr.dtype.element_ty
    CDT: tl.constexpr = x_ptr.dtype.element_ty
    NS: tl.constexpr = 2 if TWO_SLICES else 1
    block = tl.program_id(0)
    lora = tl.load(block_lora_ptr + block)
    if lora < 0:
        return                                           # unused block
    expert = tl.load(block_expert_ptr + block)
    r_lim = tl.minimum(tl.load(lora_ranks_ptr + lora), R)
    a_off = lora.to(tl.int64) * stride_al + expert.to(tl.int64) * stride_ae
    b_off = lora.to(tl.int64) * stride_bl + expert.to(tl.int64) * stride_be
    pairs, valid, x_rows = rows_at(sorted_pairs_ptr, block * BLOCK_M, num_pairs, pairs_per_row, BLOCK_M, True)
    weight = pair_weights(w_ptr, pairs, valid, BLOCK_M, ACC, MUL_ROUTED_WEIGHT)
    dw = tl.zeros((BLOCK_M,), dtype=ACC)
    t_rows = t_ptr + pairs.to(tl.int64)[:, None] * R                  # row p of T [NS, P, r] slice 0
    for r0 in range(0, r_lim, BLOCK_R):
        offs_r, r_ok = rank_tile(r0, r_lim, BLOCK_R)
        t0, dt0, t1, dt1, dw_tile = rank_step(
            x_ptr + x_rows.to(tl.int64)[:, None] * stride_xm, g_ptr + pairs.to(tl.int64)[:, None] * stride_gm, valid,
            weight, a0_ptr + a_off, a1_ptr + a_off, b0_ptr + b_off, b1_ptr + b_off, offs_r, r_ok, K, N, stride_xk,
            stride_ar, stride_ak, stride_bn, stride_br, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R, ACC, PREC, TWO_SLICES,
            MUL_ROUTED_WEIGHT)
        dw += dw_tile
        t_ok = valid[:, None] & r_ok[None, :]
        for s in tl.static_range(NS):                    # the HBM round trip: T for dB, dT for dA
            if GRAD_B & GRADS:
                tl.store(t_rows + s * num_pairs * R + offs_r[None, :], (t1 if s else t0).to(CDT), mask=t_ok)
            if GRAD_A & GRADS:
                tl.store(t_rows + (NS + s) * num_pairs * R + offs_r[None, :], (dt1 if s else dt0).to(CDT), mask=t_ok)
        if GRAD_X & GRADS:
            add_dx(dx_ptr + pairs.to(tl.int64)[:, None] * K, valid, dt0.to(CDT), dt1.to(CDT), a0_ptr + a_off,
                   a1_ptr + a_off, offs_r, r_ok, K, stride_ar, stride_ak, BLOCK_M, BLOCK_K, ACC, PREC, TWO_SLICES)
            tl.debug_barrier()       # the next rank tile adds to the dx rows other threads stored
    if GRAD_W & GRADS:
        add_tile(dw_ptr + pairs, dw, valid, True, False)


@triton.jit
def _walk_db(out, g_ptr, w_ptr, t_ptr, sorted_pairs_ptr, group_blocks_ptr, first, end, rank, ns, num_pairs, N, R,
             stride_gm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, ACC: tl.constexpr,
             PREC: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr):
    """out[n-tile, :] = Σ over the group's blocks of dYᵀ T (out: dB[l, e] of one slice; T: [P, r] rows)."""
    for r0 in range(0, R, BLOCK_R):
        offs_r, r_ok = rank_tile(r0, rank, BLOCK_R)
        acc = tl.zeros((BLOCK_N, BLOCK_R), dtype=ACC)
        if r0 < rank:
            for i in range(first, end):
                pairs, valid, _ = rows_at(sorted_pairs_ptr, tl.load(group_blocks_ptr + i) * BLOCK_M, num_pairs, 1,
                                          BLOCK_M, False)
                weight = pair_weights(w_ptr, pairs, valid, BLOCK_M, ACC, MUL_ROUTED_WEIGHT)
                t = tl.load(t_ptr + pairs.to(tl.int64)[:, None] * R + offs_r[None, :],
                            mask=valid[:, None] & r_ok[None, :], other=0.0)                    # [BM, BR] from HBM
                acc += db_part(g_ptr + pairs.to(tl.int64)[:, None] * stride_gm + ns[None, :], valid, ns < N, weight,
                               t, BLOCK_N, BLOCK_R, ACC, PREC, MUL_ROUTED_WEIGHT)
        tl.store(out + ns[:, None] * R + offs_r[None, :], acc, mask=(ns < N)[:, None] & (offs_r < R)[None, :])


@triton.jit
def _walk_da(out, x_ptr, dt_ptr, sorted_pairs_ptr, group_blocks_ptr, first, end, rank, ks, num_pairs,
             pairs_per_row, K, R, stride_xm, stride_xk, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
             BLOCK_R: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr):
    """out[:, k-tile] = Σ over the group's blocks of dTᵀ X (out: dA[l, e] of one slice; dT: [P, r] rows)."""
    for r0 in range(0, R, BLOCK_R):
        offs_r, r_ok = rank_tile(r0, rank, BLOCK_R)
        acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=ACC)
        if r0 < rank:
            for i in range(first, end):
                pairs, valid, x_rows = rows_at(sorted_pairs_ptr, tl.load(group_blocks_ptr + i) * BLOCK_M, num_pairs,
                                               pairs_per_row, BLOCK_M, True)
                dt = tl.load(dt_ptr + pairs.to(tl.int64)[:, None] * R + offs_r[None, :],
                             mask=valid[:, None] & r_ok[None, :], other=0.0)                   # [BM, BR] from HBM
                acc += da_part(dt, x_ptr + x_rows.to(tl.int64)[:, None] * stride_xm + ks[None, :] * stride_xk,
                               valid, ks < K, BLOCK_R, BLOCK_K, ACC, PREC)
        tl.store(out + offs_r[:, None] * K + ks[None, :], acc, mask=(offs_r < R)[:, None] & (ks < K)[None, :])


@triton.jit
def grad_weight_kernel(
    # ---- pointers
    x_ptr,             # [M, K] or [P, K], x's dtype
    g_ptr,             # [P, >= S*N] the output's gradient at the launch's first column, columns contiguous
    w_ptr,             # [P] routing weights (read with MUL_ROUTED_WEIGHT)
    t_ptr,             # [2, NS, P, r] T then dT from grad_rank_kernel (read only where it wrote)
    da_ptr,            # [NS, L, E, r, K] dA of the launch's slices, fp32 (fp64), contiguous: every element written
    db_ptr,            # [NS, L, E, N, r] dB, likewise
    sorted_pairs_ptr,  # [B*BM] int32 pair ids of the blocks
    groups_ptr,        # [L*E, 4] int32 group table: key, rank, first, end
    group_blocks_ptr,  # [B] int32 block ids, group after group
    # ---- sizes
    num_pairs, pairs_per_row, K, N, R, num_keys,
    # ---- strides
    stride_xm, stride_xk, stride_gm,
    # ---- meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    TWO_SLICES: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, GRADS: tl.constexpr,
):
    """Program (group, slice, tile): with GRAD_B tiles [0, ⌈N/BN⌉) are dB[l, e, n-tile, :], the others
    (with GRAD_A) dA[l, e, :, k-tile]; each sums the group's blocks in table order, zeros where none."""
    tl.static_assert(BLOCK_M >= 16, "tl.dot needs at least 16 rows: blocks of 16 pairs or more")
    PREC: tl.constexpr = "ieee" if x_ptr.dtype.element_ty.primitive_bitwidth >= 32 else "tf32"
    ACC: tl.constexpr = da_ptr.dtype.element_ty
    NS: tl.constexpr = 2 if TWO_SLICES else 1
    g = tl.program_id(0)
    s = tl.program_id(1)
    key, rank, first, end = group_row(groups_ptr, g)
    n_tiles = tl.cdiv(N, BLOCK_N) if GRAD_B & GRADS else 0
    tile = tl.program_id(2)
    t_slice = t_ptr + s * num_pairs * R                                    # T [P, r] of slice s
    if tile < n_tiles:
        _walk_db(db_ptr + (s * num_keys + key) * N * R, g_ptr + s * N, w_ptr, t_slice, sorted_pairs_ptr,
                 group_blocks_ptr, first, end, rank, tile * BLOCK_N + tl.arange(0, BLOCK_N), num_pairs, N, R,
                 stride_gm, BLOCK_M, BLOCK_N, BLOCK_R, ACC, PREC, MUL_ROUTED_WEIGHT)
    else:
        _walk_da(da_ptr + (s * num_keys + key) * R * K, x_ptr, t_slice + NS * num_pairs * R, sorted_pairs_ptr,
                 group_blocks_ptr, first, end, rank, (tile - n_tiles) * BLOCK_K + tl.arange(0, BLOCK_K), num_pairs,
                 pairs_per_row, K, R, stride_xm, stride_xk, BLOCK_M, BLOCK_K, BLOCK_R, ACC, PREC)
