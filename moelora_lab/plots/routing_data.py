"""The numbers behind the routing pictures: padding of aligned blocks, naive vs sorted assignment.

Shape legend: M tokens, E experts, k top-k, L adapters, P slots per adapter row, pair p = t*k + j.

Pure functions returning plain dicts; ``plots.routing`` draws them.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..validate import INDEX_DTYPES, check_int, check_range, check_tensor
from ..config import LoRAShape, MoEShape, make_problem
from ..routing.host import Alignment, align_block_size, use_naive_assignment

COST_KEYS = ("num_tokens", "naive_loads", "sorted_loads")


def _check_list(name: str, value, what: str):
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise TypeError(f"{name}: expected a non-empty list of {what}, got {value!r}")
    return value


def _last_naive_tokens(num_experts: int, top_k: int, num_loras: int) -> int:
    """Largest M for which use_naive_assignment(M*k, E, L) holds (0 if none)."""
    m = 0
    while use_naive_assignment((m + 1) * top_k, num_experts, num_loras):
        m += 1
    return m


def _check_alignment(alignment, num_pairs):
    """Validate an Alignment and its sentinel num_pairs = M*k; returns CPU (ids, experts, ntpp, bs)."""
    if not isinstance(alignment, Alignment):
        raise TypeError(f"alignment: expected a moelora_lab.Alignment (from align_block_size), "
                        f"got {type(alignment).__name__}")
    n = check_int("num_pairs", num_pairs, low=0)
    ids = check_tensor("alignment.sorted_token_ids", alignment.sorted_token_ids, ndim=2,
                       dtypes=INDEX_DTYPES, legend="[L, P]").cpu().long()
    L, P = ids.shape
    experts = check_tensor("alignment.expert_ids", alignment.expert_ids, ndim=2, dtypes=INDEX_DTYPES,
                           shape=(L, None), legend="[L, P // block_size]").cpu().long()
    ntpp = check_tensor("alignment.num_tokens_post_padded", alignment.num_tokens_post_padded,
                        dtypes=INDEX_DTYPES, shape=(L,), legend="[L]").cpu().long()
    bs = alignment.block_size
    check_range("alignment.sorted_token_ids", ids, 0, n + 1,
                f"pair ids below num_pairs={n} and the padding sentinel {n}; is num_pairs M*k?")
    tail = torch.arange(P)[None, :] >= ntpp[:, None]                       # slots past each row's end
    if bool((ids[tail] != n).any()):
        raise ValueError(f"num_pairs: {n} is not the padding sentinel of alignment.sorted_token_ids "
                         f"(its unused slots hold {int(ids[tail].max())}); pass num_pairs = M*k")
    return ids, experts, ntpp, bs


def padding_stats(alignment: Alignment, num_pairs: int) -> dict:
    """How many slots of an Alignment hold a pair, and how many are padding.

    For every adapter row l (``per_adapter``) and in total:
      valid_slots    pairs placed in the row (ids < num_pairs)
      padded_slots   num_tokens_post_padded[l]: the row length the kernels walk
      padding_slots  padded_slots - valid_slots: sentinel slots inside used blocks
      waste          padding_slots / padded_slots (0.0 for an empty row)
      blocks         padded_slots // block_size: the programs that have work
    """
    ids, _, ntpp, bs = _check_alignment(alignment, num_pairs)

    def stats(valid: int, padded: int) -> dict:
        return dict(valid_slots=valid, padded_slots=padded, padding_slots=padded - valid,
                    waste=(padded - valid) / padded if padded else 0.0, blocks=padded // bs)

    valid = (ids < num_pairs).sum(dim=1).tolist()
    per = [dict(adapter=l, **stats(v, p)) for l, (v, p) in enumerate(zip(valid, ntpp.tolist()))]
    return dict(block_size=bs, num_pairs=num_pairs, **stats(sum(valid), int(ntpp.sum())), per_adapter=per)


def padding_by_block_size(topk_ids, token_lora, num_experts: int, num_loras: int, block_sizes) -> list[dict]:
    """``padding_stats`` of one routing aligned with each block size (ascending list of ints)."""
    for b in _check_list("block_sizes", block_sizes, "ints"):
        check_int("block_sizes[i]", b, low=1)
    num_pairs = topk_ids.numel() if isinstance(topk_ids, torch.Tensor) else 0
    return [padding_stats(align_block_size(topk_ids, token_lora, num_experts, num_loras, b), num_pairs)
            for b in block_sizes]


def find_crossover(rows) -> int | None:
    """First M from which on the sorted assignment loads fewer weight tiles than the naive one.

    ``rows`` are ordered by num_tokens and hold num_tokens, naive_loads and sorted_loads. Returns
    None when sorting never wins for good (a win followed by a loss at larger M does not count).
    """
    for i, row in enumerate(_check_list("rows", rows, "dicts (assignment_costs(...)['rows'])")):
        if not isinstance(row, Mapping) or any(key not in row for key in COST_KEYS):
            raise ValueError(f"rows[{i}]: expected a dict with keys {', '.join(COST_KEYS)}, got {row!r}")
    ms = [row["num_tokens"] for row in rows]
    if any(a >= b for a, b in zip(ms, ms[1:])):
        raise ValueError(f"rows: num_tokens must be strictly increasing, got {ms}")
    crossover = None
    for row in rows:
        if row["sorted_loads"] < row["naive_loads"]:
            crossover = row["num_tokens"] if crossover is None else crossover
        else:
            crossover = None
    return crossover


def assignment_costs(shape, num_loras: int, block_size: int, token_counts, *, seed: int = 0,
                     popularity: str = "uniform") -> dict:
    """Naive vs sorted assignment of (token, slot) pairs to programs, counted for each M in token_counts.

    Cost model (programs and weight loads are proxies for launch work and HBM traffic):
      naive   one program per pair that has an adapter; each program reads the weight tile of
              its own (adapter, expert), so two pairs of one (adapter, expert) read it twice.
              naive_programs = naive_loads = pairs with an adapter.
      sorted  align_block_size groups each adapter's pairs by expert into blocks of block_size;
              one program per block, and the block_size pairs of a block share one weight read.
              sorted_programs = sorted_loads = sum(num_tokens_post_padded) // block_size.
              sorted_grid = L * P // block_size is the grid a launch must reserve before the
              device knows num_tokens_post_padded; programs past it exit at once.
    distinct_weights (the touched (adapter, expert) pairs) is the floor of both: every weight
    read once. padding_waste is the fraction of walked slots that hold no pair.

    Problems come from ``make_problem(shape, LoRAShape(num_loras, 8), M, seed=seed,
    adapter_popularity=popularity, with_base=False)``. Returns a dict: shape, num_experts, top_k,
    num_loras, block_size, popularity, seed, rows (one dict per M, also with vllm_naive:
    use_naive_assignment(M*k, E, L)), crossover (find_crossover of the rows) and vllm_threshold
    (the largest M that vLLM's rule M*k*8 <= E*L still runs naive).
    """
    if isinstance(shape, str):
        shape = MoEShape.from_name(shape)
    if not isinstance(shape, MoEShape):
        raise TypeError(f"shape: expected a MoEShape or a preset name, got {type(shape).__name__}")
    L = check_int("num_loras", num_loras, low=1)
    bs = check_int("block_size", block_size, low=1)
    for m in _check_list("token_counts", token_counts, "ints"):
        check_int("token_counts[i]", m, low=1)
    if any(a >= b for a, b in zip(token_counts, token_counts[1:])):
        raise ValueError(f"token_counts: must be strictly increasing, got {list(token_counts)}")
    E, k = shape.num_experts, shape.top_k
    rows = []
    for m in token_counts:
        prob = make_problem(shape, LoRAShape(L, 8), m, seed=seed, adapter_popularity=popularity, with_base=False)
        align = align_block_size(prob.topk_ids, prob.token_lora, E, L, bs)
        st = padding_stats(align, m * k)
        has = prob.token_lora.long() >= 0
        keys = prob.token_lora.long()[has, None] * E + prob.topk_ids.long()[has]
        pairs = int(has.sum()) * k
        rows.append(dict(num_tokens=m, pairs=m * k, naive_programs=pairs, naive_loads=pairs,
                         sorted_programs=st["blocks"], sorted_loads=st["blocks"],
                         sorted_grid=L * align.expert_ids.shape[1], distinct_weights=int(torch.unique(keys).numel()),
                         padded_slots=st["padded_slots"], padding_waste=st["waste"],
                         vllm_naive=use_naive_assignment(m * k, E, L)))
    return dict(shape=shape.name, num_experts=E, top_k=k, num_loras=L, block_size=bs, popularity=popularity,
                seed=seed, rows=rows, crossover=find_crossover(rows), vllm_threshold=_last_naive_tokens(E, k, L))
