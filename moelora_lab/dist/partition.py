"""Who owns what when one MoE layer is split over W ranks.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, H hidden, I expert intermediate,
W ranks in the process group, E_w experts on rank w, I_w / r_w / H_w a rank's share of I / r / H.

Expert parallelism (EP) gives each rank whole experts: base weights and LoRA weights of experts
[first_w, first_w + E_w), a contiguous range (:class:`ExpertPartition`). Tensor parallelism (TP)
gives each rank a slice of every expert (:func:`shard_tp`): w13's output columns (I_w gate rows and
I_w up rows) and w2's input columns, so the activation h never leaves the rank and only the
output needs a sum over ranks. The LoRA follows the base weights in one of two ways:

* ``fully_sharded=False``: w13's A is replicated and its B cut like the base rows; w2's A is cut
  along I like the base, its B replicated. No LoRA communication: by linearity each rank's partial
  w2 delta (x_w A_w^T) B^T rides in the base all-reduce.
* ``fully_sharded=True`` (S-LoRA style, every LoRA weight cut W ways): w13's A is cut along r, so
  the rank intermediate must be all-gathered along r before the expand; w2's A is cut along I and
  its B along H, so the partial intermediate must be all-reduced before the expand.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..validate import check_int

LORA_KEYS = ("w13_lora_a", "w13_lora_b", "w2_lora_a", "w2_lora_b")


def _bounds(n: int, parts: int) -> list[int]:
    """Boundaries of ``parts`` contiguous ranges over n items, sizes differing by at most one."""
    return [i * n // parts for i in range(parts + 1)]


@dataclass(frozen=True)
class ExpertPartition:
    """Experts [0, E) split into W contiguous ranges, as even as possible (E need not divide by W)."""

    num_experts: int
    world_size: int

    def __post_init__(self):
        check_int("num_experts", self.num_experts, low=1)
        check_int("world_size", self.world_size, low=1)
        if self.world_size > self.num_experts:
            raise ValueError(f"world_size: {self.world_size} ranks for {self.num_experts} experts would leave a rank "
                             "without experts; use at most as many ranks as experts")

    @property
    def bounds(self) -> list[int]:
        """[W + 1] first expert of each rank, then E."""
        return _bounds(self.num_experts, self.world_size)

    def experts_of(self, rank: int) -> range:
        b = self.bounds
        return range(b[rank], b[rank + 1])

    def owner(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """The rank that owns each expert id (same shape as ``topk_ids``, int64)."""
        return _tables(self, topk_ids.device)[0][topk_ids.long()]

    def first(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """The first expert of each id's owner (global id minus this is the owner's local id)."""
        return _tables(self, topk_ids.device)[1][topk_ids.long()]

    def shard(self, weights: dict, rank: int) -> dict:
        """A rank's experts of a layer's weights: ``w13``, ``w2`` [E, ...] and the LoRA lists [L, E, ...]
        (any missing key is skipped), as views."""
        ex = self.experts_of(rank)
        out = {}
        for key, w in weights.items():
            if key in ("w13", "w2"):
                out[key] = w[ex.start:ex.stop]
            elif key in LORA_KEYS and w is not None:
                out[key] = [t[:, ex.start:ex.stop] for t in w]
        return out


@functools.lru_cache(maxsize=64)
def _tables(partition: ExpertPartition, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[E] owner rank and [E] owner's first expert, made once per device: a host-to-device copy
    waits for the stream, so it must not happen on every call."""
    b = partition.bounds
    owner = [w for w in range(partition.world_size) for _ in range(b[w], b[w + 1])]
    return (torch.tensor(owner, dtype=torch.int64).to(device),
            torch.tensor([b[w] for w in owner], dtype=torch.int64).to(device))


def _cut(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    n = t.shape[dim]
    if n % world:
        raise ValueError(f"tensor parallelism over {world} ranks needs dim {dim} of a [{', '.join(map(str, t.shape))}] "
                         f"weight to divide by {world}; pick a world size that divides I, H and r")
    step = n // world
    return t.narrow(dim, rank * step, step)


def shard_tp(weights: dict, rank: int, world: int, *, fully_sharded: bool) -> dict:
    """A rank's slice of a layer's weights under tensor parallelism (see the module docstring).

    ``weights``: ``w13`` [E, 2I, H], ``w2`` [E, H, I] and, optionally, the four LoRA lists (w13: 2 x A
    [L, E, r, H], 2 x B [L, E, I, r]; w2: A [L, E, r, I], B [L, E, H, r]). Returns the same keys with
    contiguous slices: w13 [E, 2 I_w, H] (the rank's gate rows then its up rows), w2 [E, H, I_w];
    LoRA cut as ``fully_sharded`` says (B keeps its memory order).
    """
    check_int("world", world, low=1)
    check_int("rank", rank, low=0)
    if rank >= world:
        raise ValueError(f"rank: {rank} is not below world={world}")
    w13, w2 = weights["w13"], weights["w2"]
    I = w2.shape[2]
    gate, up = w13[:, :I], w13[:, I:]
    out = dict(w13=torch.cat([_cut(gate, 1, rank, world), _cut(up, 1, rank, world)], 1).contiguous(),
               w2=_cut(w2, 2, rank, world).contiguous())
    if weights.get("w13_lora_a") is None:
        return out
    keep = _like
    a13, b13 = weights["w13_lora_a"], weights["w13_lora_b"]
    a2, b2 = weights["w2_lora_a"], weights["w2_lora_b"]
    out["w13_lora_a"] = [keep(_cut(a, 2, rank, world)) if fully_sharded else a for a in a13]
    out["w13_lora_b"] = [keep(_cut(b, 2, rank, world)) for b in b13]
    out["w2_lora_a"] = [keep(_cut(a, 3, rank, world)) for a in a2]
    out["w2_lora_b"] = [keep(_cut(b, 2, rank, world)) if fully_sharded else b for b in b2]
    return out


def _like(view: torch.Tensor) -> torch.Tensor:
    """A compact copy of a slice that keeps the source's dimension order in memory (a packed B stays
    N-fastest, a plain one r-fastest)."""
    order = sorted(range(view.dim()), key=lambda d: view.stride(d), reverse=True)
    return view.permute(order).contiguous().permute([order.index(d) for d in range(view.dim())])


def local_ranks(lora_ranks: torch.Tensor | None, rank: int, world: int, rank_dim: int) -> torch.Tensor | None:
    """Each slot's real rank inside rank ``rank``'s share of the r axis (fully sharded w13 A: rows
    [rank * r_w, (rank + 1) * r_w)); None stays None."""
    if lora_ranks is None:
        return None
    step = rank_dim // world
    return (lora_ranks.long() - rank * step).clamp(0, step).to(lora_ranks.dtype)
