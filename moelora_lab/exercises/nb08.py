"""Exercises of notebook 08 (beyond one GPU: expert and tensor parallelism over W ranks).

Shape legend: M tokens per rank, E experts, k top-k, H hidden, W ranks, P = M*k pairs, b bytes per value.
Every truth comes from ``moelora_lab.dist.comm``: ``ep_bytes_uniform`` (the expected dispatch of uniform
routing) and ``ep_bytes`` (the bytes of a given routing, from its [W, W] pair matrix).
"""
from __future__ import annotations

import torch

from .core import Result, Exercise, predict_result, register, with_known_misses

NB = "08_beyond_one_gpu"

# ---- 08.dispatch_bytes: predict the rows one rank sends in the EP dispatch ----------------------------

DISPATCH = dict(shape="qwen3-30b-a3b", M=64, W=2, dtype_bytes=2)


def _grade_dispatch(guess) -> Result:
    from ..config import MoEShape
    from ..dist.comm import ep_bytes_uniform
    c = DISPATCH
    s = MoEShape.from_name(c["shape"])
    M, k, H, W, b = c["M"], s.top_k, s.hidden, c["W"], c["dtype_bytes"]
    truth = ep_bytes_uniform(M, k, H, W, dtype_bytes=b)
    explain = (f"M k pairs, a fraction (W-1)/W of them to experts on the other rank, H values of b bytes each: "
               f"{M} · {k} · {W - 1}/{W} · {H} · {b} = {truth:,.0f} bytes")
    res = predict_result("08.dispatch_bytes", guess, truth, rel=0.05, unit=" B", explain=explain)
    return with_known_misses(res, guess, {
        M * k * H * b: "that is every pair; the pairs whose expert lives on this rank never leave it",
        M * H * b * (W - 1) / W: "that is one row per token; each token is sent once per expert it picked (k)",
        M * k * H * (W - 1) / W: "that counts values; a bf16 value is 2 bytes",
        M * k * H * b * (W - 1) / W * 2: "that is the dispatch and the combine together; the dispatch alone"},
        rel=0.05)


DISPATCH_STUB = '''\
# Expert parallelism over W = 2 GPUs for qwen3-30b-a3b (H = 2048, k = 8), bf16, M = 64 tokens per GPU,
# experts picked uniformly at random. How many bytes of token rows does one GPU send to the other in
# the dispatch (rows only: leave out the few bytes of metadata per row)? Write a number, then run the check.
dispatch_bytes_guess = None
'''

# ---- 08.pair_bytes: the bytes of a routing, from its [W, W] pair matrix -----------------------------

PAIR_CASES = (dict(E=8, W=2, M=[6, 5], k=2, H=16), dict(E=12, W=3, M=[4, 7, 3], k=3, H=8),
              dict(E=16, W=4, M=[5, 0, 9, 2], k=4, H=32))


def _grade_pair_bytes(fn) -> Result:
    from ..dist.comm import META_BYTES, ep_bytes
    from ..dist.partition import ExpertPartition
    if not callable(fn):
        return Result(False, f"08.pair_bytes: expected a function, got {type(fn).__name__}")
    g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31 - 1, ())))
    for n, c in enumerate(PAIR_CASES):
        part = ExpertPartition(c["E"], c["W"])
        ids = [torch.rand(m, c["E"], generator=g).topk(c["k"], dim=1).indices for m in c["M"]]
        want = ep_bytes(ids, part, c["H"], dtype_bytes=2)
        pairs = torch.tensor(want["pairs"])
        out = fn(pairs.clone(), c["H"], 2)
        what = f"case {n + 1} (W = {c['W']}, H = {c['H']}, bf16, pairs {want['pairs']})"
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            return Result(False, f"08.pair_bytes: return a pair (dispatch, combine) of lists, got {type(out).__name__}")
        got = [[int(v) for v in part_] for part_ in out]
        if got == [want["dispatch"], want["combine"]]:
            continue
        row = c["H"] * 2
        full = pairs.sum(1)
        details = [f"dispatch: yours {got[0]}, expected {want['dispatch']}",
                   f"combine:  yours {got[1]}, expected {want['combine']}"]
        if got[0] == [int(v) * (row + META_BYTES) for v in full]:
            details.append("the diagonal (pairs whose expert is on their own rank) never crosses a link")
        elif got[0] == [int(v) * row for v in (pairs - torch.diag(torch.diag(pairs))).sum(1)]:
            details.append(f"each dispatched row also carries {META_BYTES} bytes of metadata (comm.META_BYTES)")
        elif got[1] == [int(v) * row for v in (pairs - torch.diag(torch.diag(pairs))).sum(1)]:
            details.append("the combine sends back what a rank received: the column sums, not the row sums")
        return Result(False, f"08.pair_bytes: {what} is wrong", tuple(details))
    return Result(True, f"08.pair_bytes: equals comm.ep_bytes on {len(PAIR_CASES)} random routings "
                        "(W = 2, 3 and 4, one rank without tokens)")


PAIR_STUB = '''\
import torch

from moelora_lab.dist.comm import META_BYTES     # bytes of metadata a dispatched row carries


def pair_bytes(pairs, hidden, dtype_bytes):
    """Bytes each rank sends over the links in the EP dispatch and in the combine.

    pairs [W, W] (int64): pairs[src, dst] = how many (token, expert) pairs of rank src go to an expert
    that rank dst owns (the diagonal: pairs that stay home).
    A dispatched row is `hidden` values of `dtype_bytes` bytes plus META_BYTES; a combined row comes back
    without metadata. Returns (dispatch, combine): two lists of W ints, bytes sent by rank 0 .. W-1.
    """
    raise NotImplementedError
'''

register(
    Exercise("08.dispatch_bytes", NB, "predict", "the bytes one GPU sends in the expert-parallel dispatch",
             "dispatch_bytes_guess", DISPATCH_STUB, _grade_dispatch,
             hint="Each token is a row of H values for each of its k experts: M·k pairs. An expert lives on one "
                  "of W ranks, so with uniform routing (W−1)/W of the pairs go to another GPU. Each row is H·2 bytes."),
    Exercise("08.pair_bytes", NB, "code", "the dispatch and combine bytes of a routing's pair matrix",
             "pair_bytes", PAIR_STUB, _grade_pair_bytes,
             hint="Zero the diagonal first (torch.diag(torch.diag(pairs)) is the diagonal as a matrix). Rank w "
                  "dispatches row w's sum, each row hidden·dtype_bytes + META_BYTES; it sends back in the combine "
                  "what it received, column w's sum, hidden·dtype_bytes each."),
)
