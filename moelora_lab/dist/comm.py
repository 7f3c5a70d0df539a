"""The communication model: what each collective of the distributed layers moves, per rank.

Shape legend: M tokens, E experts, k top-k, r rank, H hidden, W ranks, P = M*k pairs, b bytes per
value.

Like ``profile.traffic`` for HBM, this counts bytes, not time; :func:`predict_us` turns bytes into
time with a latency and a bandwidth measured on the machine (``alpha_us``, ``gbps``).

* Expert parallelism, per rank: the dispatch sends every pair whose expert lives elsewhere, H
  values plus its metadata (3 int64); the combine sends the same rows back. With uniform routing
  a fraction (W-1)/W of the pairs leaves the rank: P (W-1)/W H b each way. Deduplicated dispatch
  (one row per (token, destination rank), as DeepEP does) sends fewer rows when a token has several
  experts on one rank.
* Tensor parallelism: the output all-reduce of y [M, H]; fully sharded LoRA adds an all-gather of
  T13 [2, P, r] (each rank holds r/W of it) and an all-reduce of T2 [P, r]. A ring all-reduce of n
  bytes sends 2 n (W-1)/W per rank, an all-gather of n bytes in all sends n (W-1)/W per rank.
"""
from __future__ import annotations

import torch

from .partition import ExpertPartition

META_BYTES = 24          # a dispatched pair's (local expert id, adapter slot, weight bits), three int64


def pair_matrix(topk_ids_of_rank: list, partition: ExpertPartition, *, dedup: bool = False) -> torch.Tensor:
    """[W, W] rows sent from rank src (row) to rank dst (column); ``topk_ids_of_rank[w]`` is rank w's
    [M_w, k] routing. ``dedup``: one row per (token, destination) instead of one per pair."""
    W = partition.world_size
    out = torch.zeros(W, W, dtype=torch.int64)
    for src, ids in enumerate(topk_ids_of_rank):
        dest = partition.owner(ids.cpu())                                   # [M_w, k]
        if dedup:
            hit = torch.zeros(dest.shape[0], W, dtype=torch.bool)
            hit.scatter_(1, dest, True)
            out[src] = hit.sum(0)
        else:
            out[src] = torch.bincount(dest.reshape(-1), minlength=W)
    return out


def ep_bytes(topk_ids_of_rank: list, partition: ExpertPartition, hidden: int, *, dtype_bytes: int = 2,
             dedup: bool = False) -> dict:
    """Bytes each rank sends over the links (to other ranks) in the dispatch and the combine.

    Returns lists over ranks: ``dispatch`` (rows and metadata), ``combine`` (rows back), and
    ``pairs`` (the [W, W] matrix as nested lists, diagonal = pairs that stay home).
    """
    m = pair_matrix(topk_ids_of_rank, partition, dedup=dedup)
    remote = m - torch.diag(torch.diag(m))
    row = hidden * dtype_bytes
    return dict(dispatch=[int(v) * (row + META_BYTES) for v in remote.sum(1)],
                combine=[int(v) * row for v in remote.sum(0)],
                pairs=m.tolist())


def ep_bytes_uniform(num_tokens: int, top_k: int, hidden: int, world: int, *, dtype_bytes: int = 2) -> float:
    """Expected bytes one rank sends in the dispatch (rows only) when experts are picked uniformly:
    M k (W-1)/W H b. The combine sends as much back."""
    return num_tokens * top_k * (world - 1) / world * hidden * dtype_bytes


def tp_bytes(num_tokens: int, top_k: int, hidden: int, rank: int, world: int, *, fully_sharded: bool,
             dtype_bytes: int = 2) -> dict:
    """Bytes per rank of each collective of ``tp_layer``: ``{name: (payload bytes, bytes sent by one rank)}``."""
    ring = (world - 1) / world
    P = num_tokens * top_k
    y = num_tokens * hidden * dtype_bytes
    out = {"all_reduce_y": (y, 2 * ring * y)}
    if fully_sharded and rank > 0:
        t13 = 2 * P * rank * dtype_bytes
        t2 = P * rank * dtype_bytes
        out["all_gather_T13"] = (t13, ring * t13)
        out["all_reduce_T2"] = (t2, 2 * ring * t2)
    return out


def predict_us(nbytes: float, *, alpha_us: float, gbps: float) -> float:
    """Time of a collective that sends ``nbytes`` per rank: a fixed latency plus bytes at the link rate."""
    return alpha_us + nbytes / (gbps * 1e3)
