"""Exercises of notebook 01 (routing: pairs, block alignment, padding, naive or sorted).

Shape legend: M tokens, E experts, k top-k, L adapters, pair p = t*k + j, BLOCK_M pairs per block.
"""
from __future__ import annotations

import random

import torch

from .core import Exercise, Result, predict_result, register

NB = "01_routing"

# ---- 01.padding_share: predict the padding of a mid-size batch ---------------------------------------

PADDING = dict(shape="qwen3-30b-a3b", L=4, M=256, BLOCK_M=16, seed=0)   # the notebook's M = 256 row


def _grade_padding(guess) -> Result:
    from ..config import LoRAShape, MoEShape, make_problem
    from ..plots import padding_stats
    from ..routing.host import align_block_size
    c = PADDING
    if isinstance(guess, (int, float)) and not isinstance(guess, bool) and not 0 <= guess <= 1:
        return Result(False, f"01.padding_share: write a fraction between 0 and 1 (0.5 for half), got {guess!r}")
    shape = MoEShape.from_name(c["shape"])
    p = make_problem(shape, LoRAShape(c["L"], 8), c["M"], seed=c["seed"], with_base=False)
    st = padding_stats(align_block_size(p.topk_ids, p.token_lora, shape.num_experts, c["L"], c["BLOCK_M"]),
                       c["M"] * shape.top_k)
    pairs, segs, bs = c["M"] * shape.top_k, shape.num_experts * c["L"], c["BLOCK_M"]
    d = pairs / segs
    return predict_result("01.padding_share", guess, st["waste"], rel=0.05,
                          explain=f"{pairs} pairs over E·L = {segs} segments, {d:g} per segment: almost every "
                                  f"segment in use fits in one block of {bs}, so about {bs - d:g} of its {bs} slots "
                                  f"are padding; measured: {st['padding_slots']:,} of {st['padded_slots']:,} slots")


PADDING_STUB = '''\
# qwen3-30b-a3b (E = 128, k = 8), L = 4 adapters drawn uniformly, M = 256 tokens, BLOCK_M = 16:
# what fraction of the slots align_block_size walks is padding? Write a fraction between 0 and 1.
padding_guess = None
'''

# ---- 01.align_one_adapter: write the block alignment of one adapter -----------------------------------


def _routing(g: torch.Generator, M: int, k: int, E: int, *, empty: int = 0, hot: float = 0.0) -> torch.Tensor:
    """topk_ids [M, k] int32: k distinct experts per token; ``empty`` experts get no pair, the first
    ones are ``hot`` (weight e^hot)."""
    weights = torch.ones(E)
    weights[: max(1, E // 4)] = float(torch.tensor(hot).exp())
    weights[torch.randperm(E, generator=g)[:empty]] = 0.0
    return torch.stack([torch.multinomial(weights, k, generator=g) for _ in range(M)]).to(torch.int32)


def _align_cases(seed: int):
    """(name, topk_ids, E, BLOCK_M): random routings, with empty experts and segments of any length."""
    g = torch.Generator().manual_seed(seed)
    exact = torch.tensor([1] * 4 + [3] * 8, dtype=torch.int32)[torch.randperm(12, generator=g)].view(12, 1)
    return [
        ("two experts unused", _routing(g, 9, 2, 6, empty=2), 6, 4),
        ("hot experts", _routing(g, 16, 4, 16, empty=3, hot=2.0), 16, 8),
        ("segments of exactly one and two blocks", exact, 5, 4),
        ("BLOCK_M = 1", _routing(g, 5, 3, 7, empty=1), 7, 1),
        ("one long segment", _routing(g, 20, 1, 3, hot=3.0), 3, 4),
    ]


def _as_ids(value, name: str) -> torch.Tensor:
    t = torch.as_tensor(value)
    if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise TypeError(f"{name} should be a 1-D integer tensor, got dtype {t.dtype} and shape {tuple(t.shape)}")
    return t.long()


def _diff_one_adapter(fn, name, topk_ids, E, bs) -> tuple[str, ...] | None:
    """None when ``fn`` agrees with align_block_size on this routing, else what differs."""
    from ..routing.host import align_block_size
    M, k = topk_ids.shape
    a = align_block_size(topk_ids, torch.zeros(M, dtype=torch.int32), E, 1, bs)
    T = int(a.num_tokens_post_padded[0])
    want_ids, want_exp = a.sorted_token_ids[0, :T].long(), a.expert_ids[0, : T // bs].long()
    out = fn(topk_ids.clone(), E, bs)
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        return (f"return a pair (sorted_ids, block_expert), got {type(out).__name__}",)
    got_ids, got_exp = _as_ids(out[0], "sorted_ids"), _as_ids(out[1], "block_expert")
    counts = torch.bincount(topk_ids.reshape(-1).long(), minlength=E).tolist()
    segs = ", ".join(f"expert {e}: {n} -> {-(-n // bs) * bs}" for e, n in enumerate(counts) if n)
    where = (f"{name}: M = {M}, k = {k}, E = {E}, BLOCK_M = {bs}, sentinel M*k = {M * k}",
             f"topk_ids = {topk_ids.tolist()}")
    if got_ids.numel() != T or got_exp.numel() != T // bs:
        return (*where, f"sorted_ids has {got_ids.numel()} slots and block_expert {got_exp.numel()} blocks; expected "
                        f"{T} slots in {T // bs} blocks (pairs -> padded slots per expert: {segs})")
    bad = [b for b in range(T // bs) if not torch.equal(got_ids[b * bs:(b + 1) * bs], want_ids[b * bs:(b + 1) * bs])
           or got_exp[b] != want_exp[b]]
    if not bad:
        return None
    lines = [f"block {b}: got ids {got_ids[b * bs:(b + 1) * bs].tolist()} expert {int(got_exp[b])}; "
             f"want {want_ids[b * bs:(b + 1) * bs].tolist()} expert {int(want_exp[b])}" for b in bad[:4]]
    pad = want_ids == M * k
    if torch.equal(got_ids[~pad], want_ids[~pad]) and torch.equal(got_exp, want_exp):
        lines.append(f"the pairs are right; every padding slot must hold the sentinel M*k = {M * k}")
    more = [f"(and {len(bad) - 4} more blocks)"] if len(bad) > 4 else []
    return (*where, f"{len(bad)} of {T // bs} blocks differ:", *lines, *more)


def _grade_align(fn) -> Result:
    if not callable(fn):
        return Result(False, f"01.align_one_adapter: expected a function, got {type(fn).__name__}")
    cases = _align_cases(random.randrange(2 ** 31))
    for i, (name, topk_ids, E, bs) in enumerate(cases):
        wrong = _diff_one_adapter(fn, name, topk_ids, E, bs)
        if wrong:
            return Result(False, f"01.align_one_adapter: case {i + 1} of {len(cases)} differs from align_block_size",
                          wrong)
    return Result(True, f"01.align_one_adapter: matches align_block_size on {len(cases)} fresh routings",
                  ("; ".join(c[0] for c in cases),))


ALIGN_STUB = '''\
import torch


def align_one_adapter(topk_ids, num_experts, block_size):
    """The block alignment of one adapter (every token uses it), in plain PyTorch or Python.

    topk_ids [M, k] int: the k experts of each token; pair p = t*k + j.
    Returns (sorted_ids [T], block_expert [T // block_size]), integer tensors:
      sorted_ids    the pairs of expert 0, then of expert 1, ... (p ascending inside an expert), each
                    expert's segment padded with the sentinel M*k to a multiple of block_size;
                    an expert with no pair takes no slot; T is the padded length
      block_expert  the expert of each block of block_size slots
    """
    raise NotImplementedError
'''

# ---- 01.sorted_saving: predict what sorting saves past the rule's threshold ---------------------------

SAVING = dict(shape="qwen3-30b-a3b", L=4, BLOCK_M=16, M=64, seed=0)   # the notebook's M = 64 row


def _grade_saving(guess) -> Result:
    from ..plots import assignment_costs
    c = SAVING
    cost = assignment_costs(c["shape"], c["L"], c["BLOCK_M"], [c["M"]], seed=c["seed"])
    row = cost["rows"][0]
    weights = cost["num_experts"] * cost["num_loras"]
    return predict_result("01.sorted_saving", guess, row["naive_loads"] - row["sorted_loads"], rel=0.10,
                          unit=" loads",
                          explain=f"{row['pairs']} pairs over E·L = {weights} weights, one pair per weight on "
                                  f"average: {row['distinct_weights']} weights are touched and each fits one block, "
                                  f"so sorting loads {row['sorted_loads']} tiles where naive loads "
                                  f"{row['naive_loads']}")


SAVING_STUB = '''\
# qwen3-30b-a3b (E = 128, k = 8), L = 4 adapters drawn uniformly, BLOCK_M = 16, M = 64 tokens:
# how many fewer weight-tile loads does the sorted assignment make than the naive one?
saving_guess = None
'''

# ---- 01.assignment_loads: write the cost model ----------------------------------------------------------


def _loads_cases(seed: int):
    """(name, topk_ids, token_lora, E, L, BLOCK_M): routings with idle tokens, short and long segments."""
    g = torch.Generator().manual_seed(seed)

    def lora(M, L, idle):
        t = torch.randint(0, L, (M,), generator=g, dtype=torch.int32)
        t[torch.randperm(M, generator=g)[:idle]] = -1
        return t
    return [
        ("many weights, few pairs", _routing(g, 6, 2, 16), lora(6, 3, 1), 16, 3, 4),
        ("segments longer than a block", _routing(g, 40, 2, 4), lora(40, 2, 5), 4, 2, 4),
        ("BLOCK_M = 16, a third of the tokens idle", _routing(g, 48, 4, 8, hot=1.0), lora(48, 4, 16), 8, 4, 16),
        ("BLOCK_M = 1", _routing(g, 7, 2, 5), lora(7, 2, 2), 5, 2, 1),
    ]


def _why_sorted(got, topk_ids, token_lora, E, L, bs) -> str:
    k = topk_ids.shape[1]
    has = token_lora.long() >= 0
    counts = torch.bincount((token_lora.long()[has, None] * E + topk_ids.long()[has]).reshape(-1), minlength=E * L)
    with_idle = torch.bincount((token_lora.long().clamp(min=0)[:, None] * E + topk_ids.long()).reshape(-1),
                               minlength=E * L)
    guesses = {
        int((counts > 0).sum()): "one load per touched (adapter, expert): a segment of n pairs takes ceil(n / "
                                 "BLOCK_M) blocks",
        int((counts // bs).sum()): "rounded down: a partly filled block is still a program and a load",
        -(-int(counts.sum()) // bs): "blocks do not mix (adapter, expert) groups: pad each group on its own",
        int(((with_idle + bs - 1) // bs).sum()): "tokens with token_lora = -1 have no adapter: their pairs are "
                                                 "in no block",
        int(has.sum()) * k: "that is the naive count: in the sorted assignment a block's pairs share one load",
    }
    return guesses.get(got, "count the pairs of each (adapter, expert), then the blocks of BLOCK_M each needs")


def _grade_loads(fn) -> Result:
    from ..routing.host import align_block_size
    if not callable(fn):
        return Result(False, f"01.assignment_loads: expected a function, got {type(fn).__name__}")
    cases = _loads_cases(random.randrange(2 ** 31))
    for i, (name, topk_ids, token_lora, E, L, bs) in enumerate(cases):
        M, k = topk_ids.shape
        a = align_block_size(topk_ids, token_lora, E, L, bs)
        want = (int((token_lora >= 0).sum()) * k, int(a.num_tokens_post_padded.sum()) // bs)
        out = fn(topk_ids.clone(), token_lora.clone(), E, L, bs)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            return Result(False, f"01.assignment_loads: return (naive_loads, sorted_loads), got {type(out).__name__}")
        got = tuple(int(v) for v in out)
        if got == want:
            continue
        where = (f"{name}: M = {M}, k = {k}, E = {E}, L = {L}, BLOCK_M = {bs}",
                 f"token_lora = {token_lora.tolist()}")
        notes = []
        if got[0] != want[0]:
            why = ("tokens with token_lora = -1 do no work" if got[0] == M * k else
                   "one load per pair with an adapter (k pairs per token)")
            notes.append(f"naive_loads {got[0]}, want {want[0]}: {why}")
        if got[1] != want[1]:
            notes.append(f"sorted_loads {got[1]}, want {want[1]}: "
                         f"{_why_sorted(got[1], topk_ids, token_lora, E, L, bs)}")
        return Result(False, f"01.assignment_loads: case {i + 1} of {len(cases)} is off", (*where, *notes))
    return Result(True, f"01.assignment_loads: both counts right on {len(cases)} fresh routings",
                  ("; ".join(c[0] for c in cases),))


LOADS_STUB = '''\
import torch


def assignment_loads(topk_ids, token_lora, num_experts, num_loras, block_size):
    """Weight-tile loads of the two assignments, in plain PyTorch or Python.

    topk_ids [M, k] int: the k experts of each token; token_lora [M] int: its adapter, -1 = none.
      naive   one program per pair with an adapter; each loads its (adapter, expert) weight tile
      sorted  one program per block of align_block_size; the pairs of a block share one load
    Returns (naive_loads, sorted_loads), two ints.
    """
    raise NotImplementedError
'''

register(
    Exercise("01.align_one_adapter", NB, "code", "block alignment of one adapter", "align_one_adapter",
             ALIGN_STUB, _grade_align,
             hint="Flatten topk_ids to [M·k]: position p is pair p. For each expert e in order, take the "
                  "positions where it equals e ((flat == e).nonzero() keeps them ascending), append them, then "
                  "append the sentinel M·k until the length is a multiple of block_size, and append e once per "
                  "block of that segment to block_expert. Skip experts with no pair."),
    Exercise("01.padding_share", NB, "predict", "the padding share of a mid-size batch", "padding_guess",
             PADDING_STUB, _grade_padding,
             hint="Count pairs per (adapter, expert) segment: M·k / (E·L). When that is well under BLOCK_M, "
                  "almost every segment in use is a single block, so a segment of d pairs leaves "
                  "BLOCK_M − d slots of padding."),
    Exercise("01.sorted_saving", NB, "predict", "what sorting saves past the rule's threshold", "saving_guess",
             SAVING_STUB, _grade_saving,
             hint="Naive loads one tile per pair. Sorted loads one per block; with about one pair per weight "
                  "every touched weight is one block, so sorted loads = touched weights. d pairs thrown "
                  "uniformly on W weights touch about W·(1 − e^(−d/W)) of them."),
    Exercise("01.assignment_loads", NB, "code", "count the loads of naive and sorted", "assignment_loads",
             LOADS_STUB, _grade_loads,
             hint="Naive: k loads per token whose token_lora is not -1. Sorted: count the pairs of each "
                  "(adapter, expert) group, key l·E + e over the tokens with an adapter (torch.bincount), "
                  "and sum ceil(count / block_size) over the groups."),
)
