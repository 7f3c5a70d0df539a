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
passed as ``in_k=``); ``auto`` is sequential on the CPU and on a GPU two streams, or ``in_k`` where
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

import warnings

import torch

from ._backend import INTERPRET, on_device
from .align import make_block_lists
from .blocks import LayerPlan, RoutingStamp
from .dispatch import choice_rank, choose_config
from .moe import (MAX_FUSED_COLUMNS, GemmLoRA, fused_columns, gemm_tiles, moe_gemm, silu_and_mul,
                  topk_sum)
from .layer_in_gemm import buffers, epilogue_layer, fused_layer
from .ops import run_lora
from .paths import KERNEL_CHOICES, get_path, resolve_path
from .streams import SIDE_PRIORITIES, Streams
from .validate import (ANY_SLOT, check_choice, check_int, check_layer_inputs, check_lora_ranks, check_plan, check_routing,
                       check_values, routing_ranges)

SCHEDULES = ("sequential", "dual_stream", "fused", "epilogue", "in_k", "auto")
IN_GEMM = {"fused": "in_gemm", "epilogue": "epilogue"}      # schedules with the expand in the GEMMs: plan's lora_path
JOINS = ("fold", "vllm")
def fused_fits(num_loras: int, rank: int) -> bool:
    """Whether the in-GEMM LoRA can run: the stacked shrink of all adapters fits in registers."""
    return fused_columns(num_loras, rank) <= MAX_FUSED_COLUMNS


def _fused(schedule: str, fits: bool) -> bool:
    """Whether ``schedule`` expands the LoRA inside the GEMMs (a ValueError if the adapters are too wide)."""
    if schedule in IN_GEMM and not fits:
        raise ValueError(f"schedule={schedule!r}: the in-GEMM LoRA needs L*r <= {MAX_FUSED_COLUMNS} (padded "
                         "to a power of two, at least 16); use schedule='dual_stream' or 'sequential' for more or "
                         "wider adapters")
    return schedule in IN_GEMM


def resolve_schedule(schedule: str, device: torch.device, *, num_pairs: int = 0, num_experts: int = 1,
                     fits: bool = False, in_k_columns: int | None = None) -> str:
    """The schedule a call really runs (``fits``: :func:`fused_fits` for the layer's LoRA;
    ``in_k_columns``: L*r when the call brings an ``in_k`` pack, else None)."""
    check_choice("schedule", schedule, SCHEDULES)
    if _fused(schedule, fits):
        return schedule
    if schedule == "in_k" and in_k_columns is None:
        raise ValueError("schedule='in_k' needs the layer packed for it: pass in_k=pack_in_k(w13, w2, w13_lora_b, "
                         "w2_lora_b) and its views w13=in_k.w13, w2=in_k.w2")
    gpu = device.type == "cuda" and not INTERPRET
    if schedule == "auto":
        return gpu_schedule(num_pairs, num_experts, in_k_columns=in_k_columns) if gpu else "sequential"
    if schedule == "dual_stream" and not gpu:
        warnings.warn("schedule='dual_stream' needs CUDA streams; on the CPU the layer runs sequentially "
                      "(same kernels, same results)", RuntimeWarning, stacklevel=3)
        return "sequential"
    return schedule


# From the H200 (bf16, qwen3-30b-a3b, 4 adapters; data/h200/layer_in_k.csv): both LoRA ops in K beat two
# streams at r 16 (L*r = 64) from 128 pairs per expert (M = 2048: 1.175 against 1.238 of the layer without
# LoRA; M = 8192: 1.129 against 1.295), were level at 32 (M = 512) and lost below; at r 64 (L*r = 256) the
# wider K lost everywhere.
IN_K_MAX_COLUMNS = 64           # L*r
IN_K_MIN_PAIRS_PER_EXPERT = 128


def gpu_schedule(num_pairs: int, num_experts: int, *, in_k_columns: int | None = None) -> str:
    """What ``schedule="auto"`` runs on a GPU (without LoRA inside the GEMMs), for a layer of
    ``num_pairs`` pairs over ``num_experts`` experts, ``in_k_columns`` = L*r when the call brings an
    ``in_k`` pack (usable on the CPU, to read the data). ``in_k`` where the rule above says it pays;
    else two streams at every size: on the H200, with every schedule of a case timed in interleaved
    rounds, they beat one stream most at M = 1 (the LoRA's short launches hide under the base GEMMs)
    and least at the largest M (both streams' kernels are long and share the memory bus), where the
    two are level within what one schedule timed twice differs."""
    if num_pairs < 0 or num_experts < 1:
        raise ValueError(f"num_pairs / num_experts: need num_pairs >= 0 and num_experts >= 1, got {num_pairs}, "
                         f"{num_experts}")
    if (in_k_columns is not None and in_k_columns <= IN_K_MAX_COLUMNS
            and num_pairs >= IN_K_MIN_PAIRS_PER_EXPERT * num_experts):
        return "in_k"
    return "dual_stream"


def plan_layer(topk_ids, token_lora, num_experts: int, num_loras: int | None, rank: int | None, *,
               hidden: int | None = None, intermediate: int | None = None, lora_path: str = "auto",
               schedule: str = "auto", validate: bool = True, lora_ranks: torch.Tensor | None = None) -> LayerPlan:
    """Build the routing metadata (and pick the LoRA path) for :func:`moe_lora_layer`.

    ``num_loras=None`` plans a layer without LoRA; otherwise ``rank`` is the LoRA rank r of the
    weights the plan will serve. Reuse a plan across calls with the same routing tensors (w13 and
    w2, benchmarks, CUDA graphs that capture only the layer's kernels): the layer checks, without a
    device synchronisation, that it gets the tensors the plan was made from, unchanged.
    ``validate=False`` skips the id-range checks (one synchronisation) for routing already checked;
    the layer then checks the ids itself unless it is told ``validate=False`` too. A plan for
    ``schedule="fused"`` has no LoRA blocks: the base GEMMs carry the LoRA. ``lora_ranks`` ([L] per-slot
    ranks, on the CPU) lets ``lora_path="auto"`` pick by the largest real rank instead of r.
    """
    E = check_int("num_experts", num_experts, low=1)
    if num_loras is not None:
        check_int("num_loras", num_loras, low=1)
        if rank is None:
            raise TypeError("rank: expected an int (the LoRA rank r of the weights) when num_loras is given; pass "
                            "num_loras=None to plan a layer without LoRA")
        check_int("rank", rank, low=0)
        check_lora_ranks(lora_ranks, num_loras, rank)
    check_choice("schedule", schedule, SCHEDULES)
    get_path(lora_path, "lora_path", KERNEL_CHOICES)
    L = num_loras or ANY_SLOT
    M, k = check_routing(topk_ids, token_lora, E, L, values=validate)
    P = M * k
    tiles = gemm_tiles(P, E)
    with on_device(topk_ids):
        stamp = RoutingStamp.of(topk_ids, None if num_loras is None else token_lora, E, L, tiles["BLOCK_M"],
                                values_checked=validate)
        plan = dict(num_loras=num_loras, rank=rank, routing=stamp)
        base_list = (None, tiles["BLOCK_M"])
        in_gemm = num_loras is not None and rank != 0 and _fused(schedule, fused_fits(num_loras, rank))
        if num_loras is None or rank == 0 or (in_gemm and schedule == "fused"):
            # no LoRA, rank 0 (LoRA adds nothing) or the in-GEMM LoRA: the base blocks alone
            [base] = make_block_lists(topk_ids, None, E, [base_list], values_checked=validate)
            in_gemm = num_loras is not None and rank != 0
            return LayerPlan(base, None, "in_gemm" if in_gemm else None, **plan)
        path = "two_kernel" if in_gemm else resolve_path(     # epilogue: the two-kernel path's shrink
            lora_path, num_pairs=P, num_experts=E, num_loras=num_loras, rank=rank, add_inputs=False,
            token_rows=True, choice_rank=choice_rank(rank, lora_ranks), n_out=intermediate)
        cfg = choose_config(path, P, min(P, num_loras * E), intermediate or 1, 2, topk_ids.device, rank=rank)
        # both block lists from one construction (the same launches on a GPU)
        base, lora = make_block_lists(topk_ids, token_lora, E, [base_list, (num_loras, cfg.block_m)],
                                      values_checked=validate)
        return LayerPlan(base, lora, IN_GEMM["epilogue"] if in_gemm else path, **plan)


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
        'sequential', 'dual_stream', 'fused', 'epilogue', 'in_k' or 'auto' (see the module docstring).
    join : str
        'fold' or 'vllm' (the schedules with separate LoRA kernels only).
    lora_path : str
        'auto' or a Triton path of ``moelora_lab.PATHS`` for the separate LoRA kernels.
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
    check_choice("side_priority", side_priority, SIDE_PRIORITIES)
    check_choice("join", join, JOINS)
    check_choice("schedule", schedule, SCHEDULES)
    get_path(lora_path, "lora_path", KERNEL_CHOICES)
    with_lora = L is not None
    if in_k is not None:
        from .layer_in_k import check_in_k      # layer_in_k builds on this module
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
    columns = L * r if in_k is not None else None
    run = (resolve_schedule(schedule, x.device, num_pairs=P, num_experts=E, fits=fused_fits(L, r),
                            in_k_columns=columns) if active else "sequential")
    if (run in IN_GEMM or run == "in_k") and join != "fold":
        raise ValueError(f"join: {join!r} has no meaning with schedule={run!r} (the LoRA is added inside the GEMMs, "
                         "there is no join); leave join at 'fold' or pick another schedule")
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
            from .layer_in_k import in_k_layer
            return in_k_layer(x, topk_ids, topk_weights, token_lora, in_k.w13_ext, in_k.w2_ext, w13_lora_a,
                              w2_lora_a, plan=plan, lora_ranks=lora_ranks, validate=False, tracer=tracer)
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
                     mul_routed_weight=False, add_inputs=False, lora_ranks=lora_ranks)
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
                     mul_routed_weight=True, add_inputs=False, lora_ranks=lora_ranks)
        streams.join()
    delta2 = d2.view(P, H) if with_lora else None
    with streams.stage("sum", "main"):
        if with_lora and join == "vllm":
            c3.add_(delta2)
            delta2 = None
        topk_sum(c3, y, top_k=k, delta=delta2, token_lora=token_lora)
    return y
