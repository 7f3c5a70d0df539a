"""The ``sequential`` and ``dual_stream`` schedules: base GEMMs, the op's LoRA kernels, the joins.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, H hidden, I expert intermediate,
P = M*k pairs.

Both launch the same kernels on the same buffers (so their results are bitwise equal); with two streams
the LoRA kernels run on the side stream (``streams.Streams``), forked after their inputs are ready and
joined before the activation and the top-k sum read their deltas.

Joins: ``fold`` lets the LoRA kernels write their deltas only for pairs with an adapter into
uninitialised buffers, and the activation and the top-k sum read the delta where the token has an
adapter (no memset, no extra pass); ``vllm`` zero-fills the delta buffers, the LoRA kernels write into
them, then ``c += delta`` before the activation and before the sum, as vLLM joins them.

The base GEMMs go through ``quant.base_gemm``: on a quantized base (w13 and w2 FP8Weights) each quantizes its
input (x, then h) per row and group and runs the FP8 GEMM by its own tile rule; the LoRA kernels read the
unquantized x and h, as the spec (``quant.moe_layer_reference_fp8``) says.
"""
from __future__ import annotations

import torch

from ..base_moe import silu_and_mul, topk_sum
from ..op.face import run_lora
from ..quant.gemm import base_gemm
from .streams import Streams
from .table import LayerCall


def buffers(x, M: int, k: int, H: int, I: int):
    """The layer's activations, uninitialised, on the current stream: c1 [P, 2I], h [P, I], c3 [P, H], y [M, H]."""
    P = M * k
    return tuple(torch.empty(*shape, dtype=x.dtype, device=x.device) for shape in ((P, 2 * I), (P, I), (P, H), (M, H)))


def run(call: LayerCall) -> torch.Tensor:
    """y [M, H]: the base GEMMs on the current stream, the LoRA kernels on the side stream when ``call.dual``."""
    x, plan = call.x, call.plan
    M, k, E, H, I, L, r = call.dims
    P = M * k
    streams = Streams(call.dual, x.device, call.tracer, call.side_priority)
    c1, h, c3, y = buffers(x, M, k, H, I)
    lora = call.lora
    d13 = d2 = None
    if lora is not None:
        w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b = lora
        alloc = torch.zeros if call.join == "vllm" else torch.empty       # vLLM's join needs zeroed deltas
        d13 = alloc(M, k, 2 * I, dtype=x.dtype, device=x.device)
        d2 = alloc(M, k, H, dtype=x.dtype, device=x.device)
    lora_args = dict(add_inputs=False, lora_ranks=call.lora_ranks, side_stream=call.dual)

    fork = streams.fork()                        # x, routing and buffers are ready
    with streams.stage("base_w13", "main"):
        base_gemm(x, call.w13, plan.base_blocks, c1, top_k=k, tiles=plan.tiles)
    if lora is not None:
        with streams.side("lora_w13", fork):
            run_lora(x, call.topk_ids, call.topk_weights, call.token_lora, w13_lora_a, w13_lora_b, d13,
                     plan.lora_blocks, plan.lora_path, mul_routed_weight=False, **lora_args)
        streams.join()
    delta13 = d13.view(P, 2 * I) if lora is not None else None
    with streams.stage("act", "main"):
        if lora is not None and call.join == "vllm":
            c1.add_(delta13)
            delta13 = None
        silu_and_mul(c1, h, top_k=k, delta=delta13, token_lora=call.token_lora32)
    fork = streams.fork()                        # h is ready
    with streams.stage("base_w2", "main"):
        base_gemm(h, call.w2, plan.base_blocks, c3, top_k=k, topk_weights=call.weights, tiles=plan.tiles)
    if lora is not None:
        with streams.side("lora_w2", fork):
            run_lora(h, call.topk_ids, call.topk_weights, call.token_lora, w2_lora_a, w2_lora_b, d2,
                     plan.lora_blocks, plan.lora_path, mul_routed_weight=True, **lora_args)
        streams.join()
    delta2 = d2.view(P, H) if lora is not None else None
    with streams.stage("sum", "main"):
        if lora is not None and call.join == "vllm":
            c3.add_(delta2)
            delta2 = None
        topk_sum(c3, y, top_k=k, delta=delta2, token_lora=call.token_lora32)
    return y
