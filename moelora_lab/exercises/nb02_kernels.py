"""Traffic puzzles of notebook 02: a simplified shrink and expand of the two-kernel path that give the
right answer but read their weight tile once per row; the learner makes each block read it once.

Shape legend: M tokens, k top-k, P = M*k pairs, G (adapter, expert) groups, r rank, K in, N out;
BLOCK_M pairs per block, all of one group (g = block_group[block]). fp32 here (4 bytes).
"""
from __future__ import annotations

import torch

from .core import Exercise, Result, compare, out_of_bounds_result, register
from .memory import count_memory, excess


def _traffic_result(ex_id: str, mem, name: str, what: str, target: int, per_block: str, extra=()) -> Result:
    """Pass when the bytes loaded from ``name`` are at most ``target`` (each block reads its tile once);
    else name the tensor and how many times each block read its tile."""
    got = mem.loaded(name)
    details = (f"{what} loaded {got:,} B; target {target:,} B = {per_block}", *extra,
               "all loads and stores:", *mem.report().splitlines())
    cause = excess(mem, name, "load", target, per=" per block")
    if cause:
        return Result(False, f"{ex_id}: right answer, but {cause}", details)
    return Result(True, f"{ex_id}: right answer, and each block reads its {what} tile once", details)


# ---- 02.shrink_once ---------------------------------------------------------------------------------

SHRINK = dict(M=32, k=2, K=64, r=16, G=3, BLOCK_M=16, BLOCK_K=32)


def _shrink_case(seed: int = 1):
    s = SHRINK
    g = torch.Generator().manual_seed(seed)
    P = s["M"] * s["k"]
    x = torch.randn(s["M"], s["K"], generator=g)                                        # [M, K]
    a = torch.randn(s["G"], s["r"], s["K"], generator=g)                                # [G, r, K]
    sorted_pairs = torch.randperm(P, generator=g).to(torch.int32)                       # [P]
    block_group = torch.randint(0, s["G"], (P // s["BLOCK_M"],), generator=g, dtype=torch.int32)
    return x, a, sorted_pairs, block_group


def _shrink_reference(x, a, sorted_pairs, block_group):
    s = SHRINK
    pairs = sorted_pairs.long()
    groups = block_group.repeat_interleave(s["BLOCK_M"]).long()                         # group of each sorted slot
    t = torch.empty(len(pairs), s["r"])
    t[pairs] = torch.einsum("pk,prk->pr", x[pairs // s["k"]], a[groups])
    return t


def _grade_shrink(kernel) -> Result:
    s = SHRINK
    x, a, sorted_pairs, block_group = _shrink_case()
    P, blocks = s["M"] * s["k"], s["M"] * s["k"] // s["BLOCK_M"]
    t = torch.full((P, s["r"]), float("nan"))                                          # unwritten rows stay NaN
    with count_memory(x=x, a=a, sorted_pairs=sorted_pairs, block_group=block_group, t=t) as mem:
        kernel[(blocks,)](x, a, sorted_pairs, block_group, t, s["K"], TOP_K=s["k"], R=s["r"],
                          BLOCK_M=s["BLOCK_M"], BLOCK_K=s["BLOCK_K"])
    if (oob := out_of_bounds_result("02.shrink_once", mem)):
        return oob
    wrong = compare("02.shrink_once", t, _shrink_reference(x, a, sorted_pairs, block_group), what="T [P, r]",
                    row_name="pair")
    if wrong:
        return wrong
    target = blocks * s["r"] * s["K"] * 4
    return _traffic_result("02.shrink_once", mem, "a", "A", target,
                           f"{blocks} blocks x r {s['r']} x K {s['K']} x 4 B (each block reads its A tile once)")


SHRINK_STUB = '''\
import triton
import triton.language as tl


@triton.jit
def simple_shrink_kernel(x_ptr, a_ptr, sorted_pairs_ptr, block_group_ptr, t_ptr, K,
                         TOP_K: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    # T[p, :] = x[p // TOP_K] @ A[g].T for the BLOCK_M pairs p of this block, g = block_group[block].
    # x [M, K], A [G, R, K], T [P, R] fp32, all row-major; sorted_pairs [P] int32 (the pairs of block b
    # are sorted_pairs[b * BLOCK_M : (b + 1) * BLOCK_M]); block_group [P / BLOCK_M] int32; K % BLOCK_K == 0.
    # Right answer, too many bytes: every row reloads the A tile. Make each block read A once.
    block = tl.program_id(0)
    g = tl.load(block_group_ptr + block)
    ranks = tl.arange(0, R)
    for i in range(BLOCK_M):
        pair = tl.load(sorted_pairs_ptr + block * BLOCK_M + i)
        acc = tl.zeros((R,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x_row = tl.load(x_ptr + (pair // TOP_K) * K + ks)                           # [BLOCK_K]
            a_tile = tl.load(a_ptr + g * R * K + ranks[:, None] * K + ks[None, :])      # [R, BLOCK_K]
            acc += tl.sum(a_tile * x_row[None, :], axis=1)                              # [R]
        tl.store(t_ptr + pair * R + ranks, acc)
'''

# ---- 02.expand_once ---------------------------------------------------------------------------------

EXPAND = dict(P=64, N=96, r=16, G=3, BLOCK_M=16, BLOCK_N=32)


def _expand_case(seed: int = 0):
    e = EXPAND
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(e["P"], e["r"], generator=g)                                        # [P, r]
    b = torch.randn(e["G"], e["N"], e["r"], generator=g)                                # [G, N, r]
    block_group = torch.randint(0, e["G"], (e["P"] // e["BLOCK_M"],), generator=g, dtype=torch.int32)
    return t, b, block_group


def _expand_reference(t, b, block_group):
    rows = block_group.repeat_interleave(EXPAND["BLOCK_M"]).long()
    return torch.einsum("pr,pnr->pn", t, b[rows])


def _grade_expand(kernel) -> Result:
    import triton
    e = EXPAND
    t, b, block_group = _expand_case()
    out = torch.full((e["P"], e["N"]), float("nan"))                                   # unwritten rows stay NaN
    blocks, n_tiles = e["P"] // e["BLOCK_M"], triton.cdiv(e["N"], e["BLOCK_N"])
    with count_memory(t=t, b=b, block_group=block_group, out=out) as mem:
        kernel[(blocks, n_tiles)](t, b, block_group, out, e["N"], e["r"], BLOCK_M=e["BLOCK_M"], BLOCK_N=e["BLOCK_N"])
    if (oob := out_of_bounds_result("02.expand_once", mem)):
        return oob
    wrong = compare("02.expand_once", out, _expand_reference(t, b, block_group), what="out [P, N]")
    if wrong:
        return wrong
    target = blocks * e["N"] * e["r"] * 4          # the blocks' N tiles together read one [N, r] B each
    t_times = mem.loaded("t") / max(mem.unique_loaded("t"), 1)
    note = (f"T is read {t_times:.3g}x, once per N tile ({n_tiles} tiles of {e['BLOCK_N']}): the re-read that "
            f"section 5 finds at large M")
    return _traffic_result("02.expand_once", mem, "b", "B", target,
                           f"{blocks} blocks x N {e['N']} x r {e['r']} x 4 B (each block reads its B tile once)",
                           extra=(note,))


EXPAND_STUB = '''\
import triton
import triton.language as tl


@triton.jit
def simple_expand_kernel(t_ptr, b_ptr, block_group_ptr, out_ptr, N, R: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # out[p, n] = sum_r T[p, r] * B[g, n, r] for the BLOCK_M rows p of this block, g = block_group[block].
    # T [P, R], B [G, N, R], out [P, N] fp32, all row-major; block_group [P / BLOCK_M] int32.
    # Program (block, N tile). Right answer, too many bytes: it reloads the B tile for every row.
    # Make it read B once per block.
    block, pid_n = tl.program_id(0), tl.program_id(1)
    g = tl.load(block_group_ptr + block)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, R)
    for i in range(BLOCK_M):
        row = block * BLOCK_M + i
        t_row = tl.load(t_ptr + row * R + ranks)                                      # [R]
        b_tile = tl.load(b_ptr + g * N * R + cols[:, None] * R + ranks[None, :],
                         mask=cols[:, None] < N, other=0.0)                            # [BLOCK_N, R]
        acc = tl.sum(b_tile * t_row[None, :], axis=1)                                 # [BLOCK_N]
        tl.store(out_ptr + row * N + cols, acc, mask=cols < N)
'''

register(
    Exercise("02.shrink_once", "02_hbm_round_trip", "traffic", "make the shrink read each A tile once per block",
             "simple_shrink_kernel", SHRINK_STUB, _grade_shrink,
             hint="Every pair of a block uses the same A[g]. Load the block's pair ids as one vector, then per "
                  "K step load an x tile [BLOCK_M, BLOCK_K] (rows pairs // TOP_K) and an A tile [BLOCK_K, R] "
                  "(A[g] read transposed: offset ks[:, None] + ranks[None, :] * K), accumulate "
                  "tl.dot(x_tile, a_tile) into a [BLOCK_M, R] accumulator, and store it in one tl.store."),
    Exercise("02.expand_once", "02_hbm_round_trip", "traffic", "make the expand read each B tile once per block",
             "simple_expand_kernel", EXPAND_STUB, _grade_expand,
             hint="Every row of a block uses the same B tile. Load T's [BLOCK_M, R] tile and B's [BLOCK_N, R] "
                  "tile once, before any loop, and multiply them with tl.dot(t_tile, tl.trans(b_tile)); store "
                  "the [BLOCK_M, BLOCK_N] result in one tl.store."),
)
