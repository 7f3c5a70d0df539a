"""Expert parallelism: each rank owns whole experts; pairs travel to their expert and back.

Shape legend: M tokens (this rank's), E experts, k top-k, L adapters, r rank, H hidden,
I expert intermediate, W ranks, P = M*k pairs, R pairs this rank receives, E_w local experts.

Every rank holds its own tokens and the weights of its experts (:class:`ExpertPartition`). A call
runs three steps, as serving engines' modular MoE layers do:

1. **prepare / dispatch**: count the pairs for each rank and exchange the counts (an all-to-all of
   W integers per micro-batch, :func:`count_pairs`: the only host synchronisation, because the
   payload's split sizes must be known on the host), sort the P pairs by the rank owning their
   expert, then one all-to-all of the pairs' rows [P, H] and one of their metadata [P, 3] (local
   expert id, adapter slot, routing weight's bits).
2. **experts**: the R received pairs are R one-slot tokens for the local layer
   (:func:`moelora_lab.moe_lora_layer` with k = 1 and the pair's routing weight): our kernels,
   plan and schedules, the weight applied in the w2 GEMM's epilogue as on one GPU; LoRA included,
   because a pair carries its adapter id.
3. **finalize / combine**: the all-to-all in reverse brings each pair's weighted output [R, H]
   home, where ``kernels/combine.py`` sums each token's k rows, read where they arrived.

Each remote pair moves H values twice (there and back). Rows are not deduplicated: a token whose
k experts sit on one rank is sent k times (``comm.ep_bytes`` counts both choices).
``micro_batches > 1`` splits the tokens and overlaps the dispatch of the next micro-batch with the
experts of this one (asynchronous collectives; NCCL runs them on its own stream).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import triton

from .._backend import on_device
from ..kernels.combine import gather_sum_kernel
from ..layer import moe_lora_layer
from ..streams import traced
from ..validate import check_int
from .partition import LORA_KEYS, ExpertPartition


class Dispatch(NamedTuple):
    """What one rank sent and received for one micro-batch."""

    order: torch.Tensor      # [P] pair ids sorted by destination rank
    send: list               # [W] pairs sent to each rank
    recv: list               # [W] pairs received from each rank
    rows: torch.Tensor       # [R, H] received rows
    meta: torch.Tensor       # [R, 3] int64 (local expert id, adapter slot, fp32 routing weight's bits)
    sent: tuple              # the outgoing rows and metadata, kept alive while an async exchange runs


class Counts(NamedTuple):
    """Split sizes of every micro-batch: the only host synchronisation of the layer."""

    send: list               # [micro-batches][W] pairs this rank sends to each rank
    recv: list               # [micro-batches][W] pairs it receives from each rank


def count_pairs(topk_ids, partition: ExpertPartition, *, group=None, micro_batches: int = 1) -> Counts:
    """Pairs this rank sends to and receives from each rank, per micro-batch: one all-to-all of
    [W, micro-batches] integers, then a copy to the host (the payload's split sizes must be host ints).
    A caller that knows the routing early (a serving engine, a benchmark) passes the result to
    :func:`ep_layer` as ``counts`` and keeps this synchronisation out of the layer."""
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    dest = [partition.owner(c.reshape(-1)) for c in topk_ids.tensor_split(micro_batches)]
    send = torch.stack([torch.bincount(d, minlength=world) for d in dest], 1)      # [W, mb]: row w to rank w
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)                                 # row w: from rank w
    return Counts(send.T.tolist(), recv.T.tolist())


def dispatch(x, topk_ids, topk_weights, token_lora, partition: ExpertPartition, group, send: list, recv: list, *,
             async_op: bool = False):
    """Step 1 for one micro-batch (``send``/``recv``: its split sizes); returns (Dispatch, works),
    ``works`` to wait on when ``async_op``."""
    M, k = topk_ids.shape
    ids = topk_ids.reshape(-1).long()
    order = torch.sort(partition.owner(ids), stable=True).indices
    rows_out = x.index_select(0, order // k)
    bits = topk_weights.reshape(-1).float()[order].view(torch.int32).long()     # the weight rides as its bits
    meta_out = torch.stack([ids[order] - partition.first(ids[order]),
                            token_lora.long().repeat_interleave(k)[order], bits], 1)
    R = sum(recv)
    rows = x.new_empty(R, x.shape[1])
    meta = meta_out.new_empty(R, 3)
    works = [dist.all_to_all_single(rows, rows_out, recv, send, group=group, async_op=async_op),
             dist.all_to_all_single(meta, meta_out, recv, send, group=group, async_op=async_op)]
    return Dispatch(order, send, recv, rows, meta, (rows_out, meta_out)), [w for w in works if w is not None]


def experts(d: Dispatch, local: dict, *, lora_ranks=None, schedule: str = "auto", lora_path: str = "auto",
            validate: bool = True):
    """Step 2: the local layer on the received pairs, one slot each, with their weights: out [R, H]."""
    ids = d.meta[:, :1].contiguous()
    weights = d.meta[:, 2:].to(torch.int32).view(torch.float32)
    lora = {key: local.get(key) for key in LORA_KEYS}
    return moe_lora_layer(d.rows, ids, weights, d.meta[:, 1].contiguous(), local["w13"], local["w2"], **lora,
                          schedule=schedule, lora_path=lora_path, lora_ranks=lora_ranks, validate=validate)


def combine(out: torch.Tensor, d: Dispatch, group, *, async_op: bool = False):
    """Step 3a: send every pair's output home: back [P, H] in dispatch order (and the work, if async)."""
    back = out.new_empty(len(d.order), out.shape[1])
    work = dist.all_to_all_single(back, out, d.send, d.recv, group=group, async_op=async_op)
    return back, work


def finalize(back: torch.Tensor, d: Dispatch, top_k: int) -> torch.Tensor:
    """Step 3b: sum each token's k weighted rows, read where they arrived: y [M, H] in the rows' dtype."""
    P, H = back.shape
    y = back.new_empty(P // top_k, H)
    if P == 0:
        return y
    pos = torch.empty_like(d.order)
    pos[d.order] = torch.arange(P, device=back.device)          # the row of each pair in ``back``
    block = min(1024, triton.next_power_of_2(H))
    with on_device(back):
        gather_sum_kernel[(P // top_k, triton.cdiv(H, block))](back, pos, y, top_k, H, back.stride(0), y.stride(0),
                                                               BLOCK=block)
    return y


def ep_layer(x, topk_ids, topk_weights, token_lora, local: dict, partition: ExpertPartition, *, group=None,
             lora_ranks=None, schedule: str = "auto", lora_path: str = "auto", micro_batches: int = 1,
             counts: Counts | None = None, validate: bool = True, tracer=None) -> torch.Tensor:
    """The MoE layer with LoRA, its experts spread over the ranks of ``group``: y [M, H] for this
    rank's tokens.

    ``x`` [M, H], ``topk_ids`` [M, k] (global expert ids), ``topk_weights`` [M, k], ``token_lora`` [M]:
    this rank's tokens, as for :func:`moelora_lab.moe_lora_layer`. ``local``: this rank's experts,
    ``partition.shard(full_weights, rank)`` (``w13``, ``w2`` and optionally the four LoRA lists).
    Collective: every rank of ``group`` must call it (with any M, 0 included) with the same
    ``micro_batches``. ``counts``: :func:`count_pairs` of these very ids, made beforehand (else the
    layer makes them: one host synchronisation). ``validate=False`` skips the id checks (host
    synchronisations). ``tracer`` (``profile.timeline.Tracer``) records the stages.
    """
    group = group if group is not None else dist.group.WORLD
    check_int("micro_batches", micro_batches, low=1)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if partition.world_size != world:
        raise ValueError(f"partition: made for {partition.world_size} ranks, but the group has {world}; use "
                         f"ExpertPartition({partition.num_experts}, {world})")
    E_w = len(partition.experts_of(rank))
    if local["w13"].shape[0] != E_w:
        raise ValueError(f"local: w13 holds {local['w13'].shape[0]} experts, but rank {rank} owns {E_w} "
                         f"({partition.experts_of(rank)}); pass partition.shard(weights, {rank})")
    if validate and topk_ids.numel():
        lo, hi = torch.stack(torch.aminmax(topk_ids)).tolist()          # one synchronisation
        if lo < 0 or hi >= partition.num_experts:
            raise ValueError(f"topk_ids: global expert ids must lie in [0, {partition.num_experts}), got ids "
                             f"from {lo} to {hi}")
    if counts is None:
        with traced(tracer, "counts"):
            counts = count_pairs(topk_ids, partition, group=group, micro_batches=micro_batches)
    elif len(counts.send) != micro_batches or any(len(c) != world for c in counts.send):
        raise ValueError(f"counts: made for {len(counts.send)} micro-batch(es) of {len(counts.send[0])} ranks; this "
                         f"call has micro_batches={micro_batches} over {world} ranks (pass count_pairs(..., "
                         f"micro_batches={micro_batches}))")
    run = dict(lora_ranks=lora_ranks, schedule=schedule, lora_path=lora_path, validate=validate)
    if micro_batches == 1:
        return _one_batch(x, topk_ids, topk_weights, token_lora, local, partition, group, counts, run, tracer)
    return _pipelined(x, topk_ids, topk_weights, token_lora, local, partition, group, counts, run, tracer)


def _one_batch(x, topk_ids, topk_weights, token_lora, local, partition, group, counts, run, tracer):
    with traced(tracer, "dispatch"):
        d, _ = dispatch(x, topk_ids, topk_weights, token_lora, partition, group, counts.send[0], counts.recv[0])
    with traced(tracer, "experts"):
        out = experts(d, local, **run)
    with traced(tracer, "combine"):
        back, _ = combine(out, d, group)
        return finalize(back, d, topk_ids.shape[1])


def _pipelined(x, topk_ids, topk_weights, token_lora, local, partition, group, counts, run, tracer):
    """Micro-batches: the dispatch of batch i+1 and the combine of batch i-1 are in flight while the
    experts of batch i run (every rank splits its own tokens the same way: the collectives pair up;
    the split sizes are known up front, so nothing waits on the host)."""
    chunks = list(zip(*(t.tensor_split(len(counts.send)) for t in (x, topk_ids, topk_weights, token_lora))))

    def send(i):
        cx, cids, cweights, clora = chunks[i]
        return dispatch(cx, cids, cweights, clora, partition, group, counts.send[i], counts.recv[i], async_op=True)

    pending = send(0)
    combines = []
    for i in range(len(chunks)):
        d, works = pending
        for w in works:
            w.wait()                          # the current stream waits for this batch's rows
        if i + 1 < len(chunks):
            pending = send(i + 1)
        with traced(tracer, f"experts[{i}]"):
            out = experts(d, local, **run)
        back, work = combine(out, d, group, async_op=True)
        combines.append((back, d, work, out))
    results = []
    for back, d, work, _ in combines:
        work.wait()
        results.append(finalize(back, d, topk_ids.shape[1]))
    return torch.cat(results, 0)
