"""The backward of the MoE-LoRA op in one kernel: the rank intermediates T and dT never leave registers.

Shape legend: M tokens, k top-k, L adapters, E experts, r rank, K in, N out, S slices, P = M*k pairs,
BM = BLOCK_M pairs per block, B blocks, G rows of the group table.

The formulas, the block list and the group table are those of ``lora_grad.py`` (the two-kernel
backward), whose pieces this kernel reuses. ``grad_one_shot_kernel`` runs one program per (adapter,
expert) group walking the group's blocks in table order (no per-block partials), so every gradient is
bit-identical from run to run; its ``ATOMIC`` build (one row per block, dA and dB added with atomics
into zeros) gives that up for more programs.

Bytes besides reading x, the output's gradient, A and B: per slice, the group's dA and dB rank slabs
are read and written back once per block after the group's first, 8·R_l·(N + K) bytes per extra block,
R_l the slot's rank rounded up to whole rank tiles (the slabs of one group, 4·r·(N + K) bytes = 128 KiB
at r 16 and N = K = 1024, may stay in L2). Per slice and rank tile, x and the gradient are read twice
(T then dA, the gradient's product with B then dB), the second time from L2; dw is read and written
once per rank tile, and the dx pair rows as in ``lora_grad.py`` (``profile.grad_traffic`` counts every
term). Its parallelism is one program per touched group: few, long programs when groups hold many blocks.
"""
import triton
import triton.language as tl

from .common import rank_tile, rows_at
from .lora_grad import GRAD_A, GRAD_B, GRAD_W, GRAD_X, add_dx, add_tile, da_part, db_part, group_row, \
    pair_weights, rank_step


@triton.jit
def _add_slabs(da_slab, db_slab, x_base, g_base, valid, weight, t, dt, offs_r, K, N, R, more, stride_xk,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, ACC: tl.constexpr,
               PREC: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, ATOMIC: tl.constexpr, GRADS: tl.constexpr):
    """One block's part of dB[l, e, :, r-tile] (dYᵀ T) and dA[l, e, r-tile, :] (dTᵀ X) of one slice, stored
    (the group's first block), added to what is there (``more``), or added atomically. t, dt are None
    for a rank tile without work: the slabs are zeroed."""
    c_ok = offs_r < R
    if GRAD_B & GRADS:
        for n0 in range(0, N, BLOCK_N):
            ns = n0 + tl.arange(0, BLOCK_N)
            mask = (ns < N)[:, None] & c_ok[None, :]
            if t is None:
                tl.store(db_slab + ns[:, None] * R + offs_r[None, :], tl.zeros((BLOCK_N, BLOCK_R), ACC), mask=mask)
            else:
                part = db_part(g_base + ns[None, :], valid, ns < N, weight, t, BLOCK_N, BLOCK_R, ACC, PREC,
                               MUL_ROUTED_WEIGHT)
                add_tile(db_slab + ns[:, None] * R + offs_r[None, :], part, mask, more, ATOMIC)
    if GRAD_A & GRADS:
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            mask = c_ok[:, None] & (ks < K)[None, :]
            if dt is None:
                tl.store(da_slab + offs_r[:, None] * K + ks[None, :], tl.zeros((BLOCK_R, BLOCK_K), ACC), mask=mask)
            else:
                part = da_part(dt, x_base + ks[None, :] * stride_xk, valid, ks < K, BLOCK_R, BLOCK_K, ACC, PREC)
                add_tile(da_slab + offs_r[:, None] * K + ks[None, :], part, mask, more, ATOMIC)


@triton.jit
def grad_one_shot_kernel(
    # ---- pointers
    x_ptr,             # [M, K] token rows or [P, K] pair rows; fp32/fp16 (fp64 on the interpreter)
    a0_ptr, a1_ptr,    # A of the launch's slices: [L, E, r, K], x's dtype (slice 0 twice when one is left)
    b0_ptr, b1_ptr,    # B of the launch's slices: [L, E, N, r], x's dtype
    g_ptr,             # [P, >= S*N] the output's gradient at the launch's first column, x's dtype, columns contiguous
    w_ptr,             # [P] routing weight of each pair, float (read with MUL_ROUTED_WEIGHT)
    dx_ptr, dw_ptr,    # [P, K] and [P], fp32 (fp64), contiguous, zeros before the first launch
    da_ptr, db_ptr,    # [NS, L, E, r, K] and [NS, L, E, N, r], dx's dtype, contiguous (ATOMIC: zeros before)
    sorted_pairs_ptr,  # [B*BM] int32 pair ids of the blocks
    groups_ptr,        # [G, 4] int32 group table: key (-1: none), rank, first, end; G = L*E, or B with ATOMIC
    group_blocks_ptr,  # [B] int32 block ids, group after group
    # ---- sizes
    num_pairs, pairs_per_row, K, N, R, E, num_keys,
    # ---- strides
    stride_xm, stride_xk,
    stride_al, stride_ae, stride_ar, stride_ak,
    stride_bl, stride_be, stride_bn, stride_br,
    stride_gm,
    # ---- meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    TWO_SLICES: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, ATOMIC: tl.constexpr, GRADS: tl.constexpr,
):
    """Program (group row): walks the row's blocks rank tile by rank tile; a block's T and dT stay in
    registers and feed its dx rows, dw, and the group's dA and dB slabs, which this program owns (it
    writes every element of them, zeros where there is no work) unless ATOMIC."""
    tl.static_assert(BLOCK_M >= 16, "tl.dot needs at least 16 rows: blocks of 16 pairs or more")
    PREC: tl.constexpr = "ieee" if x_ptr.dtype.element_ty.primitive_bitwidth >= 32 else "tf32"
    ACC: tl.constexpr = dx_ptr.dtype.element_ty
    CDT: tl.constexpr = x_ptr.dtype.element_ty
    g = tl.program_id(0)
    key, rank, first, end = group_row(groups_ptr, g)
    if key < 0:
        return                                           # an unused block (ATOMIC rows)
    a_off = (key // E) * stride_al + (key % E) * stride_ae
    b_off = (key // E) * stride_bl + (key % E) * stride_be
    NS: tl.constexpr = 2 if TWO_SLICES else 1
    for r0 in range(0, R, BLOCK_R):
        offs_r, r_ok = rank_tile(r0, rank, BLOCK_R)
        if (r0 < rank) & (first < end):
            for i in range(first, end):
                pairs, valid, x_rows = rows_at(sorted_pairs_ptr, tl.load(group_blocks_ptr + i) * BLOCK_M, num_pairs,
                                               pairs_per_row, BLOCK_M, True)
                x_base = x_ptr + x_rows.to(tl.int64)[:, None] * stride_xm
                g_base = g_ptr + pairs.to(tl.int64)[:, None] * stride_gm
                weight = pair_weights(w_ptr, pairs, valid, BLOCK_M, ACC, MUL_ROUTED_WEIGHT)
                t0, dt0, t1, dt1, dw = rank_step(
                    x_base, g_base, valid, weight, a0_ptr + a_off, a1_ptr + a_off, b0_ptr + b_off, b1_ptr + b_off,
                    offs_r, r_ok, K, N, stride_xk, stride_ar, stride_ak, stride_bn, stride_br, BLOCK_M, BLOCK_N,
                    BLOCK_K, BLOCK_R, ACC, PREC, TWO_SLICES, MUL_ROUTED_WEIGHT)
                if GRAD_W & GRADS:
                    add_tile(dw_ptr + pairs, dw, valid, True, False)
                for s in tl.static_range(NS):            # dA[s, l, e], dB[s, l, e]: this program's slabs
                    _add_slabs(da_ptr + (s * num_keys + key) * R * K, db_ptr + (s * num_keys + key) * N * R, x_base,
                               g_base + s * N, valid, weight, (t1 if s else t0).to(CDT), (dt1 if s else dt0).to(CDT),
                               offs_r, K, N, R, i > first, stride_xk, BLOCK_N, BLOCK_K, BLOCK_R, ACC, PREC,
                               MUL_ROUTED_WEIGHT, ATOMIC, GRADS)
                if GRAD_X & GRADS:
                    add_dx(dx_ptr + pairs.to(tl.int64)[:, None] * K, valid, dt0.to(CDT), dt1.to(CDT), a0_ptr + a_off,
                           a1_ptr + a_off, offs_r, r_ok, K, stride_ar, stride_ak, BLOCK_M, BLOCK_K, ACC, PREC,
                           TWO_SLICES)
                tl.debug_barrier()   # the next block adds to the slabs and rows other threads stored
        else:
            if not ATOMIC:           # no work in this rank tile: its slabs are zeros
                for s in tl.static_range(NS):
                    _add_slabs(da_ptr + (s * num_keys + key) * R * K, db_ptr + (s * num_keys + key) * N * R, x_ptr,
                               g_ptr, r_ok, 0.0, None, None, offs_r, K, N, R, False, stride_xk, BLOCK_N, BLOCK_K,
                               BLOCK_R, ACC, PREC, MUL_ROUTED_WEIGHT, ATOMIC, GRADS)
