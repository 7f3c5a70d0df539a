"""The MoE layer with LoRA: the face (``moe_lora_layer``), the table of schedules, the plan, and the
product schedules' runners.

    face.py        moe_lora_layer: validate once, plan once, look the schedule up, run it
    table.py       SCHEDULES: one row per schedule (runner, status, streams, stages, what it honours, limits)
    plan.py        plan_layer (routing metadata, tiles, LoRA path), resolve_schedule, the GPU rule of ``auto``
    two_kernel.py  the sequential and dual_stream runners (base GEMMs, the op's LoRA kernels, the joins)
    in_k.py        the in_k runner (both LoRA ops in their GEMMs' K); in_k_pack.py packs its weights
    in_k_launch.py the launchers of its tail shrink
    streams.py     the two-stream executor
    fp8.py         a quantized (FP8Weight) base: which base a call brings, and the refusals of what cannot run it
"""
from . import two_kernel  # noqa: F401  (moelora_lab.layer.two_kernel.run, as the notebooks show it)
from .face import moe_lora_layer
from .in_k import in_k_layer
from .in_k_pack import InKWeights, pack_in_k, pack_w13_in_k, pack_w2_in_k
from .plan import (IN_K_MAX_COLUMNS, IN_K_MIN_PAIRS_PER_EXPERT, fused_fits, gpu_schedule, ignored_argument,
                   plan_layer, resolve_schedule)
from .streams import SIDE_PRIORITIES, Streams
from .table import AUTO, JOINS, STATUSES, LayerCall, Schedule, SCHEDULES, choices, get_schedule, schedule_names

__all__ = ["moe_lora_layer", "in_k_layer", "InKWeights", "pack_in_k", "pack_w13_in_k", "pack_w2_in_k",
           "IN_K_MAX_COLUMNS", "IN_K_MIN_PAIRS_PER_EXPERT", "fused_fits", "gpu_schedule", "ignored_argument",
           "plan_layer", "resolve_schedule", "SIDE_PRIORITIES", "Streams", "AUTO", "JOINS", "STATUSES", "LayerCall",
           "Schedule", "SCHEDULES", "choices", "get_schedule", "schedule_names"]
