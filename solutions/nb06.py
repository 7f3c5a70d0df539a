"""Reference solutions of notebook 06's exercises (``python -m moelora_lab.exercises check`` runs them)."""


# 06.dispatcher: the fused one-shot kernel, unless the rank is wider than 64 and each expert gets few pairs. There
# the two-kernel path's grid (a program per rank tile in the shrink, per N tile in the expand) keeps the SMs busy,
# while the few one-shot programs walk their rank tiles and N chunks one after another. With one rank tile
# (r <= 128) that pays only up to a few pairs per expert and not for a single pair per expert or less; with two
# or more it pays from the first pair. Pairs per expert, not pairs, say when the fused kernel has programs
# enough, whatever the number of experts.
def choose_path(case):
    per_expert = case["pairs"] / case["num_experts"]
    if case["rank"] <= 64:
        return "one_shot"
    if case["rank"] <= 128:
        return "two_kernel" if case["pairs"] > 8 and per_expert <= 4 else "one_shot"
    return "two_kernel" if per_expert <= 48 else "one_shot"


# 06.schedule: two streams, until each expert has pairs enough for both LoRA ops in the GEMMs' K (in_k). in_k
# widens each grouped GEMM's K by L*r columns and runs its shrinks on the one stream, so it pays only once the
# GEMMs are long; the wider the adapters, the more pairs per expert that takes (on the H200: from 32 at L*r = 64,
# from 128 at L*r = 256). Wider K than L*r = 256 was not measured: two streams there. Neither one stream nor the
# LoRA inside the base GEMMs was the fastest schedule of any case.
def choose_schedule(case):
    columns = case["loras"] * case["rank"]
    if columns <= 256 and case["pairs"] / case["num_experts"] >= columns / 2:
        return "in_k"
    return "dual_stream"
