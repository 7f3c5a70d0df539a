"""Analytic performance models of the MoE-LoRA kernels."""
from .grad_traffic import GRAD_TRAFFIC_PATHS, GradTraffic, GradWorkload, grad_op_traffic, grad_tiles
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
    "GRAD_TRAFFIC_PATHS",
    "GradTraffic",
    "GradWorkload",
    "grad_op_traffic",
    "grad_tiles",
    "LORA_PATHS",
    "X_ROWS",
    "Traffic",
    "Workload",
    "count_workload",
    "layer_traffic",
    "lora_op_traffic",
]
