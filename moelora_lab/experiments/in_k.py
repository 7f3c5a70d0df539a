"""Two variants of the LoRA in K that were measured and lost to the ``in_k`` schedule.

Shape legend: M tokens, k top-k, E experts, L adapters, r rank, H hidden, I expert intermediate,
P = M*k pairs, S slices.

- ``w2_in_k_layer``: only w2's LoRA in K; w13 as the two-stream layer runs it (base GEMM on the main
  stream, w13's LoRA on the side stream, joined before the activation), then the activation and w2's
  shrink into h_ext [P, I + L*r] and the plain grouped GEMM over h_ext and w2_ext.
- ``in_k_overlap_layer``: the ``in_k`` schedule with each shrink and its GEMM as one launch, the GEMM
  tiles waiting for the shrink only before their tail K steps (``experiments/kernels/in_k_overlap``).

Both are timed by ``python -m moelora_lab.bench in_k`` (data/h200/layer_in_k.csv and its README row).
"""
from __future__ import annotations

import torch

from .._backend import INTERPRET, on_device
from ..blocks import LayerPlan
from ..layer.in_k import W13_ONE_READ, _prepare, act_and_shrink, in_k_call, w2_and_sum
from ..layer.in_k_pack import _w2_split
from ..layer.streams import Streams
from ..base_moe import moe_gemm, silu_and_mul, tail_start, topk_sum
from ..op.face import run_lora
from ..layer.in_k_launch import gemm_after_shrink


def w2_in_k_layer(x, topk_ids, topk_weights, token_lora, w13, w2_ext, w13_lora_a, w13_lora_b, w2_lora_a, *,
                  plan: LayerPlan | None = None, dual: bool | None = None, lora_ranks: torch.Tensor | None = None,
                  validate: bool = True, tracer=None) -> torch.Tensor:
    """y [M, H] of the MoE layer with LoRA, as :func:`moelora_lab.moe_lora_layer` computes it, with w2's
    LoRA in the w2 GEMM's K (``w2_ext`` from :func:`pack_w2_in_k`). ``plan``: from ``plan_layer(...,
    schedule="sequential")`` on these routing tensors (built here if None). ``dual``: w13's LoRA on a
    side stream (default: on a CUDA GPU; never on the CPU). Other arguments as for the layer."""
    w2, w2_lora_b = _w2_split(w2_ext, w13, w2_lora_a)
    weights = (w13, w2, w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b)
    (M, k, E, H, I, L, r), plan, lora_ranks = _prepare(x, topk_ids, topk_weights, token_lora, weights, plan,
                                                       lora_ranks, validate)
    gpu = x.device.type == "cuda" and not INTERPRET
    if dual and not gpu:
        raise ValueError("dual: True needs CUDA streams; leave it None (or False) on the CPU")
    if M == 0:
        return x.new_empty(0, H)
    P = M * k
    with on_device(x):
        token_lora32 = token_lora.to(torch.int32).contiguous()
        streams = Streams(gpu if dual is None else dual, x.device, tracer)
        c1 = x.new_empty(P, 2 * I)
        h_ext = x.new_empty(P, I + L * r)
        d13 = x.new_empty(M, k, 2 * I)
        fork = streams.fork()
        with streams.stage("base_w13", "main"):
            moe_gemm(x, w13, plan.base_blocks, c1, top_k=k, tiles=plan.tiles)
        with streams.side("lora_w13", fork):
            run_lora(x, topk_ids, topk_weights, token_lora, w13_lora_a, w13_lora_b, d13, plan.lora_blocks,
                     plan.lora_path, mul_routed_weight=False, add_inputs=False, lora_ranks=lora_ranks)
        streams.join()
        act_and_shrink(c1, d13.view(P, 2 * I), h_ext, w2_lora_a[0], plan, token_lora32, streams, k, H, I, r,
                        lora_ranks)
        return w2_and_sum(h_ext, w2_ext, plan, token_lora32, topk_weights.reshape(-1).float().contiguous(), streams, M,
                          k, H)



def in_k_overlap_layer(x, topk_ids, topk_weights, token_lora, w13_ext, w2_ext, w13_lora_a, w2_lora_a, *,
                       plan: LayerPlan | None = None, lora_ranks: torch.Tensor | None = None, validate: bool = True,
                       tracer=None) -> torch.Tensor:
    """:func:`moelora_lab.layer.in_k.in_k_layer` with each shrink and its GEMM as one launch (same arguments)."""
    call = in_k_call(x, topk_ids, topk_weights, token_lora, w13_ext, w2_ext, w13_lora_a, w2_lora_a, plan=plan,
                     lora_ranks=lora_ranks, validate=validate, tracer=tracer)
    M, k, E, H, I, L, r = call.dims
    if M == 0:
        return x.new_empty(0, H)
    P = M * k
    with on_device(x):
        x = x.contiguous()
        streams = Streams(False, x.device, tracer)
        t13 = x.new_empty(2, P, L * r)
        c1, h_ext = x.new_empty(P, 2 * I), x.new_empty(P, I + L * r)
        return _overlapped(x, call.plan, call.token_lora32, call.weights, w13_lora_a, w2_lora_a[0], w13_ext, w2_ext,
                           t13, c1, h_ext, streams, call.lora_ranks, M, k, H, I, r)


def _overlapped(x, plan, token_lora32, weights, a13, a2, w13_ext, w2_ext, t13, c1, h_ext, streams, lora_ranks,
                M: int, k: int, H: int, I: int, r: int):
    """``in_k_overlap_layer`` from its buffers on: each shrink in one launch with its GEMM."""
    P = M * k
    with streams.stage("w13+lora", "main"):
        gemm_after_shrink(x, a13, plan, token_lora32, k, t13, I, r, lora_ranks, x, w13_ext, c1, x_cols=H,
                          tail_at=tail_start(H), token_rows=True, one_read=W13_ONE_READ)
    with streams.stage("act", "main"):
        silu_and_mul(c1, h_ext[:, :I], top_k=k)
    c3, y = x.new_empty(P, H), x.new_empty(M, H)
    with streams.stage("w2+lora", "main"):
        gemm_after_shrink(h_ext, [a2], plan, token_lora32, k, h_ext[:, I:].unsqueeze(0), H, r, lora_ranks, h_ext,
                          w2_ext, c3, x_cols=I, tail_at=I, topk_weights=weights)
    with streams.stage("sum", "main"):
        topk_sum(c3, y, top_k=k)
    return y



