"""Exercises of notebook 03 (keeping the rank intermediate T in registers).

Shape legend: P pairs (rows), G groups (adapter, expert), r rank, K in, N out; BLOCK_M rows per
program, BLOCK_R rank columns per register tile. Kernels here are fp32 throughout.
"""
from __future__ import annotations

import re

import torch

from .core import Exercise, Result, compare, out_of_bounds_result, predict_result, register
from .memory import count_memory, excess

# ---- 03.registers: predict, then reveal next to the compiled kernel ---------------------------------

REGISTERS = dict(block_m=64, rank=256, num_warps=4)


def _grade_registers(guess) -> Result:
    from ..lesson import source
    from ..plots.bench import select
    from ..plots.registers import REGISTER_CAP, THREADS_PER_WARP, accumulator_registers, rank_tile
    from ..results import load

    bm, r, warps = REGISTERS["block_m"], REGISTERS["rank"], REGISTERS["num_warps"]
    truth = accumulator_registers(bm, r, warps)
    res = predict_result("03.registers", guess, truth, rel=0.0, unit=" registers",
                         explain=f"BLOCK_M x BLOCK_R / (32 x num_warps) = {bm} x {r} / ({THREADS_PER_WARP} x {warps}) "
                                 f"= {truth} fp32 values per thread, for T alone")
    rows = load("registers")
    one, tiled = (select(rows, rank=r, block_m=bm, max_block_r=mbr)[0] for mbr in (512, 128))
    width, tiles = rank_tile(r, 128)
    return Result(res.passed, res.message, res.details + (
        f"the compiled one-shot kernel ({source(rows)}), BLOCK_M = {bm}, r = {r}:",
        f"  one tile of {r} columns: {one['n_regs']} registers (the cap is {REGISTER_CAP}) + {one['n_spills']} "
        f"spilled per thread",
        f"  {tiles} rank tiles of {width}: T needs {accumulator_registers(bm, width, warps)}, the kernel holds "
        f"{tiled['n_regs']} registers, {tiled['n_spills']} spilled"))


REGISTERS_STUB = '''\
# T as ONE fp32 tile for rank r = 256 at BLOCK_M = 64, spread evenly over 4 warps of 32 threads:
# how many 32-bit registers does each thread hold for T alone? Write your number, then run the check.
registers_guess = None
'''

# ---- shared by the two kernel exercises: one block of rows per program, each block one group ---------


def _lora_case(P, K, N, R, G, BLOCK_M, seed, pad=0):
    """x [P, K], A [G, R, K], B [G, N, R] fp32 and block_group [P / BLOCK_M] int32. With ``pad``, A and B
    sit at the front of a buffer ``pad`` values longer, filled with 1e4: a read past their end is no crash
    but a large error."""
    g = torch.Generator().manual_seed(seed)

    def weights(*shape):
        n = torch.Size(shape).numel()
        buf = torch.full((n + pad,), 1e4)
        buf[:n] = torch.randn(n, generator=g) / shape[-1] ** 0.5
        return buf[:n].view(*shape)

    x = torch.randn(P, K, generator=g)
    a, b = weights(G, R, K), weights(G, N, R)
    block_group = torch.randint(0, G, (P // BLOCK_M,), generator=g, dtype=torch.int32)
    return x, a, b, block_group


def _lora_reference(x, a, b, block_group, BLOCK_M):
    """out [P, N] = (x @ A[g].T) @ B[g].T row by row, g the group of the row's block (float64, then fp32)."""
    g = block_group.repeat_interleave(BLOCK_M).long()
    t = torch.einsum("pk,prk->pr", x.double(), a.double()[g])
    return torch.einsum("pr,pnr->pn", t, b.double()[g]).float()


# ---- 03.keep_t_out: a traffic puzzle ---------------------------------------------------------------

KEEP = dict(P=64, K=64, N=96, R=16, G=3, BLOCK_M=16, BLOCK_N=32, BLOCK_K=32)


def _grade_keep(kernel) -> Result:
    e = KEEP
    x, a, b, block_group = _lora_case(e["P"], e["K"], e["N"], e["R"], e["G"], e["BLOCK_M"], seed=3)
    t = torch.full((e["P"], e["R"]), float("nan"))            # the scratch buffer a fused kernel leaves alone
    out = torch.full((e["P"], e["N"]), float("nan"))
    blocks = e["P"] // e["BLOCK_M"]
    with count_memory(x=x, a=a, b=b, block_group=block_group, t=t, out=out) as mem:
        kernel[(blocks,)](x, a, b, block_group, t, out, e["K"], e["N"], R=e["R"], BLOCK_M=e["BLOCK_M"],
                          BLOCK_N=e["BLOCK_N"], BLOCK_K=e["BLOCK_K"])
    if (oob := out_of_bounds_result("03.keep_t_out", mem)):
        return oob
    wrong = compare("03.keep_t_out", out, _lora_reference(x, a, b, block_group, e["BLOCK_M"]), what="out [P, N]")
    if wrong:
        return wrong
    out_bytes, x_bytes, a_bytes = out.numel() * 4, x.numel() * 4, blocks * e["R"] * e["K"] * 4
    details = ("all loads and stores:", *mem.report().splitlines())
    t_bytes = t.numel() * 4
    t_causes = [c for c in (excess(mem, "t", "store", t_bytes, expected=0), excess(mem, "t", "load", t_bytes,
                                                                                   expected=0)) if c]
    if t_causes:
        return Result(False, f"03.keep_t_out: right answer, but T makes a round trip through HBM: "
                             + "; ".join(t_causes), details)
    out_causes = [c for c in (excess(mem, "out", "store", out_bytes), excess(mem, "out", "load", out_bytes,
                                                                              expected=0)) if c]
    if out_causes or mem.unique_stored("out") != out_bytes:
        return Result(False, f"03.keep_t_out: right answer and T stays in registers, but "
                             + ("; ".join(out_causes) or f"out is written at {mem.unique_stored('out'):,} distinct "
                                f"bytes of its {out_bytes:,}")
                             + f" (out is P {e['P']} x N {e['N']} x 4 B)", details)
    shrink = [c for c in (excess(mem, "x", "load", x_bytes), excess(mem, "a", "load", a_bytes, per=" per block"))
              if c]
    if shrink:
        return Result(False, f"03.keep_t_out: T stays out of HBM, but the shrink runs more than once per block: "
                             + "; ".join(shrink) + "; compute T once, before the N loop", details)
    return Result(True, "03.keep_t_out: right answer, T never touches HBM (0 B of t loaded or stored) and out is "
                        f"stored once ({out_bytes:,} B)", details)


KEEP_STUB = '''\
import triton
import triton.language as tl


@triton.jit
def fused_lora_kernel(x_ptr, a_ptr, b_ptr, block_group_ptr, t_ptr, out_ptr, K, N, R: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # out[p, :] = (x[p, :] @ A[g]^T) @ B[g]^T for the BLOCK_M rows p of this block, g = block_group[block].
    # x [P, K], A [G, R, K], B [G, N, R], out [P, N], scratch t [P, R]: fp32, row-major;
    # block_group [P / BLOCK_M] int32; K is a multiple of BLOCK_K.
    # Right answer, too many bytes: T goes out to the scratch buffer t and comes back for every N tile.
    # Keep T in registers: t_ptr must see no load and no store, and out is stored once.
    block = tl.program_id(0)
    g = tl.load(block_group_ptr + block)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    ranks = tl.arange(0, R)
    offs_k = tl.arange(0, BLOCK_K)
    # shrink: T [BLOCK_M, R] = x[rows] @ A[g]^T, an fp32 accumulator
    t = tl.zeros((BLOCK_M, R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        xk = tl.load(x_ptr + rows[:, None] * K + ks[None, :])                          # [BLOCK_M, BLOCK_K]
        ak = tl.load(a_ptr + g * R * K + ranks[None, :] * K + ks[:, None])             # [BLOCK_K, R]
        t = tl.dot(xk, ak, t)
    tl.store(t_ptr + rows[:, None] * R + ranks[None, :], t)                           # T out to HBM ...
    tl.debug_barrier()                                  # every thread's part of T is stored before any reads
    # expand: out[rows, n-tile] = T @ B[g, n-tile]^T
    for n0 in range(0, N, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        t_tile = tl.load(t_ptr + rows[:, None] * R + ranks[None, :])                  # ... and back, per N tile
        bt = tl.load(b_ptr + g * N * R + cols[None, :] * R + ranks[:, None],
                     mask=cols[None, :] < N, other=0.0)                                # [R, BLOCK_N]
        acc = tl.dot(t_tile, bt)                                                       # [BLOCK_M, BLOCK_N]
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc, mask=cols[None, :] < N)
'''

# ---- 03.rank_tiles: complete the rank-tile loop ------------------------------------------------------

TILES = dict(P=64, K=64, N=96, G=3, BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, BLOCK_R=32, ranks=(16, 40, 72))


def _grade_tiles(kernel) -> Result:
    e = TILES
    lines, wrong_at, first_wrong = [], [], None
    for i, R in enumerate(e["ranks"]):
        pad = e["BLOCK_R"] * max(e["K"], e["N"])              # a read past A or B: a wrong answer, not a crash
        x, a, b, block_group = _lora_case(e["P"], e["K"], e["N"], R, e["G"], e["BLOCK_M"], seed=30 + i, pad=pad)
        out = torch.full((e["P"], e["N"]), float("nan"))
        kernel[(e["P"] // e["BLOCK_M"],)](x, a, b, block_group, out, e["K"], e["N"], R, BLOCK_M=e["BLOCK_M"],
                                          BLOCK_N=e["BLOCK_N"], BLOCK_K=e["BLOCK_K"], BLOCK_R=e["BLOCK_R"])
        tiles, last = -(-R // e["BLOCK_R"]), R - (R - 1) // e["BLOCK_R"] * e["BLOCK_R"]
        case = f"r = {R}: " + (f"one rank tile of BLOCK_R = {e['BLOCK_R']}, {R} columns used" if tiles == 1 else
                               f"{tiles} rank tiles of BLOCK_R = {e['BLOCK_R']}, {last} columns used in the last")
        wrong = compare("03.rank_tiles", out, _lora_reference(x, a, b, block_group, e["BLOCK_M"]), what="out [P, N]")
        if wrong is None:
            lines.append(f"{case}: right")
            continue
        nan = bool(out.isnan().any())
        lines.append(f"{case}: " + re.sub(r" \(and \d+ more\)", "", wrong.message.split(": ", 1)[1])
                     + ("; it holds NaN: never written, or read back on the first rank tile (out starts as NaN)"
                        if nan else "; one tile, as in the stub: look at the rank masks first" if tiles == 1 else ""))
        wrong_at.append(R)
        first_wrong = first_wrong or (R, wrong)
    if first_wrong is None:
        return Result(True, "03.rank_tiles: right at every rank, one BLOCK_R-wide tile of T at a time", tuple(lines))
    right_at = [R for R in e["ranks"] if R not in wrong_at]
    return Result(False, f"03.rank_tiles: out is wrong at r = {', '.join(map(str, wrong_at))}"
                         + (f" (right at r = {', '.join(map(str, right_at))})" if right_at else ""),
                  (*lines, f"first wrong rows at r = {first_wrong[0]}:", *first_wrong[1].details))


TILES_STUB = '''\
import triton
import triton.language as tl


@triton.jit
def rank_tiles_kernel(x_ptr, a_ptr, b_ptr, block_group_ptr, out_ptr, K, N, R,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_R: tl.constexpr):
    # out[p, :] = (x[p, :] @ A[g]^T) @ B[g]^T for the BLOCK_M rows p of this block, g = block_group[block],
    # for any rank R, holding T BLOCK_R rank columns at a time.
    # x [P, K], A [G, R, K], B [G, N, R], out [P, N]: fp32, row-major; block_group [P / BLOCK_M] int32.
    # K is a multiple of BLOCK_K; R need not be a multiple of BLOCK_R. out starts full of NaN.
    # Partial: this handles the first rank tile only, so it is right only for R <= BLOCK_R.
    # Make it loop over every rank tile: out += (x A_tile^T) B_tile^T.
    block = tl.program_id(0)
    g = tl.load(block_group_ptr + block)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    r0 = 0                                             # first rank column of this tile
    ranks = r0 + tl.arange(0, BLOCK_R)
    r_ok = ranks < R
    # shrink: T tile [BLOCK_M, BLOCK_R] = x[rows] @ A[g, ranks]^T (rank columns past R are 0)
    t = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        xk = tl.load(x_ptr + rows[:, None] * K + ks[None, :])                          # [BLOCK_M, BLOCK_K]
        ak = tl.load(a_ptr + g * R * K + ranks[None, :] * K + ks[:, None],
                     mask=r_ok[None, :], other=0.0)                                     # [BLOCK_K, BLOCK_R]
        t = tl.dot(xk, ak, t)
    # expand: out[rows, n-tile] = T tile @ B[g, n-tile, ranks]^T
    for n0 in range(0, N, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        n_ok = cols < N
        bt = tl.load(b_ptr + g * N * R + cols[None, :] * R + ranks[:, None],
                     mask=r_ok[:, None] & n_ok[None, :], other=0.0)                    # [BLOCK_R, BLOCK_N]
        acc = tl.dot(t, bt)                                                            # [BLOCK_M, BLOCK_N]
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc, mask=n_ok[None, :])
'''

register(
    Exercise("03.registers", "03_register_resident_rank", "predict", "registers per thread of one T tile",
             "registers_guess", REGISTERS_STUB, _grade_registers,
             hint="The 64 x 256 fp32 values of T are shared evenly by every thread of the program: 4 warps of 32 "
                  "threads each. One fp32 value takes one 32-bit register."),
    Exercise("03.keep_t_out", "03_register_resident_rank", "traffic", "keep T in registers, not in a scratch buffer",
             "fused_lora_kernel", KEEP_STUB, _grade_keep,
             hint="Follow T from the end of the shrink loop to its use in the N loop. Where is it at each step: in "
                  "the program's registers, or in HBM? The check counts every byte of t_ptr and expects none; ask "
                  "which lines move T to HBM and back, and what the N loop already has in hand."),
    Exercise("03.rank_tiles", "03_register_resident_rank", "code", "loop over rank tiles of BLOCK_R columns",
             "rank_tiles_kernel", TILES_STUB, _grade_tiles,
             hint="Replace `r0 = 0` by `for r0 in range(0, R, BLOCK_R):` and indent everything below it into the "
                  "loop; r_ok already masks the columns past R of the last tile. Before the store, add what the "
                  "earlier tiles stored, but not on the first tile (out starts as NaN): `if r0 > 0:` load the same "
                  "out pointers (mask n_ok, other=0.0) and add them to acc. On a GPU, end each rank tile with "
                  "`tl.debug_barrier()`, as the notebook's kernel does, so that the next tile reads what this one "
                  "stored."),
)
