"""Which schedule a call runs (``resolve_schedule``, the GPU rule ``gpu_schedule``) and the plan every
schedule reads (``plan_layer``: routing metadata, tiles, LoRA path). The schedules are rows of ``table.py``.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, H hidden, I expert intermediate,
P = M*k pairs.
"""
from __future__ import annotations

import warnings

import torch

from .. import rules
from .._backend import INTERPRET, on_device
from ..routing.device import make_block_lists
from ..blocks import LayerPlan, RoutingStamp
from ..op.dispatch import choice_rank, choose_config
from ..base_moe import fused_columns, gemm_tiles
from ..op.paths import KERNEL_CHOICES, get_path, resolve_path
from ..validate import ANY_SLOT, check_bool, check_choice, check_int, check_lora_ranks, check_routing
from .table import AUTO, AUTO_CPU, AUTO_GPU, AUTO_LARGE, choices, get_schedule


def ignored_argument(schedule: str, join: str, lora_path: str) -> str | None:
    """Why ``schedule`` cannot honour ``join`` and ``lora_path`` (a message naming the argument), or None."""
    return get_schedule(schedule).ignored(join, lora_path)


def fused_fits(num_loras: int, rank: int) -> bool:
    """Whether the in-GEMM LoRA can run: the stacked shrink of all adapters fits in registers."""
    return fused_columns(num_loras, rank) <= rules.MAX_FUSED_COLUMNS


def _check_width(schedule: str, num_loras: int | None, rank: int | None) -> None:
    """A ValueError when ``schedule`` has a limit on L*r that these adapters exceed."""
    if num_loras is not None and rank:
        why = get_schedule(schedule).too_wide(num_loras, rank)
        if why:
            raise ValueError(why)


def _streams_run(device: torch.device) -> bool:
    """Whether CUDA streams run here (a GPU, not the interpreter): where two streams are real."""
    return device.type == "cuda" and not INTERPRET


def resolve_schedule(schedule: str, device: torch.device, *, num_pairs: int = 0, num_experts: int = 1,
                     num_loras: int | None = None, rank: int | None = None, in_k_columns: int | None = None,
                     join: str = "fold", lora_path: str = "auto", quantized: bool = False) -> str:
    """The schedule a call really runs: a row's name (``num_loras``, ``rank``: the layer's L and r, checked
    against the row's limit; ``in_k_columns``: L*r when the call brings an ``in_k`` pack, else None; ``join``
    and ``lora_path``: the call's, which ``auto`` honours; ``quantized``: the base is FP8, which ``auto``
    honours and a named row that cannot run it refuses)."""
    check_choice("schedule", schedule, choices())
    if schedule != AUTO:
        row = get_schedule(schedule)
        why = row.refuses_fp8() if quantized else None
        if why:
            raise ValueError(why)
        _check_width(schedule, num_loras, rank)
        if row.needs_pack and in_k_columns is None:
            raise ValueError(f"schedule={schedule!r} needs the layer packed for it: pass in_k=pack_in_k(w13, w2, "
                             "w13_lora_b, w2_lora_b) and its views w13=in_k.w13, w2=in_k.w2")
    gpu = _streams_run(device)
    if schedule == AUTO:
        return (gpu_schedule(num_pairs, num_experts, in_k_columns=in_k_columns, join=join, lora_path=lora_path,
                             quantized=quantized) if gpu else AUTO_CPU)
    if row.cpu_runs and not gpu:
        warnings.warn(f"schedule={schedule!r} needs CUDA streams; on the CPU the layer runs {row.cpu_runs!r} "
                      "(same kernels, same results)", RuntimeWarning, stacklevel=3)
        return row.cpu_runs
    return schedule


# From the H200 (bf16, qwen3-30b-a3b, 4 adapters; data/h200/layer_in_k.csv): both LoRA ops in K beat two
# streams at r 16 (L*r = 64) from 128 pairs per expert (M = 2048: 1.175 against 1.238 of the layer without
# LoRA; M = 8192: 1.129 against 1.295), were level at 32 (M = 512) and lost below. At r 64 (L*r = 256) the
# wider K lost everywhere with the one-shot kernel before its expand was pipelined; with it (code 4affdc9bf8),
# both LoRA ops in K beat two streams at r 64 too from 128 pairs per expert, in both runs that timed them
# (layer_in_k.csv: 1.376 against 1.392 at M = 2048, 1.288 against 1.380 at M = 8192; layer.csv: 1.327
# against 1.363, 1.305 against 1.360), and lost at M = 512 in both (1.38 against 1.32). Wider K than
# L*r = 256 was not measured.
IN_K_MAX_COLUMNS = 256          # L*r
IN_K_MIN_PAIRS_PER_EXPERT = 128


def gpu_schedule(num_pairs: int, num_experts: int, *, in_k_columns: int | None = None, join: str = "fold",
                 lora_path: str = "auto", quantized: bool = False) -> str:
    """What ``schedule="auto"`` runs on a GPU (without LoRA inside the GEMMs), for a layer of
    ``num_pairs`` pairs over ``num_experts`` experts, ``in_k_columns`` = L*r when the call brings an
    ``in_k`` pack (usable on the CPU, to read the data). ``in_k`` where the rule above says it pays, it
    honours the call's ``join`` and ``lora_path`` (it runs neither: ``ignored_argument``) and the base is not
    ``quantized`` (FP8: ``in_k`` cannot run it, ``Schedule.refuses_fp8``);
    else two streams at every size: on the H200, with every schedule of a case timed in interleaved
    rounds, they beat one stream most at M = 1 (the LoRA's short launches hide under the base GEMMs)
    and least at the largest M (both streams' kernels are long and share the memory bus), where the
    two are level within what one schedule timed twice differs."""
    if num_pairs < 0 or num_experts < 1:
        raise ValueError(f"num_pairs / num_experts: need num_pairs >= 0 and num_experts >= 1, got {num_pairs}, "
                         f"{num_experts}")
    if (in_k_columns is not None and in_k_columns <= IN_K_MAX_COLUMNS
            and num_pairs >= IN_K_MIN_PAIRS_PER_EXPERT * num_experts
            and ignored_argument(AUTO_LARGE, join, lora_path) is None
            and not (quantized and get_schedule(AUTO_LARGE).refuses_fp8())):
        return AUTO_LARGE
    return AUTO_GPU


def plan_layer(topk_ids, token_lora, num_experts: int, num_loras: int | None, rank: int | None, *,
               intermediate: int | None = None, lora_path: str = "auto",
               schedule: str = "auto", validate: bool = True, lora_ranks: torch.Tensor | None = None) -> LayerPlan:
    """Build the routing metadata, the GEMM tiles and the LoRA path of :func:`moe_lora_layer` once.

    Reuse a plan across calls with the same routing tensors (w13 and w2, benchmarks, CUDA graphs that
    capture only the layer's kernels): the layer checks, without a device synchronisation, that it gets
    the tensors the plan was made from, unchanged, and that the plan holds what its schedule reads.

    Parameters
    ----------
    topk_ids : torch.Tensor
        [M, k] int32/int64 expert of each (token, slot) pair, in [0, E).
    token_lora : torch.Tensor
        [M] int32/int64 adapter slot of each token in [0, L), -1 = no adapter.
    num_experts : int
        E.
    num_loras, rank : int or None
        L and the LoRA rank r of the weights the plan will serve; ``None, None`` plans a layer without LoRA.
    intermediate : int, optional
        I: lets the path rule see the width of w13's LoRA output.
    lora_path : str
        'auto' or a Triton path of ``moelora_lab.PATHS`` for the separate LoRA kernels.
    schedule : str
        The schedule the plan is made for (``"auto"``: what it runs on this device without an ``in_k``
        pack): a schedule whose LoRA is inside the GEMMs gets no LoRA blocks, one with a fixed LoRA path
        gets that path, two streams pick the path by the side stream's rule (``dispatch.choose_side_path``),
        any other by the op's.
    validate : bool
        False skips the id-range checks (one synchronisation) for routing already checked; the layer
        then checks the ids itself unless it is told ``validate=False`` too.
    lora_ranks : torch.Tensor, optional
        [L] per-slot ranks, on the CPU: lets ``lora_path="auto"`` pick by the largest real rank instead of r.

    Returns
    -------
    LayerPlan
        The base blocks, the LoRA blocks (None where the schedule needs none), the LoRA path, the tiles
        and the schedule, stamped with the routing they were made for.

    Examples
    --------
    >>> import moelora_lab as ml
    >>> p = ml.make_problem("tiny", ml.LoRAShape(num_loras=2, rank=4), num_tokens=8, seed=0)
    >>> E = p.shape.num_experts
    >>> plan = ml.plan_layer(p.topk_ids, p.token_lora, E, 2, 4)
    >>> plan.schedule, plan.lora_path in ml.PATHS               # "sequential": what auto runs on the CPU
    ('sequential', True)
    >>> y = ml.moe_lora_layer(**p.layer_inputs(), plan=plan)     # no routing work inside the call
    >>> plain = ml.plan_layer(p.topk_ids, p.token_lora, E, None, None)     # a plan without LoRA
    >>> plain.lora_blocks is None
    True
    >>> ml.moe_lora_layer(**p.layer_inputs(), plan=plain)       # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: plan: made for a layer without LoRA, but this call is with 2 adapters of rank 4; ...
    """
    E = check_int("num_experts", num_experts, low=1)
    check_bool("validate", validate)
    if num_loras is not None:
        check_int("num_loras", num_loras, low=1)
        if rank is None:
            raise TypeError("rank: expected an int (the LoRA rank r of the weights) when num_loras is given; pass "
                            "num_loras=None to plan a layer without LoRA")
        check_int("rank", rank, low=0)
        check_lora_ranks(lora_ranks, num_loras, rank)
    check_choice("schedule", schedule, choices())
    get_path(lora_path, "lora_path", KERNEL_CHOICES)
    L = num_loras or ANY_SLOT
    M, k = check_routing(topk_ids, token_lora, E, L, values=validate)
    P = M * k
    with_lora = num_loras is not None and rank != 0
    made_for = (AUTO_GPU if _streams_run(topk_ids.device) else AUTO_CPU) if schedule == AUTO else schedule
    row = get_schedule(made_for)
    if with_lora:
        _check_width(made_for, num_loras, rank)
    tiles = gemm_tiles(P, E, lora=with_lora and row.gemm_lora_tiles)
    with on_device(topk_ids):
        stamp = RoutingStamp.of(topk_ids, None if num_loras is None else token_lora, E, L, tiles["BLOCK_M"],
                                values_checked=validate)
        plan = dict(num_loras=num_loras, rank=rank, routing=stamp, tiles=tiles, schedule=made_for)
        base_list = (None, tiles["BLOCK_M"])
        if not with_lora or not row.lora_blocks:
            # no LoRA, rank 0 (the LoRA adds nothing) or a schedule whose GEMMs carry it: the base blocks alone
            [base] = make_block_lists(topk_ids, None, E, [base_list], values_checked=validate)
            return LayerPlan(base, None, None, lora_config=None, **plan)
        path = row.plan_path or resolve_path(
            lora_path, num_pairs=P, num_experts=E, num_loras=num_loras, rank=rank, add_inputs=False,
            token_rows=True, choice_rank=choice_rank(rank, lora_ranks), n_out=intermediate,
            side_stream=row.streams > 1)
        cfg = choose_config(path, P, min(P, num_loras * E), intermediate or 1, 2, topk_ids.device, rank=rank)
        # both block lists from one construction (the same launches on a GPU)
        base, lora = make_block_lists(topk_ids, token_lora, E, [base_list, (num_loras, cfg.block_m)],
                                      values_checked=validate)
        return LayerPlan(base, lora, path, lora_config=cfg.replace(block_m=lora.block_size), **plan)
