"""Reference solutions of notebook 07's exercises (``python -m moelora_lab.exercises check`` runs them)."""
import math

# 07.b_column: lora_B [N, r*E] is rank-major, column i*E + e: the 128 columns of rank 0 (experts 0..127)
# come first, then rank 1's, then rank 2's; rank 3 of expert 37 is 37 columns into the fourth run
b_column_guess = 3 * 128 + 37


# 07.convert_fused: A is expert-major, a reshape; B is rank-major, a reshape to [N, r, E] and a permute;
# the scaling goes into B
def convert_fused(lora_A, lora_B, num_experts, scaling):
    E = num_experts
    r = lora_A.shape[0] // E
    A = lora_A.reshape(E, r, lora_A.shape[1])                           # row e*r + i -> [e, i]
    B = lora_B.reshape(lora_B.shape[0], r, E).permute(2, 0, 1)          # column i*E + e -> [e, :, i]
    return A, B * scaling


# 07.scaling: rank-stabilised LoRA divides alpha by sqrt(r): 16 / sqrt(8)
scaling_guess = 16 / math.sqrt(8)
