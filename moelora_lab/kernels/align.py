"""Routing metadata on the device: a counting sort of pairs into blocks, one or two block lists per call.

Shape legend: M tokens, k top-k, E experts, L adapters, n = M*k pairs, G groups of a list (E when
pairs are grouped by expert, L*E when by (adapter, expert): g = l*E + e; g = G collects pairs left
out), NP = next power of two >= n, GP = next power of two >= G, SUB pairs per chunk, NC chunks,
B blocks of BS pairs, NL lists.

A layer needs two lists from the same routing (the base GEMM's, by expert, and the LoRA's, by
(adapter, expert), each with its own block size), so every kernel takes a list axis and builds
both in the same launches. The lists live end to end in one pairs buffer and one block table;
each kernel gets every list's G, BS, B, pairs offset, block offset and whether it groups by
adapter as scalars (G0 .. BY1: no descriptor to copy, so the launches can be captured in a CUDA
graph). Pairs of a group stay ascending, as in the PyTorch spec.

Few pairs (n <= 256): one launch, one program per list.
  sort_kernel   sorts the keys g*NP + p in registers (``tl.sort``); a pair's place in its group is
                its distance from the group's first key, the group's first block an exclusive sum
                of blocks over the group starts; then it writes the sentinel n everywhere, the pairs,
                and each group's blocks in the table.
Up to about 512 pairs: one launch, chunks of SUB pairs in parallel.
  recount_kernel (NC + NT programs per list) every program counts the pairs of each group itself
                (``tl.histogram`` over all n pairs; a chunk program also over those before its chunk),
                then places its chunk's pairs or writes its part of the table as place_kernel does:
                no program waits for another, at the price of reading all n pairs in every program.
Many pairs: three launches, chunks of SUB pairs in parallel.
  count_kernel  (NC programs per list)    counts[c, g] = pairs of group g in chunk c ([SUB, SUB] compare;
                    with RANKS each pair's place in its chunk is kept for place_kernel, and a group's
                    count is the atomic max of its pairs' places + 1)
  scan_kernel   (GP/GB programs per list) counts[c, g] -> pairs of group g before chunk c, totals[g]
  place_kernel  (NC + NT programs per list) chunk programs scatter their pairs to
                    sorted_pairs[first_block[g]*BS + before[g] + rank in chunk] = p,
                table programs write the table (a block's group by a binary search over the groups'
                first blocks) and the sentinel n into every padding slot.
  With ``PDL`` (programmatic dependent launch, Hopper on) the three chain on the GPU: count lets
  the scan's programs be placed as it starts, the scan lets the place's be placed as it ends, and
  each waits (``gdc_wait``) until the kernel before it has finished and its writes are seen.
The result is identical to :func:`moelora_lab.routing.block_list`.
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _list(lst, G0, BS0, B0, P0, BA0, BY0, G1, BS1, B1, P1, BA1, BY1):
    """This list's G, BS, B, pairs offset, block offset, by-adapter flag (two lists at most)."""
    first = lst == 0
    return (tl.where(first, G0, G1), tl.where(first, BS0, BS1), tl.where(first, B0, B1), tl.where(first, P0, P1),
            tl.where(first, BA0, BA1), tl.where(first, BY0, BY1))


@triton.jit
def _group_of(topk_ids_ptr, token_lora_ptr, pairs, n, top_k, E, G, by_adapter):
    """Group of each pair (G for pairs past n and for tokens without an adapter)."""
    valid = pairs < n
    expert = tl.load(topk_ids_ptr + pairs, mask=valid, other=0).to(tl.int32)
    lora = tl.load(token_lora_ptr + pairs // top_k, mask=valid & (by_adapter != 0), other=0).to(tl.int32)
    return tl.where(valid & (lora >= 0), lora * E + expert, G)


@triton.jit
def _earlier(g, ii):
    """For each pair of a chunk, how many pairs before it in the chunk share its group ([SUB, SUB] compare)."""
    return tl.sum(((g[:, None] == g[None, :]) & (ii[None, :] < ii[:, None])).to(tl.int32), 1)


@triton.jit
def _blocks(totals, groups, G, BS):
    """Blocks of each group, its first block (an exclusive sum) and the blocks used, from [GP] counts."""
    blocks = tl.where(groups < G, (totals + BS - 1) // BS, 0)
    return blocks, tl.cumsum(blocks, 0) - blocks, tl.sum(blocks, 0)


@triton.jit
def _scatter(sorted_pairs_ptr, pairs, g, G, BS, first, before, earlier):
    """Pair p goes after its group's pairs in earlier chunks (``before``) and earlier in its own."""
    safe = tl.where(g < G, g, 0)
    pos = tl.gather(first, safe, 0) * BS + tl.gather(before, safe, 0) + earlier
    tl.store(sorted_pairs_ptr + pos, pairs, mask=g < G)


@triton.jit
def _table(block_lora_ptr, block_expert_ptr, sorted_pairs_ptr, b, first, totals, used, num_blocks, n, E, BS,
           GP: tl.constexpr, BSP: tl.constexpr):
    """Blocks b: the group of each (the last group whose first block is at or before it: a binary search
    over the ascending ``first``), and the sentinel n in every slot past its group's pairs."""
    mine = tl.zeros_like(b)                    # groups that start at or before b, minus one
    step = GP // 2
    while step > 0:
        take = tl.gather(first, mine + step, 0) <= b
        mine = tl.where(take, mine + step, mine)
        step = step // 2
    b_first, b_total = tl.gather(first, mine, 0), tl.gather(totals, mine, 0)
    ok = b < num_blocks
    live = b < used
    tl.store(block_lora_ptr + b, tl.where(live, mine // E, -1), mask=ok)
    tl.store(block_expert_ptr + b, tl.where(live, mine % E, -1), mask=ok)
    s = tl.arange(0, BSP)
    slot = (b - b_first)[:, None] * BS + s[None, :]                                # [BB, BSP] place in group
    pad = ~live[:, None] | (slot >= b_total[:, None])
    tl.store(sorted_pairs_ptr + b[:, None] * BS + s[None, :], n + 0 * slot,
             mask=ok[:, None] & (s < BS)[None, :] & pad)


@triton.jit
def count_kernel(
    # ---- pointers
    topk_ids_ptr,      # [n] int32/int64 expert of each pair
    token_lora_ptr,    # [M] int32/int64 adapter of each token, -1 = none
    counts_ptr,        # [NL, NC, GP] int32 out
    ranks_ptr,         # [NL, n] int32 out (RANKS): each pair's place among its group's pairs in its chunk
    # ---- sizes (then each list's G, BS, B, pairs offset, block offset and by-adapter flag: ``_list``)
    n, top_k, E, num_chunks,
    G0, BS0, B0, P0, BA0, BY0, G1, BS1, B1, P1, BA1, BY1,
    # ---- meta-parameters
    SUB: tl.constexpr, GP: tl.constexpr, RANKS: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (chunk, list): how many pairs of each group chunk c holds (zero for the others)."""
    if PDL:
        gdc_launch_dependents()      # the next kernel's programs may be placed now
    chunk, lst = tl.program_id(0), tl.program_id(1)
    G, _, _, _, _, by_adapter = _list(lst, G0, BS0, B0, P0, BA0, BY0, G1, BS1, B1, P1, BA1, BY1)
    ii = tl.arange(0, SUB)
    pairs = chunk * SUB + ii
    g = _group_of(topk_ids_ptr, token_lora_ptr, pairs, n, top_k, E, G, by_adapter)
    earlier = _earlier(g, ii)                                                      # [SUB, SUB] compare
    row = counts_ptr + (lst * num_chunks + chunk).to(tl.int64) * GP
    tl.store(row + tl.arange(0, GP), tl.zeros((GP,), dtype=tl.int32))
    tl.debug_barrier()
    if RANKS:
        # a group's count is its last pair's place + 1: the largest, so an atomic max leaves it
        tl.store(ranks_ptr + lst.to(tl.int64) * n + pairs, earlier, mask=pairs < n)
        tl.atomic_max(row + g, earlier + 1, mask=g < G)
    else:
        count = tl.sum((g[:, None] == g[None, :]).to(tl.int32), 1)                 # [SUB, SUB] compare
        tl.store(row + g, count, mask=(earlier == 0) & (g < G))


@triton.jit
def scan_kernel(
    # ---- pointers
    counts_ptr,        # [NL, NC, GP] int32 in: per-chunk counts; out: pairs of the group in earlier chunks
    totals_ptr,        # [NL, GP] int32 out: pairs of each group
    # ---- sizes
    num_chunks,
    # ---- meta-parameters
    CT: tl.constexpr, GB: tl.constexpr, GP: tl.constexpr, PDL: tl.constexpr = False,
):
    if PDL:
        gdc_wait()                   # until the previous kernel is done and its writes are seen
    lst = tl.program_id(1)
    cols = tl.program_id(0) * GB + tl.arange(0, GB)
    rows = tl.arange(0, CT)
    carry = tl.zeros((GB,), dtype=tl.int32)
    base = counts_ptr + lst.to(tl.int64) * num_chunks * GP
    for c0 in range(0, num_chunks, CT):
        ptrs = base + (c0 + rows)[:, None] * GP + cols[None, :]
        ok = (c0 + rows < num_chunks)[:, None]
        cnt = tl.load(ptrs, mask=ok, other=0)                                      # [CT, GB]
        incl = tl.cumsum(cnt, 0)
        tl.store(ptrs, incl - cnt + carry[None, :], mask=ok)
        carry += tl.sum(cnt, 0)
    tl.store(totals_ptr + lst * GP + cols, carry)
    if PDL:
        gdc_launch_dependents()      # only now: placing programs that wait beside the scan slowed it on the H200


@triton.jit
def place_kernel(
    # ---- pointers
    topk_ids_ptr,      # [n] int32/int64 expert of each pair
    token_lora_ptr,    # [M] int32/int64 adapter of each token, -1 = none
    counts_ptr,        # [NL, NC, GP] int32 from scan_kernel
    totals_ptr,        # [NL, GP] int32 from scan_kernel
    ranks_ptr,         # [NL, n] int32 from count_kernel (RANKS)
    sorted_pairs_ptr,  # [sum of B*BS] int32 out: every list's pairs, end to end
    block_lora_ptr,    # [sum of B] int32 out: adapter of each block (0 for lists by expert), -1 = unused
    block_expert_ptr,  # [sum of B] int32 out: expert of each block, -1 = unused
    # ---- sizes (then each list's G, BS, B, pairs offset, block offset and by-adapter flag: ``_list``)
    n, top_k, E, num_chunks,
    G0, BS0, B0, P0, BA0, BY0, G1, BS1, B1, P1, BA1, BY1,
    # ---- meta-parameters
    SUB: tl.constexpr, GP: tl.constexpr, BB: tl.constexpr, BSP: tl.constexpr, RANKS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:
        gdc_wait()                   # until the previous kernel is done and its writes are seen
    pid, lst = tl.program_id(0), tl.program_id(1)
    G, BS, num_blocks, pairs_at, blocks_at, by_adapter = _list(lst, G0, BS0, B0, P0, BA0, BY0,
                                                               G1, BS1, B1, P1, BA1, BY1)
    totals = tl.load(totals_ptr + lst * GP + tl.arange(0, GP))
    blocks, first, used = _blocks(totals, tl.arange(0, GP), G, BS)
    if pid < num_chunks:
        ii = tl.arange(0, SUB)
        pairs = pid * SUB + ii
        g = _group_of(topk_ids_ptr, token_lora_ptr, pairs, n, top_k, E, G, by_adapter)
        before = tl.load(counts_ptr + (lst * num_chunks + pid).to(tl.int64) * GP + tl.arange(0, GP))
        if RANKS:
            earlier = tl.load(ranks_ptr + lst.to(tl.int64) * n + pairs, mask=pairs < n, other=0)
        else:
            earlier = _earlier(g, ii)
        _scatter(sorted_pairs_ptr + pairs_at, pairs, g, G, BS, first, before, earlier)
    else:
        _table(block_lora_ptr + blocks_at, block_expert_ptr + blocks_at, sorted_pairs_ptr + pairs_at,
               (pid - num_chunks) * BB + tl.arange(0, BB), first, totals, used, num_blocks, n, E, BS, GP, BSP)


@triton.jit
def recount_kernel(
    # ---- pointers
    topk_ids_ptr,      # [n] int32/int64 expert of each pair
    token_lora_ptr,    # [M] int32/int64 adapter of each token, -1 = none
    sorted_pairs_ptr,  # [sum of B*BS] int32 out: every list's pairs, end to end
    block_lora_ptr,    # [sum of B] int32 out: adapter of each block (0 for lists by expert), -1 = unused
    block_expert_ptr,  # [sum of B] int32 out: expert of each block, -1 = unused
    # ---- sizes (then each list's G, BS, B, pairs offset, block offset and by-adapter flag: ``_list``)
    n, top_k, E, num_chunks,
    G0, BS0, B0, P0, BA0, BY0, G1, BS1, B1, P1, BA1, BY1,
    # ---- meta-parameters
    SUB: tl.constexpr, HB: tl.constexpr, GP: tl.constexpr, BB: tl.constexpr, BSP: tl.constexpr,
):
    """Program (chunk or table part, list): the whole list in one launch. No program waits for another's
    counts: each counts every group itself (a histogram over all n pairs, HB at a time) and a chunk program
    also the pairs before its chunk, then places its pairs or writes its part of the table as
    ``place_kernel`` does. Redundant reads (every program reads all n pairs) instead of two more launches."""
    pid, lst = tl.program_id(0), tl.program_id(1)
    G, BS, num_blocks, pairs_at, blocks_at, by_adapter = _list(lst, G0, BS0, B0, P0, BA0, BY0,
                                                               G1, BS1, B1, P1, BA1, BY1)
    start = tl.where(pid < num_chunks, pid * SUB, n)           # count before here (table programs: all)
    totals = tl.zeros((GP,), dtype=tl.int32)
    before = tl.zeros((GP,), dtype=tl.int32)
    for p0 in range(0, n, HB):
        pairs = p0 + tl.arange(0, HB)
        g = _group_of(topk_ids_ptr, token_lora_ptr, pairs, n, top_k, E, G, by_adapter)
        counted = tl.histogram(g, GP, mask=g < G)
        totals += counted
        if p0 + HB <= start:
            before += counted
        elif p0 < start:
            before += tl.histogram(g, GP, mask=(g < G) & (pairs < start))
    blocks, first, used = _blocks(totals, tl.arange(0, GP), G, BS)
    if pid < num_chunks:
        ii = tl.arange(0, SUB)
        pairs = pid * SUB + ii
        g = _group_of(topk_ids_ptr, token_lora_ptr, pairs, n, top_k, E, G, by_adapter)
        _scatter(sorted_pairs_ptr + pairs_at, pairs, g, G, BS, first, before, _earlier(g, ii))
    else:
        _table(block_lora_ptr + blocks_at, block_expert_ptr + blocks_at, sorted_pairs_ptr + pairs_at,
               (pid - num_chunks) * BB + tl.arange(0, BB), first, totals, used, num_blocks, n, E, BS, GP, BSP)


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _min(a, b):
    return tl.minimum(a, b)


@triton.jit
def sort_kernel(
    # ---- pointers
    topk_ids_ptr,      # [n] int32/int64 expert of each pair
    token_lora_ptr,    # [M] int32/int64 adapter of each token, -1 = none
    sorted_pairs_ptr,  # [sum of B*BS] int32 out: every list's pairs, end to end
    block_lora_ptr,    # [sum of B] int32 out: adapter of each block (0 for lists by expert), -1 = unused
    block_expert_ptr,  # [sum of B] int32 out: expert of each block, -1 = unused
    # ---- sizes (then each list's G, BS, B, pairs offset, block offset and by-adapter flag: ``_list``)
    n, top_k, E,
    G0, BS0, B0, P0, BA0, BY0, G1, BS1, B1, P1, BA1, BY1,
    # ---- meta-parameters
    NP: tl.constexpr, FILL: tl.constexpr,
):
    """Program (list): the whole list from n <= NP pairs held in registers."""
    lst = tl.program_id(0)
    G, BS, num_blocks, pairs_at, blocks_at, by_adapter = _list(lst, G0, BS0, B0, P0, BA0, BY0,
                                                               G1, BS1, B1, P1, BA1, BY1)
    i = tl.arange(0, NP)
    key = tl.sort(_group_of(topk_ids_ptr, token_lora_ptr, i, n, top_k, E, G, by_adapter) * NP + i)
    g, pair = key // NP, key % NP                                  # by group, ascending pairs inside
    start = (i == 0) | (g != tl.gather(g, tl.maximum(i - 1, 0), 0))
    end = (i == NP - 1) | (g != tl.gather(g, tl.minimum(i + 1, NP - 1), 0))
    g_start = tl.associative_scan(tl.where(start, i, 0), 0, _max)
    g_end = tl.associative_scan(tl.where(end, i, NP), 0, _min, reverse=True)
    real = g < G
    blocks = tl.where(start & real, (g_end - g_start + BS) // BS, 0)          # blocks of a group, at its start
    first = tl.gather(tl.cumsum(blocks, 0) - blocks, g_start, 0)               # the group's first block
    used = tl.sum(blocks, 0)
    # the sentinel everywhere first, then the pairs over it; each group's id at its first block
    for f in range(0, num_blocks * BS, FILL):
        offs = f + tl.arange(0, FILL)
        tl.store(sorted_pairs_ptr + pairs_at + offs, n + 0 * offs, mask=offs < num_blocks * BS)
    for f in range(0, num_blocks, FILL):
        offs = f + tl.arange(0, FILL)
        tl.store(block_expert_ptr + blocks_at + offs, -1 + 0 * offs, mask=offs < num_blocks)
    tl.debug_barrier()
    tl.store(sorted_pairs_ptr + pairs_at + first * BS + (i - g_start), pair, mask=real)
    tl.store(block_expert_ptr + blocks_at + first, g, mask=start & real & (blocks > 0))
    tl.debug_barrier()
    # groups ascend with the block index: a running max over the marks gives every block its group
    carry = -1
    for f in range(0, num_blocks, FILL):
        offs = f + tl.arange(0, FILL)
        ok = offs < num_blocks
        mark = tl.load(block_expert_ptr + blocks_at + offs, mask=ok, other=-1)
        group = tl.maximum(tl.associative_scan(mark, 0, _max), carry)
        carry = tl.max(group, 0)
        live = offs < used
        tl.store(block_lora_ptr + blocks_at + offs, tl.where(live, group // E, -1), mask=ok)
        tl.store(block_expert_ptr + blocks_at + offs, tl.where(live, group % E, -1), mask=ok)
