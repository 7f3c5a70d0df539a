"""Reference solutions of notebook 10's exercises (``python -m moelora_lab.exercises check`` runs them)."""
import torch


# 10.block_scale: one amax per (BN, BK) block, scale = amax / 448, each block divided by its own scale
def quantize_blocks(w, block):
    BN, BK = block
    N, K = w.shape
    blocks = w.float().view(N // BN, BN, K // BK, BK)
    amax = blocks.abs().amax(dim=(1, 3))                                      # [SN, SK]
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    data = (blocks / scale[:, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return data.view(N, K), scale


# 10.code_factor: the group's scale is 3.5 / 448; the codes are x divided by it
code_factor_guess = 448 / 3.5


# 10.weight_bytes: 8 experts, each w13 [1536, 2048] and w2 [2048, 768] in one byte per element, plus a float32
# scale per 128 x 128 block: 12 * 16 + 16 * 6 = 288 of them
weight_bytes_guess = 8 * (3 * 768 * 2048 + 4 * (12 * 16 + 16 * 6))
