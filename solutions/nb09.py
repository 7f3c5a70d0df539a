"""Reference solutions of notebook 09's exercises (``python -m moelora_lab.exercises check`` runs them)."""
import math


# 09.group_grads: recompute T, then the chain rule through out = T B^T and T = xs A^T
def group_grads(xs, a, b, g):
    t = xs @ a.T                    # [n, r]  the forward's rank intermediate, recomputed
    dt = g @ b                      # [n, r]  the gradient reaching T
    return dt @ a, dt.T @ xs, g.T @ t


# 09.t_bytes: T and dT are [S, P, r] = [2, 256 * 8, 16] in bf16, 131,072 bytes each; both written once, T read
# once per 64-column tile of dB's 768 columns (12), dT once per 64-column tile of dA's 2048 columns (32)
t_bytes_guess = 2 * (256 * 8) * 16 * 2 * (2 + math.ceil(768 / 64) + math.ceil(2048 / 64))


# 09.mean_scale: adapter 0's token losses are divided by its 8 tokens in the joint loss, by all 20 in the mean
mean_scale_guess = 8 / 20
