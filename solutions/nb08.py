"""Reference solutions of notebook 08's exercises (``python -m moelora_lab.exercises check`` runs them)."""
import torch

from moelora_lab.dist.comm import META_BYTES

# 08.dispatch_bytes: M k pairs, half of them (W = 2) to the other GPU, H bf16 values each:
# 64 tokens * 8 experts * 1/2 * 2048 values * 2 bytes
dispatch_bytes_guess = 64 * 8 * (2 - 1) / 2 * 2048 * 2



# 08.pair_bytes: off the diagonal only; rows out (with metadata) in the dispatch, columns back in the combine
def pair_bytes(pairs, hidden, dtype_bytes):
    remote = pairs - torch.diag(torch.diag(pairs))
    row = hidden * dtype_bytes
    return ([int(v) * (row + META_BYTES) for v in remote.sum(1)],
            [int(v) * row for v in remote.sum(0)])
