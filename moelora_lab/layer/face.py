"""The face of the MoE layer with LoRA on its routed experts: validate once, plan once, run a schedule.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, H hidden, I expert intermediate,
P = M*k pairs.

    c1 = W13[e] x_t            (base)        d13 = B13 A13 x_t       (LoRA)
    h  = silu(c1g + d13g) * (c1u + d13u)     -- the join of the w13 pair
    c3 = w * W2[e] h           (base)        d2  = w * B2 A2 h       (LoRA)
    y  = sum_j c3 + d2                       -- the join of the w2 pair

How the LoRA is computed and where it joins the base is the schedule: a row of ``table.SCHEDULES``
(what each does, its streams, stages, the arguments it honours and its limits). ``schedule="auto"`` is
``sequential`` on the CPU and on a GPU two streams, or ``in_k`` where ``plan.gpu_schedule`` says it pays
and the call brings a pack (H200 data in ``data/h200/layer.csv``).

The side stream of ``dual_stream`` has the highest priority the device offers (``side_priority="highest"``):
the block scheduler then places the LoRA kernels' programs ahead of the base GEMM's waiting ones, so the
short LoRA work finishes early and the long base GEMM absorbs it. At ``"default"`` priority the LoRA
programs queue behind the base GEMM's, and two streams lost to one at rank 16 from M = 16 to 512.

Buffer lifetimes: every tensor the side stream touches is either allocated on the main stream before
the fork (so the caching allocator orders its reuse after the main stream's next work) or allocated on
the side stream itself; the main stream waits for the side stream's event before it reads a delta and
before the function returns, so no buffer is released while the side stream may still use it, and no
``record_stream`` is needed. Events are created per call, which keeps them valid under CUDA-graph
capture and replay.
"""
from __future__ import annotations

import torch

from .._backend import INTERPRET, on_device
from ..blocks import LayerPlan
from ..op.paths import KERNEL_CHOICES, get_path
from ..validate import (ANY_SLOT, check_bool, check_choice, check_layer_inputs, check_lora_ranks, check_plan,
                        check_values, routing_ranges, wants_grad)
from .fp8 import BASE_DTYPES, base_tensors, quantized_base, refuse_in_k, without_backward
from .in_k_pack import check_in_k
from .plan import _streams_run, plan_layer, resolve_schedule
from .streams import SIDE_PRIORITIES
from .table import AUTO, AUTO_CPU, JOINS, Dims, LayerCall, choices, get_schedule


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
    w13, w2 : torch.Tensor or quant.FP8Weight
        Base expert weights in x's dtype: w13 [E, 2I, H] (gate rows [0, I), up rows [I, 2I)) and
        w2 [E, H, I] (down projection). Or both quantized (``quant.quantize_experts(w13, w2)``'s ``.w13`` and
        ``.w2``): the base GEMMs then read x and h quantized per row and group of 128 columns (``quant.base_gemm``),
        the LoRA the unquantized ones; only the schedules whose row serves it run (``auto`` picks among them),
        without a backward (see ``layer.fp8``).
    w13_lora_a, w13_lora_b : list of torch.Tensor, optional
        w13's LoRA, two slices (gate, up): A 2 x [L, E, r, H], B 2 x [L, E, I, r].
    w2_lora_a, w2_lora_b : list of torch.Tensor, optional
        w2's LoRA, one slice: A 1 x [L, E, r, I], B 1 x [L, E, H, r]. Give all four LoRA arguments or
        none (none: the plain MoE layer); same L and r for w13 and w2, scaling folded into B.
    schedule : str
        A row of ``moelora_lab.layer.SCHEDULES`` or 'auto' (see the module docstring).
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
    in_k : layer.in_k.InKWeights, optional
        ``pack_in_k(w13, w2, w13_lora_b, w2_lora_b)``, with ``w13=in_k.w13`` and ``w2=in_k.w2``: lets
        the call run ``schedule="in_k"`` (and ``auto`` pick it) from one copy of the base weights.

    Returns
    -------
    torch.Tensor
        y [M, H] in x's dtype. Differentiable: where grad mode is on and x, topk_weights or a LoRA factor
        requires grad, the call runs inside ``moelora_lab.layer.grad.MoELoRALayerFunction`` (gradients to
        those; w13 and w2 are frozen: a ValueError if they require grad; the experiment schedules refuse).

    Examples
    --------
    >>> import torch
    >>> import moelora_lab as ml
    >>> p = ml.make_problem("tiny", ml.LoRAShape(num_loras=2, rank=4), num_tokens=8, seed=0)
    >>> y = ml.moe_lora_layer(**p.layer_inputs())          # schedule="auto": "sequential" on the CPU
    >>> tuple(y.shape)                                      # [M, H]
    (8, 64)
    >>> torch.allclose(y, ml.moe_layer_reference(**p.layer_inputs()), rtol=1e-4, atol=1e-4)
    True
    >>> plan = ml.plan_layer(p.topk_ids, p.token_lora, p.shape.num_experts, 2, 4)   # routing metadata, once
    >>> torch.equal(ml.moe_lora_layer(**p.layer_inputs(), plan=plan), y)
    True
    """
    quantized = quantized_base(w13, w2)
    M, k, E, H, I, L, r = check_layer_inputs(x, topk_ids, topk_weights, token_lora, *base_tensors(w13, w2),
                                             w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b,
                                             base_dtypes=BASE_DTYPES if quantized else None)
    check_bool("validate", validate)
    check_choice("side_priority", side_priority, SIDE_PRIORITIES)
    check_choice("join", join, JOINS)
    check_choice("schedule", schedule, choices())
    get_path(lora_path, "lora_path", KERNEL_CHOICES)
    if quantized:                                     # what cannot run an FP8 base refuses by name, LoRA or not
        why = schedule != AUTO and get_schedule(schedule).refuses_fp8()
        if why:
            raise ValueError(why)
        refuse_in_k(in_k)
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
    if quantized and wants_grad(x, topk_weights, w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b):
        return without_backward(moe_lora_layer, x, topk_ids, topk_weights, token_lora, w13, w2, w13_lora_a,
                                w13_lora_b, w2_lora_a, w2_lora_b, schedule=schedule, join=join, lora_path=lora_path,
                                plan=plan, tracer=tracer, lora_ranks=lora_ranks, side_priority=side_priority,
                                validate=False)
    if wants_grad(x, topk_weights, w13, w2, w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b):
        from .grad import layer_with_grad                # the autograd Function around this very call
        return layer_with_grad(moe_lora_layer, x, topk_ids, topk_weights, token_lora, w13, w2, w13_lora_a, w13_lora_b,
                               w2_lora_a, w2_lora_b, schedule=schedule, plan=plan, lora_ranks=lora_ranks, join=join,
                               lora_path=lora_path, tracer=tracer, side_priority=side_priority, validate=False,
                               in_k=in_k)
    if M == 0:
        return x.new_empty(0, H)
    active = with_lora and r > 0                      # rank 0: the LoRA adds nothing
    if active:
        run = resolve_schedule(schedule, x.device, num_pairs=M * k, num_experts=E, num_loras=L, rank=r,
                               in_k_columns=L * r if in_k is not None else None, join=join, lora_path=lora_path,
                               quantized=quantized)
        why = get_schedule(run).ignored(join, lora_path)
        if why:
            raise ValueError(why)
    else:
        run = AUTO_CPU                                # the plain layer: the two-kernel runner without LoRA
    row = get_schedule(run)
    if plan is not None and active:
        _check_plan_fits(plan, row, schedule, lora_path)
    with on_device(x):
        if plan is None:
            plan = plan_layer(topk_ids, token_lora, E, L, r, intermediate=I, lora_path=lora_path,
                              schedule=run, validate=False, lora_ranks=lora_ranks)
        if lora_ranks is not None:
            lora_ranks = lora_ranks.to(device=x.device, dtype=torch.int32).contiguous()
        call = LayerCall(x, topk_ids, topk_weights, topk_weights.reshape(-1).float().contiguous(), token_lora,
                         token_lora.to(torch.int32).contiguous(), w13, w2,
                         (w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b) if active else None, lora_ranks, in_k, plan,
                         Dims(M, k, E, H, I, L, r), join=join, dual=row.streams > 1 and _streams_run(x.device),
                         side_priority=side_priority, tracer=tracer)
        return row.run(call)


def _check_plan_fits(plan: LayerPlan, row, schedule: str, lora_path: str) -> None:
    """A plan serves a schedule when it holds what the schedule reads: LoRA blocks or none, the GEMM's tiles,
    the schedule's fixed path, the call's ``lora_path``."""
    made_for = get_schedule(plan.schedule)
    same = (made_for.lora_blocks, made_for.gemm_lora_tiles) == (row.lora_blocks, row.gemm_lora_tiles)
    if not same or (row.plan_path is not None and plan.lora_path != row.plan_path):
        raise TypeError(f"plan: made for another schedule ({plan.schedule!r}) than this call's ({row.name!r}); pass "
                        f"plan_layer(..., schedule={schedule!r}) with the layer's num_loras and rank")
    if lora_path != "auto" and row.lora_blocks and plan.lora_path != lora_path:
        raise ValueError(f"lora_path: {lora_path!r}, but the plan was made for {plan.lora_path!r}; make the plan "
                         f"with plan_layer(..., lora_path={lora_path!r})")
