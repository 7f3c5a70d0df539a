"""Analytic performance models of the MoE-LoRA kernels."""
from .traffic import (
    LORA_PATHS,
    X_ROWS,
    Traffic,
    Workload,
    count_workload,
    layer_traffic,
    lora_op_traffic,
)

__all__ = [
    "LORA_PATHS",
    "X_ROWS",
    "Traffic",
    "Workload",
    "count_workload",
    "layer_traffic",
    "lora_op_traffic",
]
