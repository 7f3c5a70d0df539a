"""The spec of the MoE-LoRA layer on FP8 base experts, and the mistake it guards against.

Shape legend: M tokens, E experts, k top-k, H hidden, I expert intermediate, G an activation group.

The base GEMMs read FP8: the weights are the :class:`~moelora_lab.quant.format.QuantizedExperts` (dequantized:
every element times its block's scale), and each GEMM's input (x before W13, h before W2) is quantized per row
and group of G columns and dequantized again. The LoRA is a bf16/fp32 side path: it reads the unquantized x and
h, as it was trained to. :func:`moe_layer_reference_fp8` is that layer, the one every FP8 kernel is checked
against. :func:`lora_fed_quantized_reference` is the mistake of feeding the LoRA the same quantized activation
as the base (one quantization of x shared by both GEMMs): dequantized, the adapter sees an error of a few percent
of its input that it never saw in training; as the raw FP8 codes (``scaled=False``, their scales dropped), it
sees its input multiplied by FP8_MAX over each group's largest magnitude.
"""
from __future__ import annotations

import torch

from ..reference import moe_layer_reference
from ..validate import check_bool, check_int
from .format import GROUP_SIZE, QuantizedExperts, dequantize_activation, quantize_activation


def quantize_dequantize_activation(t: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """``t`` [rows, K] as the base GEMM reads it: quantized to FP8 per row and group of ``group_size`` columns
    (from float32; float64 is rounded to float32 first) and dequantized back to t's dtype."""
    xq, scale = quantize_activation(t if t.dtype != torch.float64 else t.float(), group_size)
    return dequantize_activation(xq, scale, group_size, dtype=t.dtype)


def fp8_codes(t: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """The FP8 codes of ``t`` [rows, K] quantized per row and group, in t's dtype, without their scales: what a
    kernel reads when it takes the quantized activation for the activation (each group is t / scale)."""
    return quantize_activation(t if t.dtype != torch.float64 else t.float(), group_size)[0].to(t.dtype)


def _base(experts, group_size, quantize_inputs):
    """The dequantized float32 base weights and the base GEMMs' input function (None: unquantized)."""
    if not isinstance(experts, QuantizedExperts):
        raise TypeError(f"experts: expected a QuantizedExperts (moelora_lab.quant.quantize_experts or "
                        f"load_fp8_experts), got {type(experts).__name__}")
    G = check_int("group_size", group_size, low=1)
    check_bool("quantize_inputs", quantize_inputs)
    w13, w2 = experts.dequantize(torch.float32)

    def base_input(t):
        return quantize_dequantize_activation(t, G)
    return w13, w2, base_input if quantize_inputs else None


def moe_layer_reference_fp8(x, topk_ids, topk_weights, token_lora, experts: QuantizedExperts, w13_lora_a,
                            w13_lora_b, w2_lora_a, w2_lora_b, *, group_size: int = GROUP_SIZE,
                            quantize_inputs: bool = True) -> torch.Tensor:
    """The MoE-LoRA layer on FP8 base experts, [M, H] float32: :func:`moelora_lab.moe_layer_reference` on the
    dequantized weights of ``experts``, its base GEMMs reading x and h quantized per token and group of
    ``group_size`` columns (``quantize_inputs=False``: unquantized, weight-only FP8). The LoRA ops read the
    unquantized x and h; tokens without an adapter get exactly the base layer's output."""
    w13, w2, base_input = _base(experts, group_size, quantize_inputs)
    return moe_layer_reference(x, topk_ids, topk_weights, token_lora, w13, w2, w13_lora_a, w13_lora_b, w2_lora_a,
                               w2_lora_b, base_input=base_input)


def lora_fed_quantized_reference(x, topk_ids, topk_weights, token_lora, experts: QuantizedExperts, w13_lora_a,
                                 w13_lora_b, w2_lora_a, w2_lora_b, *, group_size: int = GROUP_SIZE,
                                 quantize_inputs: bool = True, scaled: bool = True) -> torch.Tensor:
    """The mistake, for comparison: :func:`moe_layer_reference_fp8` but with the LoRA ops fed the same
    quantized x and h as the base GEMMs: dequantized (``scaled=True``), or the raw FP8 codes without their scales
    (``scaled=False``, :func:`fp8_codes`). Its base is the spec's (same output without LoRA); only the LoRA term
    differs. ``quantize_inputs=False`` makes it the spec (nothing is quantized to feed the LoRA)."""
    w13, w2, base_input = _base(experts, group_size, quantize_inputs)
    check_bool("scaled", scaled)
    lora_input = base_input if scaled or base_input is None else (lambda t: fp8_codes(t, group_size))
    return moe_layer_reference(x, topk_ids, topk_weights, token_lora, w13, w2, w13_lora_a, w13_lora_b, w2_lora_a,
                               w2_lora_b, base_input=base_input, lora_input=lora_input)
