"""The expert-parallel layer's checks (``ep.ep_layer``): one rank's inputs, the counts it is handed, and what
every rank must pass alike.

Shape legend: M tokens (this rank's), E experts, k top-k, L adapters, r rank, H hidden, I expert intermediate,
W ranks, E_w local experts.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from ..layer.fp8 import refuse_distributed
from ..layer.table import AUTO, choices, get_schedule
from ..op.paths import KERNEL_CHOICES, get_path
from ..validate import (ANY_SLOT, FLOAT_DTYPES, LayerDims, check_bool, check_choice, check_int, check_layer_inputs,
                        check_lora_ranks, check_tensor, check_values, routing_ranges)
from .agree import Same, check_kernels_run, dtype_code, dtype_name
from .partition import LORA_KEYS, ExpertPartition

# the schedules a rank's experts can run: no in_k pack travels with the local weights
EP_SCHEDULES = tuple(s for s in choices() if s == AUTO or not get_schedule(s).needs_pack)



class Counts(NamedTuple):
    """Split sizes of every micro-batch: the only host synchronisation of the layer."""

    send: list               # [micro-batches][W] pairs this rank sends to each rank
    recv: list               # [micro-batches][W] pairs it receives from each rank


def check_inputs(x, topk_ids, topk_weights, token_lora, local, partition, *, world: int, rank: int, lora_ranks,
                 schedule: str, lora_path: str, micro_batches: int, counts, validate: bool) -> LayerDims:
    """One rank's inputs of :func:`ep_layer`, all of them (the ids' ranges with ``validate``); returns
    the dims of its local layer (E = this rank's experts). Raises where ``moe_lora_layer`` on the
    received pairs, or the exchange, would fail later on this rank alone."""
    refuse_distributed("ep_layer", local)
    check_bool("validate", validate)
    check_int("micro_batches", micro_batches, low=1)
    check_choice("schedule", schedule, EP_SCHEDULES)
    get_path(lora_path, "lora_path", KERNEL_CHOICES)
    if not isinstance(partition, ExpertPartition):
        raise TypeError("partition: expected an ExpertPartition(num_experts, world_size), got "
                        f"{type(partition).__name__}")
    if partition.world_size != world:
        raise ValueError(f"partition: made for {partition.world_size} ranks, but the group has {world}; use "
                         f"ExpertPartition({partition.num_experts}, {world})")
    if not isinstance(local, Mapping) or "w13" not in local or "w2" not in local:
        raise TypeError(f"local: expected this rank's experts, partition.shard(weights, {rank}): a dict with 'w13', "
                        f"'w2' and optionally {', '.join(map(repr, LORA_KEYS))}; got {type(local).__name__}")
    w13 = check_tensor("local['w13']", local["w13"], ndim=3, dtypes=FLOAT_DTYPES, legend="[E_w, 2I, H]")
    E_w = len(partition.experts_of(rank))
    if w13.shape[0] != E_w:
        raise ValueError(f"local: w13 holds {w13.shape[0]} experts, but rank {rank} owns {E_w} "
                         f"({partition.experts_of(rank)}); pass partition.shard(weights, {rank})")
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, legend="[M, H]")
    if x.dtype != w13.dtype:
        raise TypeError(f"x: dtype {x.dtype} differs from the local weights' {w13.dtype}; cast x to {w13.dtype} "
                        "(or the weights, once, when they are loaded)")
    dims = check_layer_inputs(x, topk_ids, topk_weights, token_lora, w13, local["w2"],
                              *(local.get(key) for key in LORA_KEYS))
    check_kernels_run(x)
    with_lora = dims.L is not None and dims.r > 0
    row = None if schedule == AUTO else get_schedule(schedule)
    if with_lora and row is not None:
        why = row.too_wide(dims.L, dims.r) or row.ignored("fold", lora_path)
        if why:
            raise ValueError(why)
    if counts is not None:
        check_counts(counts, topk_ids, micro_batches, world)
    ranges = routing_ranges(topk_ids, token_lora, partition.num_experts, dims.L or ANY_SLOT)
    if dims.L is not None:
        ranges += check_lora_ranks(lora_ranks, dims.L, dims.r)
    if validate:
        check_values(ranges)
    return dims


def check_counts(counts, topk_ids, micro_batches: int, world: int) -> None:
    """counts from :func:`count_pairs` for this call: its micro-batches, ranks and pairs sent."""
    if not isinstance(counts, Counts):
        raise TypeError(f"counts: expected count_pairs(topk_ids, partition, micro_batches={micro_batches}) of this "
                        f"call's ids, got {type(counts).__name__}")
    sizes = [len(c) for c in counts.send + counts.recv]
    if len(counts.send) != micro_batches or len(counts.recv) != micro_batches or any(n != world for n in sizes):
        ranks = sizes[0] if sizes else 0
        raise ValueError(f"counts: made for {len(counts.send)} micro-batch(es) of {ranks} ranks; this "
                         f"call has micro_batches={micro_batches} over {world} ranks (pass count_pairs(..., "
                         f"micro_batches={micro_batches}))")
    for i, (sent, ids) in enumerate(zip(counts.send, topk_ids.tensor_split(micro_batches))):
        if sum(sent) != ids.numel():
            raise ValueError(f"counts: micro-batch {i} sends {sum(sent)} pairs, but this call's topk_ids has "
                             f"{ids.numel()} there; pass count_pairs(...) of these very ids")


def must_match(dims: LayerDims | None, x, partition, micro_batches, counts) -> list:
    """What every rank must pass alike (the same fields on every rank; values of a failed check unused)."""
    ok = dims is not None
    L = dims.L if ok and dims.L is not None else -1
    return [Same("x", "the hidden size H (x's columns)", dims.H if ok else 0),
            Same("x", "the dtype", dtype_code(x.dtype) if ok else 0, dtype_name),
            Same("partition", "the number of experts", partition.num_experts if ok else 0),
            Same("local", "the number of adapter slots L (-1: no LoRA)", L),
            Same("local", "the LoRA rank r (-1: no LoRA)", dims.r if L >= 0 else -1),
            Same("micro_batches", "the number of micro-batches", micro_batches if ok else 0),
            Same("counts", "whether counts is passed (1) or made by the layer (0)", int(counts is not None))]
