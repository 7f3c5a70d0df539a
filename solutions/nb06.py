"""Reference solutions of notebook 06's exercises (``python -m moelora_lab.exercises check`` runs them)."""


# 06.dispatcher: the fused one-shot kernel, unless the rank is wide and each expert gets few pairs. There the
# two-kernel path's grid (a program per rank tile in the shrink, per N tile in the expand) keeps the SMs busy,
# while the few one-shot programs walk their rank tiles and N chunks one after another. Pairs per expert, not
# pairs, say when the fused kernel has programs enough, whatever the number of experts. A wide output (more
# than 1024 columns per slice) makes each one-shot program long at any rank below 128, so there the two-kernel
# path wins up to more pairs per expert.
def choose_path(case):
    per_expert = case["pairs"] / case["num_experts"]
    wide_rank = case["rank"] >= 128 or (case["rank"] >= 64 and case["pairs"] >= 32)
    if wide_rank and per_expert <= 48:
        return "two_kernel"
    wide_out = case["N"] > 1024 and case["rank"] < 128 and case["pairs"] >= 128
    return "two_kernel" if wide_out and per_expert <= 192 else "one_shot"


# 06.schedule: two streams. The LoRA kernels then run beside the base GEMMs; where both are long and
# bandwidth-bound they share one memory bus and the second stream gains little, but in the sweep it never
# loses by more than one schedule timed twice differs. The LoRA inside the base GEMMs recomputes its
# stacked shrink per N tile and never won.
def choose_schedule(case):
    return "dual_stream"
