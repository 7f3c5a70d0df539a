"""Reference solutions of notebook 05's exercises (``python -m moelora_lab.exercises check`` runs them)."""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl


# 05.fold_join: select the delta rows of pairs with an adapter (a select, so unwritten rows never reach h)
def silu_and_mul_fold(c1, delta, token_lora, top_k, h):
    I = h.shape[1]
    has = (token_lora >= 0).repeat_interleave(top_k)                          # [P]
    g = c1 + torch.where(has[:, None], delta, torch.zeros_like(delta))         # [P, 2I]
    h.copy_(F.silu(g[:, :I]) * g[:, I:])
    return h


# 05.fold_kernel: gate and up loaded once, the delta added as it is loaded (masked off without an adapter)
@triton.jit
def fold_act_kernel(c1_ptr, delta_ptr, token_lora_ptr, tmp_ptr, h_ptr, top_k, I, BLOCK: tl.constexpr):
    pair = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    has = tl.load(token_lora_ptr + pair // top_k) >= 0
    row = pair * 2 * I
    gate = tl.load(c1_ptr + row + cols, mask=ok, other=0.0) + tl.load(delta_ptr + row + cols, mask=ok & has, other=0.0)
    up = tl.load(c1_ptr + row + I + cols, mask=ok, other=0.0) + tl.load(delta_ptr + row + I + cols, mask=ok & has,
                                                                         other=0.0)
    tl.store(h_ptr + pair * I + cols, gate / (1.0 + tl.exp(-gate)) * up, mask=ok)


# 05.delta_bytes: d13 [P, 2I] and d2 [P, H] in bf16, each written once and read once; P = M*k = 2048*8
M, K_TOP, H, I, BF16 = 2048, 8, 2048, 768, 2
delta_bytes_guess = 2 * (M * K_TOP) * (2 * I + H) * BF16


# 05.schedule_pick: rank 64 in layer.csv: two streams up to a few hundred tokens, in_k once the deltas are large
fastest_guess = {128: "dual_stream", 512: "dual_stream", 2048: "in_k"}
