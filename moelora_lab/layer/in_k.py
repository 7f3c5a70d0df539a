"""The layer with LoRA in K: grouped GEMMs over inputs widened by each pair's shrink and weights widened by B.

Shape legend: M tokens, k top-k, E experts, L adapters, r rank, H hidden, I expert intermediate,
P = M*k pairs, S slices.

A pair of adapter l computes W x + B_l (A_l x). Widen both operands by L*r columns: x_ext = [x | T]
with T holding the pair's shrink A_l x in columns l*r .. l*r + r and zeros elsewhere, and W_ext =
[W | B of every slot] (packed once). Then W_ext x_ext is the base output plus the pair's own LoRA:
the LoRA rides the GEMM's pipelined K loop as a few more K steps, with no delta buffer and no join.

The weights are packed once (``in_k_pack``). The schedule, on one stream: w13's shrink writes T1 [S, P,
L*r] of both slices (x read by token, each pair's T in its adapter's r columns, zeros elsewhere), the w13
GEMM reads its last K steps from T1 (the pair's row) instead of x (``moe_gemm(..., x_tail=T1)``); the
activation writes h into the first I columns of h_ext [P, I + L*r] and w2's shrink writes T2 = A2 h
into the rest (``kernels/in_k.py``); the w2 GEMM is the plain grouped GEMM over h_ext and w2_ext. No
LoRA kernel runs beside a GEMM and no delta is written anywhere.

What it trades: the GEMMs' K grows by L*r (every pair multiplies through every slot's columns, zeros
but its own) and the shrinks run before their GEMMs, on the critical path, where two streams hide
them beside the base GEMMs. ``python -m moelora_lab.bench in_k`` measures where that pays.
"""
from __future__ import annotations

import torch

from .._backend import INTERPRET, on_device
from ..blocks import LayerPlan
from ..base_moe import moe_gemm, silu_and_mul, tail_start, topk_sum
from ..validate import check_layer_inputs, check_lora_ranks, check_plan, check_values, routing_ranges
from .in_k_launch import shrink_tail as _shrink_tail
from .in_k_pack import InKWeights, _split, _w2_split
from .streams import Streams
from .plan import plan_layer
from .table import AUTO_CPU, Dims, LayerCall

W13_ONE_READ = True   # the w13 shrink writes both slices from one read of x


def _prepare(x, topk_ids, topk_weights, token_lora, weights, plan, lora_ranks, validate):
    """The checks of the layers here that take packed weights directly (``weights``: w13, w2 and the four
    LoRA tensors, as the layer takes them); returns the dims, the plan (built here if None) and the ranks
    on x's device."""
    M, k, E, H, I, L, r = check_layer_inputs(x, topk_ids, topk_weights, token_lora, *weights)
    ranges = check_lora_ranks(lora_ranks, L, r)
    checked = check_plan(plan, topk_ids, token_lora, E, L, r) if plan is not None else False
    if plan is not None and plan.lora_blocks is None and r:
        raise ValueError(f"plan: made for schedule={plan.schedule!r}, whose GEMMs carry the LoRA (no LoRA blocks); "
                         f"pass plan_layer(..., schedule={AUTO_CPU!r})")
    if validate:
        check_values(ranges + ([] if checked else routing_ranges(topk_ids, token_lora, E, L)))
    if x.device.type != "cuda" and not INTERPRET:
        raise ValueError(f"x: the layer's Triton kernels need CUDA tensors (got {x.device}); set "
                         "MOELORA_INTERPRET=1 before importing moelora_lab to run them on the CPU")
    if M and plan is None:
        with on_device(x):
            plan = plan_layer(topk_ids, token_lora, E, L, r, intermediate=I, schedule=AUTO_CPU,
                              validate=False, lora_ranks=lora_ranks)
    if lora_ranks is not None:
        lora_ranks = lora_ranks.to(device=x.device, dtype=torch.int32).contiguous()
    return Dims(M, k, E, H, I, L, r), plan, lora_ranks


def in_k_layer(x, topk_ids, topk_weights, token_lora, w13_ext, w2_ext, w13_lora_a, w2_lora_a, *,
               plan: LayerPlan | None = None, lora_ranks: torch.Tensor | None = None, validate: bool = True,
               tracer=None) -> torch.Tensor:
    """y [M, H] of the MoE layer with LoRA, as :func:`moelora_lab.moe_lora_layer` computes it, with both
    LoRA ops in their GEMMs' K, on one stream (``w13_ext`` from :func:`pack_w13_in_k`, ``w2_ext`` from
    :func:`pack_w2_in_k`): the ``in_k`` schedule for callers holding the packed weights alone. ``plan``:
    from ``plan_layer`` on these routing tensors (built here if None). Other arguments as for the layer."""
    call = in_k_call(x, topk_ids, topk_weights, token_lora, w13_ext, w2_ext, w13_lora_a, w2_lora_a, plan=plan,
                     lora_ranks=lora_ranks, validate=validate, tracer=tracer)
    if call.dims.M == 0:
        return x.new_empty(0, call.dims.H)
    with on_device(x):
        return run(call)


def in_k_call(x, topk_ids, topk_weights, token_lora, w13_ext, w2_ext, w13_lora_a, w2_lora_a, *, plan, lora_ranks,
              validate, tracer) -> LayerCall:
    """The validated :class:`LayerCall` of :func:`in_k_layer`'s arguments (the pack is rebuilt from the views)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise TypeError(f"x: expected a tensor [M, H], got {getattr(x, 'shape', type(x).__name__)}")
    H = x.shape[1]
    w13, w13_lora_b = _split(w13_ext, tail_start(H), H, w13_lora_a, 2,
                             ("w13_ext", "w13_lora_a", "pack_w13_in_k(w13, w13_lora_b)"))
    w2, w2_lora_b = _w2_split(w2_ext, w13, w2_lora_a)
    lora = (w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b)
    dims, plan, lora_ranks = _prepare(x, topk_ids, topk_weights, token_lora, (w13, w2, *lora), plan, lora_ranks,
                                      validate)
    pack = InKWeights(w13, w2, w13_ext, w2_ext, (*w13_lora_b, *w2_lora_b), ())
    return LayerCall(x, topk_ids, topk_weights, topk_weights.reshape(-1).float().contiguous(), token_lora,
                     token_lora.to(torch.int32).contiguous(), w13, w2, lora, lora_ranks, pack, plan, dims,
                     tracer=tracer)


def run(call: LayerCall) -> torch.Tensor:
    """y [M, H] of the ``in_k`` schedule: each op's shrink into its GEMM's tail columns, then the GEMM."""
    M, k, E, H, I, L, r = call.dims
    w2_lora_a = call.lora[2]
    x, t13, streams = shrink_w13(call)
    c1, h_ext = x.new_empty(M * k, 2 * I), x.new_empty(M * k, I + L * r)
    with streams.stage("w13+lora", "main"):
        moe_gemm(x, call.in_k.w13_ext, call.plan.base_blocks, c1, top_k=k, tiles=call.plan.tiles, x_tail=t13)
    act_and_shrink(c1, None, h_ext, w2_lora_a[0], call.plan, call.token_lora32, streams, k, H, I, r,
                   call.lora_ranks)
    return w2_and_sum(h_ext, call.in_k.w2_ext, call.plan, call.token_lora32, call.weights, streams, M, k, H)


def shrink_w13(call: LayerCall):
    """Where the runners of the LoRA in K start: (x contiguous, t13 [2, P, L*r] holding w13's shrink of every
    pair in its adapter's columns, the one-stream ``Streams`` its stage was recorded on)."""
    M, k, E, H, I, L, r = call.dims
    w13_lora_a = call.lora[0]
    x = call.x.contiguous()
    streams = Streams(False, x.device, call.tracer)
    t13 = x.new_empty(2, M * k, L * r)
    with streams.stage("shrink_w13", "main"):
        _shrink_tail(x, w13_lora_a, call.plan, call.token_lora32, k, t13, I, r, call.lora_ranks, token_rows=True,
                     one_read=W13_ONE_READ)
    return x, t13, streams


def act_and_shrink(c1, delta, h_ext, a2, plan, token_lora32, streams, k: int, H: int, I: int, r: int,
                   lora_ranks) -> None:
    """h_ext = [h | T2]: the activation (with w13's delta where given) into the first I columns, then
    w2's shrink of the LoRA blocks into the tail (``shrink_tail_kernel``)."""
    with streams.stage("act", "main"):
        silu_and_mul(c1, h_ext[:, :I], top_k=k, delta=delta, token_lora=token_lora32 if delta is not None else None)
    with streams.stage("shrink_w2", "main"):
        _shrink_tail(h_ext, [a2], plan, token_lora32, k, h_ext[:, I:].unsqueeze(0), H, r, lora_ranks)


def w2_and_sum(h_ext, w2_ext, plan, token_lora32, weights, streams, M: int, k: int, H: int):
    """The layer from h_ext = [h | T2] on: the w2 GEMM over h_ext and w2_ext (``weights`` [P] float32), the
    top-k sum."""
    P = M * k
    c3, y = h_ext.new_empty(P, H), h_ext.new_empty(M, H)
    with streams.stage("w2+lora", "main"):
        moe_gemm(h_ext, w2_ext, plan.base_blocks, c3, top_k=k, topk_weights=weights, tiles=plan.tiles)
    with streams.stage("sum", "main"):
        topk_sum(c3, y, top_k=k)
    return y
