"""Expert parallelism: each rank owns whole experts; pairs travel to their expert and back.

Shape legend: M tokens (this rank's), E experts, k top-k, L adapters, r rank, H hidden,
I expert intermediate, W ranks, P = M*k pairs, R pairs this rank receives, E_w local experts.

Every rank holds its own tokens and the weights of its experts (:class:`ExpertPartition`). A call
first checks every input on every rank and has the ranks agree on the outcome (``agree.agree``:
one all-gather of a few integers, read on the host; the ids' ranges cost one device read with
``validate=True``), so that a bad input raises the same error on every rank rather than on one while
the others wait in an all-to-all. Then it runs three steps, as serving engines' modular MoE layers do:

1. **prepare / dispatch**: count the pairs for each rank and exchange the counts (an all-to-all of
   W integers per micro-batch, :func:`count_pairs`: a host synchronisation, because the payload's
   split sizes must be known on the host), sort the P pairs by the rank owning their
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
from ..layer.grad import no_backward
from ..layer.streams import traced
from ..validate import wants_grad
from .agree import agree, layer_device, run_checks
from .ep_checks import Counts, must_match, check_inputs
from .partition import LORA_KEYS, ExpertPartition


class Dispatch(NamedTuple):
    """What one rank sent and received for one micro-batch."""

    order: torch.Tensor      # [P] pair ids sorted by destination rank
    send: list               # [W] pairs sent to each rank
    recv: list               # [W] pairs received from each rank
    rows: torch.Tensor       # [R, H] received rows
    meta: torch.Tensor       # [R, 3] int64 (local expert id, adapter slot, fp32 routing weight's bits)
    sent: tuple              # the outgoing rows and metadata, kept alive while an async exchange runs


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
    """The MoE layer with LoRA, its experts spread over the ranks of ``group``. Collective: every rank
    of ``group`` must call it (with any M, 0 included) with the same ``micro_batches``.

    Parameters
    ----------
    x, topk_ids, topk_weights, token_lora : torch.Tensor
        This rank's tokens, as for :func:`moelora_lab.moe_lora_layer`: x [M, H], topk_ids [M, k]
        (global expert ids), topk_weights [M, k], token_lora [M].
    local : dict
        This rank's experts, ``partition.shard(full_weights, rank)`` (``w13``, ``w2``, the LoRA lists).
    partition : ExpertPartition
        Which rank owns which experts.
    group : torch.distributed.ProcessGroup, optional
        Default: the world group.
    lora_ranks, schedule, lora_path
        As for :func:`moelora_lab.moe_lora_layer`, for the local layer.
    micro_batches : int
        Split the tokens so that the all-to-alls of one overlap the experts of another.
    counts : Counts, optional
        :func:`count_pairs` of these very ids (else the layer makes them: one host synchronisation).
    validate, tracer
        False skips the id ranges only, for ids you have checked; ``profile.timeline.Tracer``.

    Returns
    -------
    torch.Tensor
        y [M, H] for this rank's tokens.

    Notes
    -----
    Every rank checks all of its inputs before the first exchange of pairs: shapes, dtypes and
    devices, and (``validate=True``) the ids' ranges (global expert ids in [0, E), adapter slots in
    [-1, L), ``lora_ranks`` in [0, r]: one device read). The ranks then agree (one all-gather of a few
    integers, :func:`agree.agree`): if any rank's inputs are wrong, or the ranks disagree on H, the
    dtype, E, the adapters or ``micro_batches``, every rank raises the same ValueError or TypeError,
    naming the argument and the rank that holds it, instead of one rank raising while the others wait
    in the all-to-all.

    Examples
    --------
    >>> import moelora_lab as ml
    >>> from moelora_lab.dist import ExpertPartition
    >>> p = ml.make_problem("tiny", ml.LoRAShape(num_loras=2, rank=4), num_tokens=8, seed=0)
    >>> part = ExpertPartition(p.shape.num_experts, 2)          # E = 8 experts over W = 2 ranks
    >>> [list(part.experts_of(rank)) for rank in range(2)]
    [[0, 1, 2, 3], [4, 5, 6, 7]]
    >>> local = part.shard(p.layer_inputs(), 1)                 # rank 1's w13, w2 and LoRA lists
    >>> tuple(local["w13"].shape), tuple(local["w13_lora_a"][0].shape)
    ((4, 64, 64), (2, 4, 4, 64))

    Every rank calls ``ep_layer(x, topk_ids, topk_weights, token_lora, local, part)`` on its tokens, as
    ``dist.checks.ep_case`` does, here in two gloo processes (seconds: each starts Python and torch):

    >>> from moelora_lab.dist import run_local
    >>> from moelora_lab.dist.checks import default_case, ep_case
    >>> out = run_local(ep_case, 2, default_case())                 # doctest: +SKIP
    >>> [(o["rows"], o["vs_layer"] == 0.0) for o in out]            # doctest: +SKIP
    [(6, True), (4, True)]
    """
    if wants_grad(x, topk_weights, local):          # no backward: inference runs, a backward says so
        with torch.no_grad():
            y = ep_layer(x, topk_ids, topk_weights, token_lora, local, partition, group=group, lora_ranks=lora_ranks,
                         schedule=schedule, lora_path=lora_path, micro_batches=micro_batches, counts=counts,
                         validate=validate, tracer=tracer)
        return no_backward("ep_layer: has no backward (its collectives and base kernels are not recorded for "
                           "autograd); train with moelora_lab.moe_lora_layer, or call ep_layer under torch.no_grad()",
                           y, x, topk_weights, local)
    group = group if group is not None else dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    dims, error = run_checks(check_inputs, x, topk_ids, topk_weights, token_lora, local, partition, world=world,
                             rank=rank, lora_ranks=lora_ranks, schedule=schedule, lora_path=lora_path,
                             micro_batches=micro_batches, counts=counts, validate=validate)
    agree(group, error, must_match(dims, x, partition, micro_batches, counts), layer_device(x))
    if counts is None:
        with traced(tracer, "counts"):
            counts = count_pairs(topk_ids, partition, group=group, micro_batches=micro_batches)
    # the received ids need no second check: every sender checked its own (or was told they are fine)
    run = dict(lora_ranks=lora_ranks, schedule=schedule, lora_path=lora_path, validate=False)
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
