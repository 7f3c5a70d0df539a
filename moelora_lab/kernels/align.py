"""Routing metadata on the device: a counting sort of pairs by (adapter, expert) in four small kernels.

Shape legend: M tokens, k top-k, E experts, L adapters, n = M*k pairs, G = L*E groups ("virtual
experts" g = l*E + e; g = G means "no adapter"), GP = next power of two > G, C pairs per chunk,
NC chunks, B blocks of BS pairs.

  count_kernel   (NC programs)  counts[c, g]  = pairs of group g in chunk c            (tl.histogram)
  scan_kernel    (1 program)    cursor[c, g]  = pairs of group g in chunks before c,
                                first_block[g] = blocks of all groups before g
  scatter_kernel (NC programs)  sorted_pairs[first_block[g]*BS + cursor + rank] = p, in pair order,
                                so each group's pairs stay ascending (deterministic, no atomics)
  table_kernel   (cdiv(B, BB))  block_lora / block_expert of every block, -1 past the used ones
The result is identical to :func:`moelora_lab.routing.block_list`.
"""
import triton
import triton.language as tl


@triton.jit
def _group_of(topk_ids_ptr, token_lora_ptr, pairs, valid, top_k, E, G):
    lora = tl.load(token_lora_ptr + pairs // top_k, mask=valid, other=-1)
    expert = tl.load(topk_ids_ptr + pairs, mask=valid, other=0)
    return tl.where(valid & (lora >= 0), lora * E + expert, G)


@triton.jit
def count_kernel(
    topk_ids_ptr,      # [n] int32 expert of each pair
    token_lora_ptr,    # [M] int32 adapter of each token, -1 = none
    counts_ptr,        # [NC, GP] int32 out
    n, top_k, E, G,
    C: tl.constexpr, GP: tl.constexpr,
):
    chunk = tl.program_id(0)
    pairs = chunk * C + tl.arange(0, C)
    groups = _group_of(topk_ids_ptr, token_lora_ptr, pairs, pairs < n, top_k, E, G)
    tl.store(counts_ptr + chunk * GP + tl.arange(0, GP), tl.histogram(groups, GP))


@triton.jit
def scan_kernel(
    counts_ptr,        # [NC, GP] int32 in: per-chunk counts; out: per-chunk cursors (exclusive prefix)
    first_block_ptr,   # [GP + 1] int32 out: first block of each group; [GP] = blocks used in all
    num_chunks, G,
    BS: tl.constexpr, GP: tl.constexpr,
):
    groups = tl.arange(0, GP)
    running = tl.zeros((GP,), dtype=tl.int32)
    for c in range(num_chunks):
        row = counts_ptr + c * GP + groups
        cnt = tl.load(row)
        tl.store(row, running)
        running += cnt
    blocks = tl.where(groups < G, (running + BS - 1) // BS, 0)
    ends = tl.cumsum(blocks, 0)
    tl.store(first_block_ptr + groups, ends - blocks)
    tl.store(first_block_ptr + GP, tl.sum(blocks, 0))


@triton.jit
def scatter_kernel(
    topk_ids_ptr, token_lora_ptr,
    cursor_ptr,        # [NC, GP] int32 from scan_kernel; advanced here as pairs are placed
    first_block_ptr,   # [GP + 1] int32
    sorted_pairs_ptr,  # [B*BS] int32, pre-filled with the sentinel n
    n, top_k, E, G,
    C: tl.constexpr, SUB: tl.constexpr, GP: tl.constexpr, BS: tl.constexpr,
):
    chunk = tl.program_id(0)
    ii = tl.arange(0, SUB)
    for s in range(0, C, SUB):
        pairs = chunk * C + s + ii
        valid = pairs < n
        groups = _group_of(topk_ids_ptr, token_lora_ptr, pairs, valid, top_k, E, G)
        same = groups[:, None] == groups[None, :]                                # [SUB, SUB]
        earlier = tl.sum((same & (ii[None, :] < ii[:, None])).to(tl.int32), 1)  # same group, before me
        later = tl.sum((same & (ii[None, :] > ii[:, None])).to(tl.int32), 1)
        placed = valid & (groups < G)
        safe = tl.where(placed, groups, 0)
        cursor = tl.load(cursor_ptr + chunk * GP + safe, mask=placed, other=0)
        start = tl.load(first_block_ptr + safe, mask=placed, other=0) * BS
        tl.store(sorted_pairs_ptr + start + cursor + earlier, pairs, mask=placed)
        tl.debug_barrier()
        tl.store(cursor_ptr + chunk * GP + safe, cursor + earlier + 1, mask=placed & (later == 0))
        tl.debug_barrier()


@triton.jit
def table_kernel(
    first_block_ptr,   # [GP + 1] int32
    block_lora_ptr,    # [B] int32 out
    block_expert_ptr,  # [B] int32 out
    num_blocks, E, G,
    BB: tl.constexpr, GP: tl.constexpr,
):
    b = tl.program_id(0) * BB + tl.arange(0, BB)
    groups = tl.arange(0, GP)
    first = tl.load(first_block_ptr + groups)                                    # [GP] ascending
    first = tl.where(groups < G, first, 2147483647)
    group = tl.sum((first[None, :] <= b[:, None]).to(tl.int32), 1) - 1          # last group starting <= b
    used = b < tl.load(first_block_ptr + GP)
    ok = b < num_blocks
    tl.store(block_lora_ptr + b, tl.where(used, group // E, -1), mask=ok)
    tl.store(block_expert_ptr + b, tl.where(used, group % E, -1), mask=ok)
