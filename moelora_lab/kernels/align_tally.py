"""Routing metadata in two launches: the count adds each group's pairs to running totals as it goes, so no
scan launch is needed; each placing program sums, for its own pairs' groups, the counts of the chunks before it.

Shape legend: as ``kernels/align.py`` (n pairs, G groups, GP padded, NC chunks of SUB pairs, NT table parts
of BB blocks, NL lists).

  tally_kernel       (NC programs per list) counts[c, g] as ``count_kernel`` writes them, and
                     totals[g] += the chunk's pairs of group g (one atomic add per group present)
  place_sums_kernel  (NC + NT programs per list) first blocks from the totals; a chunk program sums
                     counts[0..c-1, g] of its pairs' groups ([CT, SUB] tiles of the counts) and scatters
                     its pairs; table programs write the table. Each program then takes a ticket, and
                     the last one (every other has read the totals) sets the totals and the ticket back
                     to zero, so the next launch finds them so: no fill launch, and a CUDA graph's
                     replays need none either. The launcher keeps one such state per stream, as two
                     launches that share it at the same time would add to each other's totals.
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .align import _blocks, _earlier, _group_of, _list, _table


@triton.jit
def tally_kernel(
    topk_ids_ptr,      # [n] int32/int64 expert of each pair
    token_lora_ptr,    # [M] int32/int64 adapter of each token, -1 = none
    counts_ptr,        # [NL, NC, GP] int32 out: pairs of each group in each chunk
    state_ptr,         # [NL, S] int32: totals in [:GP] (zero on entry), ticket at [S - 1]
    n, top_k, E, num_chunks, state_stride,
    G0, BS0, B0, P0, BA0, BY0, G1, BS1, B1, P1, BA1, BY1,
    SUB: tl.constexpr, GP: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (chunk, list): the chunk's count of each group, stored and added to the totals."""
    if PDL:
        gdc_launch_dependents()      # the placing kernel's programs may be placed now
    chunk, lst = tl.program_id(0), tl.program_id(1)
    G, _, _, _, _, by_adapter = _list(lst, G0, BS0, B0, P0, BA0, BY0, G1, BS1, B1, P1, BA1, BY1)
    ii = tl.arange(0, SUB)
    pairs = chunk * SUB + ii
    g = _group_of(topk_ids_ptr, token_lora_ptr, pairs, n, top_k, E, G, by_adapter)
    same = g[:, None] == g[None, :]                                               # [SUB, SUB] compare
    first_of_group = tl.sum((same & (ii[None, :] < ii[:, None])).to(tl.int32), 1) == 0
    count = tl.sum(same.to(tl.int32), 1)
    row = counts_ptr + (lst * num_chunks + chunk).to(tl.int64) * GP
    tl.store(row + tl.arange(0, GP), tl.zeros((GP,), dtype=tl.int32))
    tl.debug_barrier()
    tl.store(row + g, count, mask=first_of_group & (g < G))
    tl.atomic_add(state_ptr + lst * state_stride + g, count, mask=first_of_group & (g < G), sem="relaxed")


@triton.jit
def place_sums_kernel(
    topk_ids_ptr, token_lora_ptr,
    counts_ptr,        # [NL, NC, GP] int32 from tally_kernel
    state_ptr,         # [NL, S] int32 from tally_kernel: totals in [:GP]; left at zero
    sorted_pairs_ptr,  # [sum of B*BS] int32 out: every list's pairs, end to end
    block_lora_ptr,    # [sum of B] int32 out: adapter of each block (0 for lists by expert), -1 = unused
    block_expert_ptr,  # [sum of B] int32 out: expert of each block, -1 = unused
    n, top_k, E, num_chunks, num_programs, state_stride,
    G0, BS0, B0, P0, BA0, BY0, G1, BS1, B1, P1, BA1, BY1,
    SUB: tl.constexpr, GP: tl.constexpr, CT: tl.constexpr, BB: tl.constexpr, BSP: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:
        gdc_wait()                   # until the tally is done and its writes are seen
    pid, lst = tl.program_id(0), tl.program_id(1)
    G, BS, num_blocks, pairs_at, blocks_at, by_adapter = _list(lst, G0, BS0, B0, P0, BA0, BY0,
                                                               G1, BS1, B1, P1, BA1, BY1)
    state = state_ptr + lst * state_stride
    totals = tl.load(state + tl.arange(0, GP))
    blocks, first, used = _blocks(totals, tl.arange(0, GP), G, BS)
    if pid < num_chunks:
        ii = tl.arange(0, SUB)
        pairs = pid * SUB + ii
        g = _group_of(topk_ids_ptr, token_lora_ptr, pairs, n, top_k, E, G, by_adapter)
        safe = tl.where(g < G, g, 0)
        before = tl.zeros((SUB,), dtype=tl.int32)              # pairs of each pair's group in earlier chunks
        rows = tl.arange(0, CT)
        base = counts_ptr + lst.to(tl.int64) * num_chunks * GP
        for c0 in range(0, pid, CT):
            ok = (c0 + rows < pid)[:, None]
            before += tl.sum(tl.load(base + (c0 + rows)[:, None] * GP + safe[None, :], mask=ok, other=0), 0)
        pos = tl.gather(first, safe, 0) * BS + before + _earlier(g, ii)
        tl.store(sorted_pairs_ptr + pairs_at + pos, pairs, mask=g < G)
    else:
        _table(block_lora_ptr + blocks_at, block_expert_ptr + blocks_at, sorted_pairs_ptr + pairs_at,
               (pid - num_chunks) * BB + tl.arange(0, BB), first, totals, used, num_blocks, n, E, BS, GP, BSP)
    ticket = tl.atomic_add(state + state_stride - 1, 1, sem="acq_rel", scope="gpu")
    if ticket == num_programs - 1:                            # the last: every program has read the totals
        tl.store(state + tl.arange(0, GP), tl.zeros((GP,), dtype=tl.int32))
        tl.atomic_xchg(state + state_stride - 1, 0, sem="relaxed", scope="gpu")
