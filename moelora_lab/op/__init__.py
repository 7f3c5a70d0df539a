"""The op: one LoRA delta of a MoE layer's projection, computed by one of the paths of a table, and its backward.

    face.py        moe_lora (validate once, build the blocks, pick a path, launch it), run_lora, pack_lora_b
    paths.py       PATHS: one row per way of computing the op, with its launcher (kernels in ``kernels/``)
    dispatch.py    which path ``auto`` runs and the tiles of each launch (the measured values in ``rules``)
    grad.py        moe_lora_backward, its ``auto`` rule, and the autograd Function moe_lora runs through
                   when an input requires grad
    grad_paths.py  GRAD_PATHS: one row per way of computing the backward, with its launcher
                   (kernels in ``kernels/lora_grad.py`` and ``kernels/lora_grad_one_shot.py``)
"""
from .dispatch import KernelConfig, choose_config, choose_path, choose_side_path
from .face import moe_lora, pack_lora_b, run_lora
from .grad import moe_lora_backward
from .grad_paths import GRAD_PATHS
from .paths import PATHS, LoRACall, get_path, resolve_path

__all__ = ["KernelConfig", "choose_config", "choose_path", "choose_side_path", "moe_lora", "pack_lora_b",
           "run_lora", "PATHS", "LoRACall", "get_path", "resolve_path", "GRAD_PATHS", "moe_lora_backward"]
