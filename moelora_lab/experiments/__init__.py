"""Schedules and kernels that were measured and lost (or wait to be), kept to be read, tested against the spec and timed.

No product module imports this package: the schedule table names the experiment rows' runners by import
path (``layer.table``), the op's table of paths its experiment rows' launchers (``op.paths``), and the
benchmarks time them by name.

    in_gemm.py  the ``fused`` and ``epilogue`` schedules (the LoRA inside the base grouped GEMMs)
    in_join.py  the ``in_join`` schedule (the LoRA inside the activation and the top-k sum)
    in_k.py     two variants of the LoRA in K: only w2's LoRA in K, and each shrink in one launch with its GEMM
    in_k_act.py the ``in_k_act`` schedule (``in_k`` with the activation in the w13 GEMM's epilogue; not yet measured)
    one_shot_builds.py  the one-shot path with its kernel built each way (``bench expand``)
    small_batch.py      the op's ``small_batch`` path (a per-pair GEMV)
"""
