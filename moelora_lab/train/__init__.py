"""Training: the gradients of the LoRA op and the MoE layer with LoRA.

``reference``: the backward's spec in PyTorch (the formulas, grouped by adapter and expert).
"""
from .reference import LoRAGrads, moe_lora_backward_reference

__all__ = ["LoRAGrads", "moe_lora_backward_reference"]
