"""Reference solutions of notebook 01's exercises (``python -m moelora_lab.exercises check`` runs them)."""
import math

import torch

# 01.padding_share: 256·8 pairs over 128·4 segments = 4 per segment; nearly every used segment is one block
# of 16, and e^(-4) of the segments stay empty, so the walked slots are 16·512·(1 − e^(-4))
PAIRS, SEGMENTS, BLOCK_M = 256 * 8, 128 * 4, 16
padding_guess = 1 - PAIRS / (BLOCK_M * SEGMENTS * (1 - math.exp(-PAIRS / SEGMENTS)))


# 01.align_one_adapter: expert by expert, the pair ids in order, padded with the sentinel to whole blocks
def align_one_adapter(topk_ids, num_experts, block_size):
    M, k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()                                    # [M*k], position = pair id
    sorted_ids, block_expert = [], []
    for e in range(num_experts):
        pairs = (flat == e).nonzero().flatten().tolist()                  # ascending
        if not pairs:
            continue
        blocks = -(-len(pairs) // block_size)
        sorted_ids += pairs + [M * k] * (blocks * block_size - len(pairs))
        block_expert += [e] * blocks
    return torch.tensor(sorted_ids, dtype=torch.int32), torch.tensor(block_expert, dtype=torch.int32)


# 01.sorted_saving: 64·8 = 512 pairs over 128·4 = 512 weights; naive loads 512, sorted loads the touched
# weights, 512·(1 − e^(-1)); the saving is 512·e^(-1)
saving_guess = 512 * math.exp(-512 / 512)


# 01.assignment_loads: naive = pairs with an adapter; sorted = sum over (adapter, expert) of ceil(n / BLOCK_M)
def assignment_loads(topk_ids, token_lora, num_experts, num_loras, block_size):
    k = topk_ids.shape[1]
    has = token_lora.long() >= 0                                          # [M]
    groups = token_lora.long()[has, None] * num_experts + topk_ids.long()[has]   # [M', k] l*E + e
    counts = torch.bincount(groups.reshape(-1), minlength=num_experts * num_loras)
    return int(has.sum()) * k, int(((counts + block_size - 1) // block_size).sum())
