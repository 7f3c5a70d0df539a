"""Quantized base experts: FP8 e4m3 weights with float32 block scales (``format``), per-token-group FP8
activations, and the base layer on them."""
from .format import (BLOCK_SIZE, FP8_DTYPE, FP8_MAX, GROUP_SIZE, FP8Weight, QuantizedExperts, dequantize_activation,
                     quantize_activation, quantize_experts, quantize_weight)
from .gemm import base_gemm, fp8_block_k, fp8_gemm_tiles, moe_gemm_fp8, quantize_rows
from .files import load_fp8_experts, save_fp8_experts
from .reference import fp8_codes, lora_fed_quantized_reference, moe_layer_reference_fp8, quantize_dequantize_activation

__all__ = ["BLOCK_SIZE", "FP8_DTYPE", "FP8_MAX", "GROUP_SIZE", "FP8Weight", "QuantizedExperts",
           "dequantize_activation", "quantize_activation", "quantize_experts", "quantize_weight",
           "load_fp8_experts", "save_fp8_experts", "fp8_codes", "lora_fed_quantized_reference", "moe_layer_reference_fp8",
           "quantize_dequantize_activation", "base_gemm", "fp8_block_k", "fp8_gemm_tiles", "moe_gemm_fp8",
           "quantize_rows"]
