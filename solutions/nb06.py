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


# 06.schedule: two streams. The LoRA kernels then run beside the base GEMMs; where both are long and
# bandwidth-bound they share one memory bus and the second stream gains little, but in the sweep it never
# loses by more than one schedule timed twice differs. The LoRA inside the base GEMMs recomputes its
# stacked shrink per N tile and never won.
def choose_schedule(case):
    return "dual_stream"
