"""Real adapters in and out: PEFT LoRA adapters of MoE experts in the lab's layout, and back.

Shape legend: L adapters (slots), E experts, r rank, H hidden, I expert intermediate; K in, N out.

The lab's layout, per MoE layer (what ``moe_lora_layer`` takes): w13 = gate|up as two slices,
``w13_lora_a`` 2 x [L, E, r, H], ``w13_lora_b`` 2 x [L, E, I, r]; w2 (down) as one slice,
``w2_lora_a`` 1 x [L, E, r, I], ``w2_lora_b`` 1 x [L, E, H, r]; the scaling folded into B; slots of
smaller rank padded with zeros and their true ranks in ``lora_ranks`` [L].

PEFT stores MoE experts' LoRA in one of two ways:

* **fused 3D experts** (``target_parameters=["experts.gate_up_proj", "experts.down_proj"]``, the
  layout of transformers 5 MoE models: ``gate_up_proj`` [E, 2I, H], rows [0, I) gate, [I, 2I) up, and
  ``down_proj`` [E, H, I]). One LoRA per parameter with the rank per expert: ``lora_A.weight``
  [E*r, in], row e*r + i (expert-major); ``lora_B.weight`` [out, r*E], column i*E + e (rank-major).
  gate and up share ONE A (it spans the 2I outputs), so both of our w13 slices get that A and B is
  split by rows. The file does not name the parameters: PEFT nests one wrapper per targeted
  parameter, the first wrapped innermost, so a layer holds ``...experts.base_layer.lora_A.weight``
  (the parameter the experts module defines first: gate_up_proj) and ``...experts.lora_A.weight``
  (the next: down_proj). Shapes alone cannot tell them apart when H = I; the nesting can, and the
  shapes are only checked for consistency (``EXPERT_PARAMETERS`` gives the order).
* **per-expert modules** (older checkpoints: ``experts.{e}.gate_proj`` / ``up_proj`` /
  ``down_proj``, or Mixtral's ``w1`` / ``w3`` / ``w2``): one LoRA per expert and projection,
  ``lora_A.weight`` [r, in], ``lora_B.weight`` [out, r]; gate and up have their own A's.

Scaling: lora_alpha / r, or lora_alpha / sqrt(r) with ``use_rslora``; ``rank_pattern`` and
``alpha_pattern`` override r and alpha for the targets they match.
"""
from __future__ import annotations

from .files import UNSUPPORTED, PeftAdapter, read_peft
from .layouts import EXPERT_PARAMETERS, FUSED, MODULE, MODULE_NAMES
from .peft import load_peft, save_peft

__all__ = ["EXPERT_PARAMETERS", "FUSED", "MODULE", "MODULE_NAMES", "UNSUPPORTED", "PeftAdapter", "load_peft",
           "read_peft", "save_peft"]
