"""Training LoRA adapters through the MoE layer, checked against PEFT.

    loop.py        train_adapters: several adapters trained jointly in one batch (StackedLoRA, TrainSetup,
                   make_setup); peft_reference_curves: the same training by PEFT, one adapter at a time;
                   save_adapters and peft_outputs: the trained adapters written as PEFT files and read back
    peft_grads.py  check_grads_against_peft: the layer's LoRA gradients against PEFT's own autograd, on a
                   transformers Qwen3-MoE block with random weights (moe_block, peft_adapters); choose_layer:
                   moe_lora_layer where its backward matches the spec on this device, else the spec
    __main__.py    ``python -m moelora_lab.train``: both trainings, their loss curves side by side

The gradients themselves live below: the op's backward in ``moelora_lab.op.grad``, the layer's in
``moelora_lab.layer.grad``, their spec in ``moelora_lab.reference``. transformers and peft are imported
only by the functions that need them.
"""
from .loop import (StackedLoRA, TrainRun, TrainSetup, make_setup, peft_outputs, peft_reference_curves,
                   save_adapters, train_adapters)
from .peft_grads import check_grads_against_peft, choose_layer, moe_block, peft_adapters

__all__ = ["StackedLoRA", "TrainRun", "TrainSetup", "make_setup", "train_adapters", "peft_reference_curves",
           "save_adapters", "peft_outputs", "check_grads_against_peft", "choose_layer", "moe_block", "peft_adapters"]
