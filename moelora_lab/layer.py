"""The MoE layer with LoRA on its routed experts, run on one stream or two.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, H hidden, I expert intermediate,
P = M*k pairs.

    c1 = W13[e] x_t            (base, main stream)   d13 = B13 A13 x_t       (LoRA, side stream)
    h  = silu(c1g + d13g) * (c1u + d13u)             -- the join of the w13 pair
    c3 = w * W2[e] h           (base, main stream)   d2  = w * B2 A2 h       (LoRA, side stream)
    y  = sum_j c3 + d2                               -- the join of the w2 pair

Schedules: ``sequential`` runs everything on the current stream; ``dual_stream`` runs the LoRA ops
on one process-wide side stream, forked and joined with CUDA events, so they can overlap the base
GEMMs (both launch the same kernels on the same buffers, so their results are bitwise equal);
``fused`` computes the LoRA inside the base grouped GEMMs (``kernels/base_moe``: no LoRA launch, no
delta buffer, no join; for L*r <= ``moe.MAX_FUSED_COLUMNS``); ``epilogue`` shrinks once per pair with
the two-kernel path's shrink (T [S, P, r], the only LoRA bytes in HBM) and expands inside the base
GEMMs, before their K loop (one dot of K = L*r per output tile; same limit on L*r), so no N tile recomputes
the shrink and no delta is written or read back; ``in_k`` puts both LoRA ops in their GEMMs' K
(``layer_in_k.in_k_layer``, one stream; needs the weights packed once by ``layer_in_k.pack_in_k``,
passed as ``in_k=``); ``in_join`` computes the LoRA inside the activation and the top-k sum
(``layer_in_join``: w13's shrink is the only LoRA launch, beside the w13 GEMM; no delta, no LoRA kernel
between the w2 GEMM and the sum); ``auto`` is sequential on the CPU and on a GPU two streams, or ``in_k`` where
``gpu_schedule`` says it pays and the call brings a pack (H200 data in ``data/h200/layer.csv``).

The side stream has the highest priority the device offers (``side_priority="highest"``): the
block scheduler then places the LoRA kernels' programs ahead of the base GEMM's waiting ones, so the
short LoRA work finishes early and the long base GEMM absorbs it. At ``"default"`` priority the LoRA
programs queue behind the base GEMM's, and two streams lost to one at rank 16 from M = 16 to 512.

Joins: ``fold`` (ours) lets the LoRA kernels write their deltas only for pairs with an adapter
into uninitialised buffers, and the activation and the top-k sum read the delta where the token has
an adapter: no memset, no extra pass. ``vllm`` reproduces vLLM's join for comparison: zero-fill a
delta buffer, LoRA writes into it, then ``c += delta`` before the activation and before the sum.

Buffer lifetimes: every tensor the side stream touches is either allocated on the main stream
before the fork (so the caching allocator orders its reuse after the main stream's next work) or
allocated on the side stream itself; the main stream waits for the side stream's event before it
reads a delta and before the function returns, so no buffer is released while the side stream may
still use it, and no ``record_stream`` is needed. Events are created per call, which keeps them
valid under CUDA-graph capture and replay.
"""
from __future__ import annotations

import torch

from ._backend import INTERPRET, on_device
from .blocks import LayerPlan
from .moe import GemmLoRA, gemm_tiles, moe_gemm, silu_and_mul, topk_sum
from .layer_in_gemm import buffers, epilogue_layer, fused_layer
from .layer_in_join import in_join_layer
from .layer_in_k import check_in_k, in_k_layer
from .layer_plan import (IN_GEMM, IN_K_MAX_COLUMNS, IN_K_MIN_PAIRS_PER_EXPERT, SCHEDULES, fused_fits,  # noqa: F401
                         _streams_run, gpu_schedule, ignored_argument, plan_layer, resolve_schedule)
from .ops import run_lora
from .paths import KERNEL_CHOICES, get_path
from .streams import SIDE_PRIORITIES, Streams
from .validate import (ANY_SLOT, check_bool, check_choice, check_layer_inputs, check_lora_ranks, check_plan, check_values,
                       routing_ranges)

JOINS = ("fold", "vllm")


def moe_lora_layer(x, topk_ids, topk_weights, token_lora, w13, w2, w13_lora_a=None, w13_lora_b=None,
                   w2_lora_a=None, w2_lora_b=None, *, schedule: str = "auto", join: str = "fold",
                   lora_path: str = "auto", plan: LayerPlan | None = None, tracer=None,
                   lora_ranks: torch.Tensor | None = None, side_priority: str = "highest",
                   validate: bool = True, in_k=None) -> torch.Tensor:
    """One MoE layer with LoRA on w13 (2 slices) and w2 (1 slice): y [M, H] in x's dtype.

    Parameters
    ----------
    x : torch.Tensor
        [M, H] activations, float32/float16/bfloat16 (bfloat16 only on a GPU).
    topk_ids, topk_weights : torch.Tensor
        [M, k] expert ids (int32/int64, in [0, E)) and routing weights (float) of each token.
    token_lora : torch.Tensor
        [M] int32/int64 adapter slot of each token in [0, L), -1 = no adapter.
    w13, w2 : torch.Tensor
        Base expert weights in x's dtype: w13 [E, 2I, H] (gate rows [0, I), up rows [I, 2I)) and
        w2 [E, H, I] (down projection).
    w13_lora_a, w13_lora_b : list of torch.Tensor, optional
        w13's LoRA, two slices (gate, up): A 2 x [L, E, r, H], B 2 x [L, E, I, r].
    w2_lora_a, w2_lora_b : list of torch.Tensor, optional
        w2's LoRA, one slice: A 1 x [L, E, r, I], B 1 x [L, E, H, r]. Give all four LoRA arguments or
        none (none: the plain MoE layer); same L and r for w13 and w2, scaling folded into B.
    schedule : str
        'sequential', 'dual_stream', 'fused', 'epilogue', 'in_k', 'in_join' or 'auto' (see the module
        docstring).
    join : str
        'fold' or 'vllm' (the schedules with separate LoRA kernels only).
    lora_path : str
        'auto' or a Triton path of ``moelora_lab.PATHS`` for the separate LoRA kernels ('auto' on two
        streams follows the side stream's rule, ``dispatch.choose_side_path``).
    plan : LayerPlan, optional
        From :func:`plan_layer` for these very routing tensors: skips building the routing metadata
        (and, when the plan checked them, the id-range checks).
    tracer : profile.timeline.Tracer, optional
        Records per-stream intervals of every stage.
    lora_ranks : torch.Tensor, optional
        [L] int actual rank of each slot, as in :func:`moelora_lab.moe_lora` (given on the CPU,
        ``lora_path="auto"`` picks by the largest real rank).
    side_priority : str
        'highest' or 'default', the priority of the side stream when two streams run.
    validate : bool
        False skips the id-range checks (one device synchronisation) for ids you have checked.
    in_k : layer_in_k.InKWeights, optional
        ``pack_in_k(w13, w2, w13_lora_b, w2_lora_b)``, with ``w13=in_k.w13`` and ``w2=in_k.w2``: lets
        the call run ``schedule="in_k"`` (and ``auto`` pick it) from one copy of the base weights.

    Returns
    -------
    torch.Tensor
        y [M, H] in x's dtype.
    """
    M, k, E, H, I, L, r = check_layer_inputs(x, topk_ids, topk_weights, token_lora, w13, w2, w13_lora_a, w13_lora_b,
                                             w2_lora_a, w2_lora_b)
    check_bool("validate", validate)
    check_choice("side_priority", side_priority, SIDE_PRIORITIES)
    check_choice("join", join, JOINS)
    check_choice("schedule", schedule, SCHEDULES)
    get_path(lora_path, "lora_path", KERNEL_CHOICES)
    with_lora = L is not None
    if lora_ranks is not None and not with_lora:
        raise ValueError("lora_ranks: given, but the call has no LoRA weights (w13_lora_a ... w2_lora_b); drop "
                         "lora_ranks or pass the four LoRA lists")
    if in_k is not None:
        check_in_k(in_k, w13, w2, w13_lora_b, w2_lora_b)
    ranges = check_lora_ranks(lora_ranks, L, r) if with_lora else []
    checked = check_plan(plan, topk_ids, token_lora, E, L, r) if plan is not None else False
    if validate:
        check_values(ranges + ([] if checked else routing_ranges(topk_ids, token_lora, E, L or ANY_SLOT)))
    if x.device.type != "cuda" and not INTERPRET:
        raise ValueError(f"x: the layer's Triton kernels need CUDA tensors (got {x.device}); set "
                         "MOELORA_INTERPRET=1 before importing moelora_lab to run them on the CPU")
    if INTERPRET and x.dtype == torch.bfloat16:
        raise TypeError("x: bfloat16 is mis-computed by the Triton interpreter; use float32 or float16 on the CPU")
    if M == 0:
        return x.new_empty(0, H)
    active = with_lora and r > 0                      # rank 0: the LoRA adds nothing
    P = M * k
    run = (resolve_schedule(schedule, x.device, num_pairs=P, num_experts=E, fits=fused_fits(L, r),
                            in_k_columns=L * r if in_k is not None else None, join=join, lora_path=lora_path)
           if active else "sequential")
    why = ignored_argument(run, join, lora_path)
    if why:
        raise ValueError(why)
    if plan is not None and active:
        made_for = next((sched for sched, marker in IN_GEMM.items() if plan.lora_path == marker), None)
        if made_for != (run if run in IN_GEMM else None):
            raise TypeError(f"plan: made for another schedule than this call's ({run!r}); pass plan_layer(..., "
                            f"schedule={schedule!r}) with the layer's num_loras and rank")
        if lora_path != "auto" and run not in IN_GEMM and plan.lora_path != lora_path:
            raise ValueError(f"lora_path: {lora_path!r}, but the plan was made for {plan.lora_path!r}; make the plan "
                             f"with plan_layer(..., lora_path={lora_path!r})")
    with on_device(x):
        if plan is None:
            plan = plan_layer(topk_ids, token_lora, E, L, r, hidden=H, intermediate=I, lora_path=lora_path,
                              schedule=run, validate=False, lora_ranks=lora_ranks)
        if lora_ranks is not None:
            lora_ranks = lora_ranks.to(device=x.device, dtype=torch.int32).contiguous()
        weights = topk_weights.reshape(-1).float().contiguous()
        if run == "fused":
            token_lora = token_lora.to(torch.int32).contiguous()
            return fused_layer(x, topk_ids, weights, token_lora, w13, w2, plan.base_blocks,
                                tiles=gemm_tiles(P, E, lora=True),
                                lora13=GemmLoRA(token_lora, w13_lora_a, w13_lora_b, lora_ranks),
                                lora2=GemmLoRA(token_lora, w2_lora_a, w2_lora_b, lora_ranks), tracer=tracer)
        if run == "in_k":
            return in_k_layer(x, topk_ids, topk_weights, token_lora, in_k.w13_ext, in_k.w2_ext, w13_lora_a,
                              w2_lora_a, plan=plan, lora_ranks=lora_ranks, validate=False, tracer=tracer)
        if run == "in_join":
            return in_join_layer(x, topk_ids, weights, token_lora.to(torch.int32).contiguous(), w13, w2,
                                 (w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b), plan, lora_ranks, tracer,
                                 dual=_streams_run(x.device), side_priority=side_priority)
        if run == "epilogue":
            return epilogue_layer(x, topk_ids, weights, token_lora.to(torch.int32).contiguous(), w13, w2,
                                   (w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b), plan, lora_ranks, tracer)
        lora = (w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b) if active else None
        return _two_kernel_layer(x, topk_ids, topk_weights, weights, token_lora, w13, w2, lora, plan,
                                 dual=run == "dual_stream", join=join, lora_ranks=lora_ranks, tracer=tracer,
                                 side_priority=side_priority)


def _two_kernel_layer(x, topk_ids, topk_weights, weights, token_lora, w13, w2, lora, plan, *, dual, join,
                      lora_ranks, tracer, side_priority):
    """The ``sequential`` and ``dual_stream`` schedules: base GEMMs, LoRA kernels, joins."""
    M, k = topk_ids.shape
    E, H, I = w2.shape
    P = M * k
    tiles = gemm_tiles(P, E)
    base_blocks, lora_blocks, path = plan.base_blocks, plan.lora_blocks, plan.lora_path
    streams = Streams(dual, x.device, tracer, side_priority)
    c1, h, c3, y = buffers(x, M, k, H, I)
    with_lora = lora is not None
    d13 = d2 = None
    if with_lora:
        w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b = lora
        alloc = torch.zeros if join == "vllm" else torch.empty       # vLLM's join needs zeroed deltas
        d13 = alloc(M, k, 2 * I, dtype=x.dtype, device=x.device)
        d2 = alloc(M, k, H, dtype=x.dtype, device=x.device)

    fork = streams.fork()                        # x, routing and buffers are ready
    with streams.stage("base_w13", "main"):
        moe_gemm(x, w13, base_blocks, c1, top_k=k, tiles=tiles)
    if with_lora:
        with streams.side("lora_w13", fork):
            run_lora(x, topk_ids, topk_weights, token_lora, w13_lora_a, w13_lora_b, d13, lora_blocks, path,
                     mul_routed_weight=False, add_inputs=False, lora_ranks=lora_ranks, side_stream=dual)
        streams.join()
    delta13 = d13.view(P, 2 * I) if with_lora else None
    with streams.stage("act", "main"):
        if with_lora and join == "vllm":
            c1.add_(delta13)
            delta13 = None
        silu_and_mul(c1, h, top_k=k, delta=delta13, token_lora=token_lora)
    fork = streams.fork()                        # h is ready
    with streams.stage("base_w2", "main"):
        moe_gemm(h, w2, base_blocks, c3, top_k=k, topk_weights=weights, tiles=tiles)
    if with_lora:
        with streams.side("lora_w2", fork):
            run_lora(h, topk_ids, topk_weights, token_lora, w2_lora_a, w2_lora_b, d2, lora_blocks, path,
                     mul_routed_weight=True, add_inputs=False, lora_ranks=lora_ranks, side_stream=dual)
        streams.join()
    delta2 = d2.view(P, H) if with_lora else None
    with streams.stage("sum", "main"):
        if with_lora and join == "vllm":
            c3.add_(delta2)
            delta2 = None
        topk_sum(c3, y, top_k=k, delta=delta2, token_lora=token_lora)
    return y

