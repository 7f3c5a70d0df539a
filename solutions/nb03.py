"""Reference solutions of notebook 03's exercises (``python -m moelora_lab.exercises check`` runs them)."""
import triton
import triton.language as tl

# 03.registers: 64 x 256 fp32 values shared evenly by 4 warps x 32 threads, one 32-bit register each
registers_guess = 64 * 256 // (4 * 32)


# 03.keep_t_out: the shrink's accumulator t feeds every expand dot directly; t_ptr is never touched
@triton.jit
def fused_lora_kernel(x_ptr, a_ptr, b_ptr, block_group_ptr, t_ptr, out_ptr, K, N, R: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    block = tl.program_id(0)
    g = tl.load(block_group_ptr + block)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    ranks = tl.arange(0, R)
    offs_k = tl.arange(0, BLOCK_K)
    t = tl.zeros((BLOCK_M, R), dtype=tl.float32)                                      # [BLOCK_M, R] registers
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        xk = tl.load(x_ptr + rows[:, None] * K + ks[None, :])
        ak = tl.load(a_ptr + g * R * K + ranks[None, :] * K + ks[:, None])
        t = tl.dot(xk, ak, t)
    for n0 in range(0, N, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        bt = tl.load(b_ptr + g * N * R + cols[None, :] * R + ranks[:, None], mask=cols[None, :] < N, other=0.0)
        acc = tl.dot(t, bt)
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc, mask=cols[None, :] < N)


# 03.rank_tiles: one BLOCK_R-wide T tile at a time; tiles after the first add to the rows already stored
@triton.jit
def rank_tiles_kernel(x_ptr, a_ptr, b_ptr, block_group_ptr, out_ptr, K, N, R,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_R: tl.constexpr):
    block = tl.program_id(0)
    g = tl.load(block_group_ptr + block)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    for r0 in range(0, R, BLOCK_R):
        ranks = r0 + tl.arange(0, BLOCK_R)
        r_ok = ranks < R
        t = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs_k
            xk = tl.load(x_ptr + rows[:, None] * K + ks[None, :])
            ak = tl.load(a_ptr + g * R * K + ranks[None, :] * K + ks[:, None], mask=r_ok[None, :], other=0.0)
            t = tl.dot(xk, ak, t)
        for n0 in range(0, N, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            n_ok = cols < N
            bt = tl.load(b_ptr + g * N * R + cols[None, :] * R + ranks[:, None],
                         mask=r_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(t, bt)
            out = out_ptr + rows[:, None] * N + cols[None, :]
            if r0 > 0:
                acc += tl.load(out, mask=n_ok[None, :], other=0.0)                    # earlier rank tiles
            tl.store(out, acc, mask=n_ok[None, :])
        tl.debug_barrier()                              # the next tile reads what this one stored
