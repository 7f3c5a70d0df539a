"""Schedules and kernels that were measured and lost, kept to be read, tested against the spec and timed.

No product module imports this package: the schedule table names the experiment rows' runners by import
path (``layer.table``), and the benchmarks time them by name.

    in_gemm.py  the ``fused`` and ``epilogue`` schedules (the LoRA inside the base grouped GEMMs)
    in_join.py  the ``in_join`` schedule (the LoRA inside the activation and the top-k sum)
    in_k.py     two variants of the LoRA in K: only w2's LoRA in K, and each shrink in one launch with its GEMM
"""
