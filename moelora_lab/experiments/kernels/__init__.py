"""``@triton.jit`` kernels of the experiments only; their launchers live beside the schedules in
:mod:`moelora_lab.experiments`. They are built from the product's device helpers (``moelora_lab.kernels``).

    in_gemm.py       the grouped GEMM with the LoRA inside it (``fused``, ``epilogue``)
    in_join.py       the activation and the top-k sum with the LoRA inside them (``in_join``)
    in_k_overlap.py  the tail shrink and its grouped GEMM as one launch (``in_k_overlap_layer``)
    one_shot_builds.py  the one-shot kernel with every build knob (``bench expand``)
    small_batch.py   the per-pair GEMV of the op's ``small_batch`` path
"""
