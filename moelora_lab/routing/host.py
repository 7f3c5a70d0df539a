"""Routing (softmax, top-k) and per-adapter block alignment of (token, slot) pairs.

Shape legend: M tokens, E experts, k top-k, L adapters, P padded pairs per adapter row,
pair p = t*k + j (token t, slot j).

Block alignment groups the pairs of each adapter by expert so one program can multiply a block
of BLOCK_M pairs by one (adapter, expert) weight. For adapter row l:
    sorted_token_ids[l, :]     pair ids, experts ascending, pairs ascending inside an expert
                               segment, each segment padded to a multiple of block_size with the
                               sentinel M*k (so ``id < M*k`` is the validity mask); P is a
                               multiple of block_size and depends only on (M, k, E, block_size)
    expert_ids[l, b]           expert of block b, -1 past the used blocks
    num_tokens_post_padded[l]  padded length of the row (a multiple of block_size)
Rows of adapters no token uses are all sentinel / -1 / 0. Everything runs as tensor ops on the
inputs' device, without host synchronisation, so it can be captured in a CUDA graph.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..blocks import BlockList, RoutingStamp
from ..validate import check_bool, check_int, check_routing, check_tensor

SPARSITY_FACTOR = 8  # naive assignment when pairs * 8 <= E * L (vLLM's rule)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool = True, *, cast_weights: bool = False):
    """Softmax over experts in fp32, keep the top-k, optionally divide them by their sum.

    Parameters
    ----------
    router_logits : torch.Tensor
        [M, E] router output, float32, float16 or bfloat16.
    top_k : int
        k, the experts each token goes to (1 <= k <= E).
    renormalize : bool
        Divide each token's k weights by their sum (they then add up to 1).
    cast_weights : bool
        False: the weights stay fp32, as vLLM keeps them. True: cast them to the logits' dtype after
        the renormalization, as transformers' Qwen3-MoE router does (with ``renormalize`` = the
        config's ``norm_topk_prob``, False by default there, True in the released Qwen3-MoE models):
        the weights and ids are then exactly HF's. In bf16 the cast rounds each weight to 8 bits of
        mantissa, so the two conventions differ by up to about 0.4% per weight.

    Returns
    -------
    topk_weights : torch.Tensor
        [M, k] routing weights, largest first (fp32, or the logits' dtype with ``cast_weights``).
    topk_ids : torch.Tensor
        [M, k] int32 expert ids, in the order of the weights.

    Examples
    --------
    >>> import torch
    >>> import moelora_lab as ml
    >>> logits = torch.tensor([[2.0, 0.0, 1.0, -1.0], [0.0, 3.0, -1.0, 1.0]])   # M = 2 tokens, E = 4
    >>> weights, ids = ml.route(logits, top_k=2)
    >>> ids.tolist()
    [[0, 2], [1, 3]]
    >>> [round(w, 4) for w in weights[0].tolist()]      # e^2 / (e^2 + e^1), e^1 / (e^2 + e^1)
    [0.7311, 0.2689]
    >>> ml.route(logits, top_k=5)
    Traceback (most recent call last):
    ...
    ValueError: top_k: must be <= 4, got 5
    """
    check_tensor("router_logits", router_logits, ndim=2, legend="[M, E]",
                 dtypes=(torch.float32, torch.float16, torch.bfloat16))
    check_int("top_k", top_k, low=1, high=router_logits.shape[1])
    check_bool("renormalize", renormalize)
    check_bool("cast_weights", cast_weights)
    probs = torch.softmax(router_logits.float(), dim=-1)  # [M, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)       # [M, k], largest first
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if cast_weights:
        weights = weights.to(router_logits.dtype)
    return weights, ids.to(torch.int32)


class Alignment(NamedTuple):
    """Routing metadata shared by the LoRA kernels (and by w13 and w2 of one layer)."""

    sorted_token_ids: torch.Tensor  # [L, P] int32
    expert_ids: torch.Tensor  # [L, P // block_size] int32
    num_tokens_post_padded: torch.Tensor  # [L] int32

    @property
    def block_size(self) -> int:
        return self.sorted_token_ids.shape[1] // max(self.expert_ids.shape[1], 1)

    def padding_waste(self, num_pairs: int) -> float:
        """Fraction of padded slots that hold no pair (0 when nothing is padded)."""
        total = int(self.num_tokens_post_padded.sum())
        valid = int((self.sorted_token_ids < num_pairs).sum())
        return 0.0 if total == 0 else 1.0 - valid / total


def padded_row_length(num_pairs: int, num_experts: int, block_size: int) -> int:
    """P: the longest any adapter row can be, rounded up to a block.

    An adapter holds at most ``num_pairs`` pairs spread over at most min(E, num_pairs) experts,
    each segment wasting at most block_size - 1 slots.
    """
    worst = num_pairs + min(num_experts, num_pairs) * (block_size - 1)
    return max(block_size, -(-worst // block_size) * block_size)


def use_naive_assignment(num_pairs: int, num_experts: int, num_loras: int) -> bool:
    """The naive rule: one program per pair (no alignment) when pairs are few next to E*L.

    Sorting pays when many pairs share an (adapter, expert) weight; with num_pairs * 8 <= E * L
    almost every pair has its own weight, so sorting would only add padding and a launch.
    """
    return num_pairs * SPARSITY_FACTOR <= num_experts * num_loras


def _group_pairs(topk_ids, token_lora, num_experts: int, num_loras: int, block_size: int, validate: bool = True):
    """Validate (``validate=False``: shapes only), then sort pairs by group g = l*E + e (g = L*E: no adapter), keeping pair order.

    Returns (order [n]: pair ids in sorted order; group [n]: their group, 0 where ``valid`` is
    False; valid [n]: the pair has an adapter; rank [n]: position inside its group; counts [L*E]).
    """
    check_int("num_experts", num_experts, low=1)
    check_int("num_loras", num_loras, low=1)
    check_int("block_size", block_size, low=1)
    check_routing(topk_ids, token_lora, num_experts, num_loras, values=validate)
    E, L, k = num_experts, num_loras, topk_ids.shape[1]
    pair_lora = token_lora.long().repeat_interleave(k)                      # [n]
    key = torch.where(pair_lora >= 0, pair_lora * E + topk_ids.reshape(-1).long(),
                      torch.full_like(pair_lora, L * E))
    order = torch.sort(key, stable=True).indices
    counts = torch.zeros(L * E + 1, dtype=torch.long, device=key.device).scatter_add_(0, key, torch.ones_like(key))
    counts = counts[: L * E]
    skey = key[order]
    valid = skey < L * E
    group = torch.where(valid, skey, torch.zeros_like(skey))
    rank = torch.arange(key.numel(), device=key.device) - (counts.cumsum(0) - counts)[group]
    return order, group, valid, rank, counts


def align_block_size(topk_ids: torch.Tensor, token_lora: torch.Tensor, num_experts: int, num_loras: int,
                     block_size: int) -> Alignment:
    """Group each adapter's pairs by expert and pad every expert segment to ``block_size``."""
    order, group, valid, rank, counts = _group_pairs(topk_ids, token_lora, num_experts, num_loras, block_size)
    M, k = topk_ids.shape
    E, L, bs, dev = num_experts, num_loras, block_size, topk_ids.device
    num_pairs = M * k
    P = padded_row_length(num_pairs, E, bs)
    counts = counts.view(L, E)                                              # pairs per (adapter, expert)
    padded = (counts + bs - 1) // bs * bs                                   # [L, E]
    seg_end = padded.cumsum(dim=1)                                          # [L, E] end of each segment
    seg_start = seg_end - padded

    pos = seg_start.view(-1)[group] + rank                                  # slot inside the adapter row
    flat = torch.where(valid, (group // E) * P + pos, torch.full_like(pos, L * P))
    sorted_ids = torch.full((L * P + 1,), num_pairs, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, flat, order.to(torch.int32))
    sorted_ids = sorted_ids[: L * P].view(L, P)

    total = seg_end[:, -1]                                                  # [L]
    block_start = torch.arange(P // bs, device=dev) * bs                    # [P // bs]
    owner = torch.searchsorted(seg_end.contiguous(), block_start.expand(L, -1).contiguous(), right=True)
    expert_ids = torch.where(block_start[None, :] < total[:, None], owner, torch.full_like(owner, -1))
    return Alignment(sorted_ids, expert_ids.to(torch.int32), total.to(torch.int32))


def align_block_size_loop(topk_ids, token_lora, num_experts: int, num_loras: int, block_size: int) -> Alignment:
    """The same metadata with plain Python loops: slow, but readable line by line (used in tests)."""
    M, k = topk_ids.shape
    P = padded_row_length(M * k, num_experts, block_size)
    sorted_ids = torch.full((num_loras, P), M * k, dtype=torch.int32)
    expert_ids = torch.full((num_loras, P // block_size), -1, dtype=torch.int32)
    ntpp = torch.zeros(num_loras, dtype=torch.int32)
    ids, lora = topk_ids.cpu().tolist(), token_lora.cpu().tolist()
    for l in range(num_loras):
        cursor = 0
        for e in range(num_experts):
            pairs = [t * k + j for t in range(M) for j in range(k) if lora[t] == l and ids[t][j] == e]
            if not pairs:
                continue
            for i, p in enumerate(pairs):
                sorted_ids[l, cursor + i] = p
            padded = -(-len(pairs) // block_size) * block_size
            expert_ids[l, cursor // block_size:(cursor + padded) // block_size] = e
            cursor += padded
        ntpp[l] = cursor
    return Alignment(sorted_ids, expert_ids, ntpp)


def max_blocks(num_pairs: int, num_experts: int, num_loras: int, block_size: int) -> int:
    """Upper bound on the blocks of a BlockList: full blocks plus one partial block per group."""
    return max(1, num_pairs // block_size + min(num_experts * num_loras, num_pairs))


def block_list(topk_ids: torch.Tensor, token_lora: torch.Tensor, num_experts: int, num_loras: int,
               block_size: int, *, validate: bool = True) -> BlockList:
    """Group pairs by (adapter, expert), pad each group to ``block_size`` and list the blocks.

    Parameters
    ----------
    topk_ids : torch.Tensor
        [M, k] int32/int64 expert of each (token, slot) pair, in [0, E).
    token_lora : torch.Tensor
        [M] int32/int64 adapter slot of each token in [0, L); -1 = no adapter (its pairs get no block).
    num_experts, num_loras : int
        E and L.
    block_size : int
        Rows per block (the kernels' BLOCK_M).
    validate : bool
        False skips the id-range checks (one device synchronisation) for ids checked already.

    Returns
    -------
    BlockList
        ``sorted_pairs`` [B * block_size] (pair id t*k + j, M*k in padding), ``block_lora`` [B] and
        ``block_expert`` [B] (-1 for unused blocks); it remembers the routing it was built for (see
        :class:`BlockList`), so ``moe_lora(blocks=...)`` can reuse it for w13 and w2.

    Examples
    --------
    >>> import torch
    >>> import moelora_lab as ml
    >>> ids = torch.tensor([[0, 1], [1, 0], [1, 2]], dtype=torch.int32)   # M = 3 tokens, top-2 of E = 3
    >>> lora = torch.tensor([0, 0, 1], dtype=torch.int32)                  # the tokens' adapters, L = 2
    >>> blocks = ml.block_list(ids, lora, num_experts=3, num_loras=2, block_size=4)
    >>> blocks.block_lora.tolist(), blocks.block_expert.tolist()          # -1: an unused block
    ([0, 0, 1, 1, -1, -1, -1], [0, 1, 1, 2, -1, -1, -1])
    >>> blocks.sorted_pairs.view(-1, 4)[:4].tolist()                       # 6 = M*k marks padding
    [[0, 3, 6, 6], [1, 2, 6, 6], [4, 6, 6, 6], [5, 6, 6, 6]]
    """
    check_bool("validate", validate)
    tensors = block_tensors(topk_ids, token_lora, num_experts, num_loras, block_size, validate=validate)
    return BlockList(*tensors, RoutingStamp.of(topk_ids, token_lora, num_experts, num_loras, block_size,
                                               values_checked=validate))


def block_tensors(topk_ids, token_lora, num_experts: int, num_loras: int, block_size: int, *, validate: bool = True):
    """The three tensors of :func:`block_list` (sorted_pairs, block_lora, block_expert), no stamp."""
    order, group, valid, rank, counts = _group_pairs(topk_ids, token_lora, num_experts, num_loras, block_size,
                                                     validate)
    M, k = topk_ids.shape
    E, L, bs, dev = num_experts, num_loras, block_size, topk_ids.device
    n = M * k
    B = max_blocks(n, E, L, bs)
    blocks = (counts + bs - 1) // bs                                        # blocks per group
    block_end = blocks.cumsum(0)                                            # [L*E]

    pos = (block_end - blocks)[group] * bs + rank
    pos = torch.where(valid, pos, torch.full_like(pos, B * bs))
    pairs = torch.full((B * bs + 1,), n, dtype=torch.int32, device=dev)
    pairs.scatter_(0, pos, order.to(torch.int32))

    b = torch.arange(B, device=dev)
    owner = torch.searchsorted(block_end, b, right=True)                    # [B] virtual expert of block
    used = owner < L * E
    owner = torch.where(used, owner, torch.zeros_like(owner))
    none = torch.full_like(owner, -1)
    return (pairs[: B * bs], torch.where(used, owner // E, none).to(torch.int32),
            torch.where(used, owner % E, none).to(torch.int32))


def naive_block_list(topk_ids: torch.Tensor, token_lora: torch.Tensor, num_experts: int, num_loras: int,
                     block_size: int, *, validate: bool = True) -> BlockList:
    """One block per pair (the naive assignment): row 0 holds the pair, the others are padding."""
    check_int("block_size", block_size, low=1)
    M, k = check_routing(topk_ids, token_lora, num_experts, num_loras, values=validate)
    n, dev = M * k, topk_ids.device
    pairs = torch.full((n, block_size), n, dtype=torch.int32, device=dev)
    pairs[:, 0] = torch.arange(n, dtype=torch.int32, device=dev)
    lora = token_lora.to(torch.int32).repeat_interleave(k)
    expert = torch.where(lora >= 0, topk_ids.reshape(-1).to(torch.int32), torch.full_like(lora, -1))
    stamp = RoutingStamp.of(topk_ids, token_lora, num_experts, num_loras, block_size, values_checked=validate)
    return BlockList(pairs.view(-1), lora, expert, stamp)
