"""Small device helpers shared by the kernels.

Shape legend: M tokens, k top-k, L adapters, E experts, r rank, K in, N out, S slices, BM pairs per block.

These are device functions, called from inside the kernels and never launched: each takes a few
values, its ``tl.constexpr`` meta-parameters last (the kernels group theirs under comment headers:
pointers, sizes, strides, meta-parameters).
"""
import triton
import triton.language as tl


@triton.jit
def slice_pointers(slice_id, a0_ptr, a1_ptr, b0_ptr, b1_ptr):
    """A and B base pointers of slice 0 or 1 (the launcher passes slice 0 twice when S == 1)."""
    if slice_id == 0:
        a_ptr = a0_ptr
        b_ptr = b0_ptr
    else:
        a_ptr = a1_ptr
        b_ptr = b1_ptr
    return a_ptr, b_ptr


@triton.jit
def block_rows(sorted_pairs_ptr, block, num_pairs, top_k, BLOCK_M: tl.constexpr, TOKEN_ROWS: tl.constexpr):
    """The BM pair ids of one block, their validity mask, and the x row each one reads."""
    return rows_at(sorted_pairs_ptr, block * BLOCK_M, num_pairs, top_k, BLOCK_M, TOKEN_ROWS)


@triton.jit
def rows_at(sorted_pairs_ptr, start, num_pairs, top_k, ROWS: tl.constexpr, TOKEN_ROWS: tl.constexpr):
    """The ROWS pair ids from slot ``start`` of the block list, their validity mask, and the x row of each."""
    pairs = tl.load(sorted_pairs_ptr + start + tl.arange(0, ROWS))                # [ROWS] int32
    valid = pairs < num_pairs
    pairs = tl.where(valid, pairs, 0)
    if TOKEN_ROWS:
        x_rows = pairs // top_k      # w13: every slot of a token reads the token's row
    else:
        x_rows = pairs               # w2: one input row per pair
    return pairs, valid, x_rows


@triton.jit
def slot_rank(lora_ranks_ptr, lora, R, HAS_RANKS: tl.constexpr):
    """The rank this adapter slot really uses: its entry of lora_ranks (<= r), or r without one."""
    r_lim = R
    if HAS_RANKS:
        r_lim = tl.minimum(tl.load(lora_ranks_ptr + lora), R)
    return r_lim


@triton.jit
def adapter_lanes(lora_ranks_ptr, lora, offs_r, R, HAS_RANKS: tl.constexpr):
    """For a pair's adapter id ``lora`` (-1 = none): a slot safe to index weights with (0 for none) and the
    mask of the rank lanes ``offs_r`` it has (all off without an adapter)."""
    slot = tl.maximum(lora, 0)
    return slot, (offs_r < slot_rank(lora_ranks_ptr, slot, R, HAS_RANKS)) & (lora >= 0)


@triton.jit
def rank_tile(r0, r_lim, BLOCK_R: tl.constexpr, CLAMP: tl.constexpr = False):
    """Rank offsets r0 .. r0+BLOCK_R and their mask (< r_lim). The offsets stay one contiguous run
    (masked lanes are never read): where r is the fastest axis of a weight, as in B [L, E, N, r],
    that lets the compiler load 16-byte vectors and pipeline the loads. ``CLAMP`` points the masked
    lanes at row 0 instead, as this code once did: the compiler then sees scattered offsets and loads
    such a tile 2 bytes at a time, unpipelined (kept to measure what that cost)."""
    offs_r = r0 + tl.arange(0, BLOCK_R)
    r_ok = offs_r < r_lim
    if CLAMP:
        offs_r = tl.where(r_ok, offs_r, 0)
    return offs_r, r_ok


@triton.jit
def rank_tile_runs(rt, r_lim, BLOCK_R: tl.constexpr, HAS_RANKS: tl.constexpr):
    """Whether rank tile ``rt`` has work: always without HAS_RANKS (no branch), else tile 0 (so the
    rows a program owns get written) and every tile that starts below the slot's rank."""
    run = True
    if HAS_RANKS:
        run = (rt == 0) | (rt * BLOCK_R < r_lim)
    return run


@triton.jit
def gemm_tile(pid, N, n_slice, num_blocks, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program ``pid`` of a grouped GEMM over expert blocks -> (block, slice, the tile's first column in
    the slice). Programs are numbered GROUP_M blocks at a time, N tiles inside a group, so neighbours
    in time share x rows through L2; N tiles never straddle two slices."""
    slice_tiles = tl.cdiv(n_slice, BLOCK_N)
    n_tiles = (N // n_slice) * slice_tiles
    first = (pid // (GROUP_M * n_tiles)) * GROUP_M
    group = tl.minimum(num_blocks - first, GROUP_M)
    block = first + (pid % (GROUP_M * n_tiles)) % group
    pid_n = (pid % (GROUP_M * n_tiles)) // group
    return block, pid_n // slice_tiles, (pid_n % slice_tiles) * BLOCK_N
