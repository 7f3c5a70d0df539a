"""moelora_lab: LoRA on Mixture-of-Experts layers, from the spec to fused Triton kernels.

Importing the package first decides where kernels run (see ``_backend``), before any kernel
module defines a ``@triton.jit`` function.
"""
from . import _backend  # noqa: F401  (must stay the first import)
from ._backend import INTERPRET, describe, kernel_device
from .config import PRESETS, LoRAShape, MoEShape, Problem, make_problem
from .reference import (moe_layer_reference, moe_layer_reference_loop, moe_lora_backward_reference,
                        moe_lora_reference, moe_lora_reference_loop)
from .blocks import BlockList, LayerPlan
from .routing import (Alignment, align_block_size, block_list, block_list_device, naive_block_list, route,
                      use_naive_assignment)
from .op import GRAD_PATHS, PATHS, KernelConfig, moe_lora, moe_lora_backward, pack_lora_b
from .layer import SCHEDULES, moe_lora_layer, pack_in_k, plan_layer

__all__ = [
    "INTERPRET", "describe", "kernel_device",
    "PRESETS", "LoRAShape", "MoEShape", "Problem", "make_problem",
    "moe_layer_reference", "moe_layer_reference_loop", "moe_lora_backward_reference", "moe_lora_reference",
    "moe_lora_reference_loop",
    "Alignment", "BlockList", "align_block_size", "block_list", "block_list_device", "naive_block_list", "route",
    "use_naive_assignment", "KernelConfig", "PATHS", "moe_lora", "pack_lora_b", "GRAD_PATHS", "moe_lora_backward",
    "LayerPlan", "SCHEDULES", "moe_lora_layer", "pack_in_k", "plan_layer",
]
__version__ = "0.1.0"

# subpackages imported on first use (``ml.adapters.load_peft``, ``ml.dist.ep_layer``, ``ml.train.train_adapters``),
# so that importing the package stays light: the adapters read safetensors files, dist pulls in torch.distributed,
# train builds on the adapters
_LAZY = ("adapters", "dist", "train")


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
