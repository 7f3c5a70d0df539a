"""Reference solutions of notebook 02's exercises (``python -m moelora_lab.exercises check`` runs them)."""
import triton
import triton.language as tl

# 02.roundtrip_bytes: T is [S, M*k, r] bf16, moved twice (shrink's write, expand's read; no fill)
M, K_TOP, R, S, BF16 = 512, 8, 16, 2, 2
roundtrip_guess = 2 * S * (M * K_TOP) * R * BF16


# 02.shrink_once: the block's pair rows as one [BLOCK_M, BLOCK_K] x tile per K step, A[g] read once
# (one [BLOCK_K, R] tile per K step), one tl.dot per step, one store of the [BLOCK_M, R] result
@triton.jit
def simple_shrink_kernel(x_ptr, a_ptr, sorted_pairs_ptr, block_group_ptr, t_ptr, K,
                         TOP_K: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    block = tl.program_id(0)
    g = tl.load(block_group_ptr + block)
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))             # [BLOCK_M]
    ranks = tl.arange(0, R)
    acc = tl.zeros((BLOCK_M, R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x_tile = tl.load(x_ptr + (pairs // TOP_K)[:, None] * K + ks[None, :])               # [BLOCK_M, BLOCK_K]
        a_tile = tl.load(a_ptr + g * R * K + ks[:, None] + ranks[None, :] * K)              # [BLOCK_K, R]
        acc = tl.dot(x_tile, a_tile, acc)
    tl.store(t_ptr + pairs[:, None] * R + ranks[None, :], acc)


# 02.expand_once: one [BLOCK_M, R] tile of T and one [BLOCK_N, R] tile of B per program, one tl.dot
@triton.jit
def simple_expand_kernel(t_ptr, b_ptr, block_group_ptr, out_ptr, N, R: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    block, pid_n = tl.program_id(0), tl.program_id(1)
    g = tl.load(block_group_ptr + block)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, R)
    t_tile = tl.load(t_ptr + rows[:, None] * R + ranks[None, :])                             # [BLOCK_M, R]
    b_tile = tl.load(b_ptr + g * N * R + cols[:, None] * R + ranks[None, :], mask=cols[:, None] < N, other=0.0)
    acc = tl.dot(t_tile, tl.trans(b_tile))                                                   # [BLOCK_M, BLOCK_N]
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc, mask=cols[None, :] < N)


# 02.predict_time: the byte floor, the two-kernel bytes of section 3's table over the measured copy bandwidth
# (bytes / (TB/s * 1e12) seconds, * 1e6 for µs); the kernels reach part of that rate, so it comes out low
from moelora_lab.plots.traffic import traffic_table  # noqa: E402
from moelora_lab.results import load  # noqa: E402

two_kernel_bytes = traffic_table("qwen3-30b-a3b", 64, "w13", [512], paths=("two_kernel",), routing="sweep")[0]["bytes"]
predict_time_guess = two_kernel_bytes / (load("kernels")[0]["copy_tbps"] * 1e12) * 1e6
