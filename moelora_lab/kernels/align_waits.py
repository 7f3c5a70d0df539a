"""Routing metadata in one launch: count, scan and place (``kernels/align.py``) as the three steps of one
kernel, its programs waiting for each other between steps instead of for the end of a launch.

Shape legend: as ``kernels/align.py`` (n pairs, G groups, GP padded, NC chunks of SUB pairs, NT table parts
of BB blocks, NL lists); P programs per list.

A grid-wide wait is safe only when every program of the grid is running at once: a program that waits
for one not yet placed on the GPU, while holding the place that one needs, waits for ever. So the grid
is at most one program per SM for all lists (the launcher's rule, as a cooperative launch requires),
and each program loops over the work of its step: chunks c = pid, pid + P, ...; group columns; then
chunks and table parts.

  waits[lst, 0..2]  three int32 counters per list, zero between launches. A program adds 1 to counter
                    0 when its counts are written and waits until it reads P (every program of its
                    list got there); the same with counter 1 after the scan. Leaving, it adds 1 to
                    counter 2, and the last program to leave (it reads P - 1) sets all three back to
                    zero: every program has then passed both waits, so no one reads them again. The
                    counters survive a CUDA graph's replays with no reset launch: the launcher keeps
                    one set per stream, since two launches that share counters at the same time would
                    count each other's programs.

With ``STEP`` 1, 2 or 3 the kernel runs only that step and never waits: three launches of the same code
(how the Triton interpreter, which runs programs one after another, checks the steps with P > 1).
"""
import triton
import triton.language as tl

from .align import _count_chunk, _list, _place_item, _scan_columns


@triton.jit
def _grid_wait(counter_ptr, programs):
    """Arrive at ``counter`` and wait until all ``programs`` of this list have (a grid-wide barrier)."""
    tl.debug_barrier()                                      # this program's writes are all issued
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < programs:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()                                      # no thread reads before the wait is over


@triton.jit
def _leave(counters_ptr, programs):
    """Count this program out; the last one out sets the list's three counters back to zero (every
    program has passed both waits by then, so no one reads them again in this launch)."""
    left = tl.atomic_add(counters_ptr + 2, 1, sem="acq_rel", scope="gpu")
    if left == programs - 1:
        tl.atomic_xchg(counters_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(counters_ptr + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(counters_ptr + 2, 0, sem="relaxed", scope="gpu")


@triton.jit
def waits_kernel(
    topk_ids_ptr,      # [n] int32/int64 expert of each pair
    token_lora_ptr,    # [M] int32/int64 adapter of each token, -1 = none
    counts_ptr,        # [NL, NC, GP] int32 scratch: per-chunk counts, then pairs of the group in earlier chunks
    totals_ptr,        # [NL, GP] int32 scratch: pairs of each group
    ranks_ptr,         # [NL, n] int32 scratch (RANKS): each pair's place among its group's pairs in its chunk
    sorted_pairs_ptr,  # [sum of B*BS] int32 out: every list's pairs, end to end
    block_lora_ptr,    # [sum of B] int32 out: adapter of each block (0 for lists by expert), -1 = unused
    block_expert_ptr,  # [sum of B] int32 out: expert of each block, -1 = unused
    waits_ptr,         # [NL, 3] int32: the counters above (zero on entry, left at zero)
    n, top_k, E, num_chunks, num_table,
    G0, BS0, B0, P0, BA0, BY0, G1, BS1, B1, P1, BA1, BY1,
    SUB: tl.constexpr, GP: tl.constexpr, GB: tl.constexpr, CT: tl.constexpr, BB: tl.constexpr,
    BSP: tl.constexpr, RANKS: tl.constexpr, STEP: tl.constexpr = 0,
):
    """Program (p, list): chunks p, p + P, ... counted; group columns p, p + P, ... scanned; chunks and
    table parts p, p + P, ... placed; a grid-wide wait between the steps (STEP 0)."""
    pid, lst = tl.program_id(0), tl.program_id(1)
    programs = tl.num_programs(0)
    G, BS, num_blocks, pairs_at, blocks_at, by_adapter = _list(lst, G0, BS0, B0, P0, BA0, BY0,
                                                               G1, BS1, B1, P1, BA1, BY1)
    waits = waits_ptr + lst * 3
    if STEP == 0 or STEP == 1:
        for chunk in range(pid, num_chunks, programs):
            _count_chunk(topk_ids_ptr, token_lora_ptr, counts_ptr, ranks_ptr, chunk, lst, n, top_k, E, num_chunks,
                         G, by_adapter, SUB, GP, RANKS)
    if STEP == 0:
        _grid_wait(waits, programs)
    if STEP == 0 or STEP == 2:
        for part in range(pid, GP // GB, programs):
            _scan_columns(counts_ptr, totals_ptr, part, lst, num_chunks, CT, GB, GP)
    if STEP == 0:
        _grid_wait(waits + 1, programs)
    if STEP == 0 or STEP == 3:
        totals = tl.load(totals_ptr + lst * GP + tl.arange(0, GP), cache_modifier=".cg")
        for item in range(pid, num_chunks + num_table, programs):
            _place_item(topk_ids_ptr, token_lora_ptr, counts_ptr, ranks_ptr, sorted_pairs_ptr + pairs_at,
                        block_lora_ptr + blocks_at, block_expert_ptr + blocks_at, item, lst, totals, n, top_k, E,
                        num_chunks, G, BS, num_blocks, by_adapter, SUB, GP, BB, BSP, RANKS)
    if STEP == 0:
        _leave(waits, programs)
