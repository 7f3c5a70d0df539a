"""The layer on a quantized base: which base a call brings, the tensors its shapes are checked on, and the
refusals of what a quantized base cannot run.

A quantized base is w13 and w2 both :class:`~moelora_lab.quant.FP8Weight` (``quant.quantize_experts(w13,
w2)`` gives them as ``.w13`` and ``.w2``): the schedules whose rows serve it (``Schedule.refuses_fp8`` is None)
run its base GEMMs by ``quant.base_gemm``, the LoRA in x's dtype on the unquantized activations. What cannot
run it says so by name: the other schedules (``table.SCHEDULES``), an ``in_k`` pack, a backward, and the
distributed layers (``dist.ep_layer``, ``dist.tp_layer``), whose shards are tensors.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from ..quant.format import FP8_DTYPE, FP8Weight
from .grad import no_backward

BASE_DTYPES = (FP8_DTYPE,)          # the dtype of a quantized base's data, which its shapes are checked on
NO_BACKWARD = ("w13, w2: the base is quantized (FP8Weight), and the layer has no backward through a quantized "
               "base (its gradient would run the FP8 GEMMs transposed, which the lab does not); train on the base "
               "as tensors (FP8Weight.dequantize(dtype)), or call the layer under torch.no_grad()")


def quantized_base(w13, w2) -> bool:
    """Whether the call's base is quantized: both FP8Weights (True) or neither (False); a TypeError naming the
    two otherwise."""
    fp8 = isinstance(w13, FP8Weight), isinstance(w2, FP8Weight)
    if fp8[0] != fp8[1]:
        q, other, t = ("w13", "w2", w2) if fp8[0] else ("w2", "w13", w13)
        raise TypeError(f"w13, w2: {q} is an FP8Weight but {other} is a {type(t).__name__}; pass both quantized "
                        "(moelora_lab.quant.quantize_experts(w13, w2) gives .w13 and .w2) or both as tensors")
    return fp8[0]


def base_tensors(w13, w2) -> tuple:
    """The tensors the base's shapes, dtypes and devices are checked on: a quantized base's data, else w13, w2."""
    return (w13.data, w2.data) if isinstance(w13, FP8Weight) else (w13, w2)


def refuse_in_k(in_k) -> None:
    """A ValueError where a call on a quantized base brings an ``in_k`` pack (its weights are not the FP8 base)."""
    if in_k is not None:
        raise ValueError("in_k: a pack widens W with every slot's LoRA B columns, which a quantized (FP8) base "
                         "cannot hold; drop in_k (schedule='auto', 'sequential' or 'dual_stream' run the FP8 base)")


def without_backward(forward, *args, **kwargs) -> torch.Tensor:
    """``forward(*args, **kwargs)`` (the layer, on a quantized base) run without autograd, tied to the inputs
    that require grad: inference serves as it is, a backward raises :data:`NO_BACKWARD`."""
    with torch.no_grad():
        y = forward(*args, **kwargs)
    return no_backward(NO_BACKWARD, y, args, kwargs)


def refuse_distributed(layer: str, local) -> None:
    """A TypeError where ``local`` (a rank's shard of ``layer``) holds a quantized base: checked before any
    collective, so every rank raises it (``dist.agree``)."""
    if not isinstance(local, Mapping):
        return
    for key in ("w13", "w2"):
        if isinstance(local.get(key), FP8Weight):
            raise TypeError(f"local[{key!r}]: an FP8Weight (a quantized base), which {layer} does not run (its "
                            "shards and collectives take tensors); pass the base as tensors "
                            "(FP8Weight.dequantize(dtype)) or run moelora_lab.moe_lora_layer on one device")
