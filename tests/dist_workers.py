"""``run_local`` workers of tests/test_dist.py (importable by name in the spawned processes)."""
from __future__ import annotations

import moelora_lab  # noqa: F401  (must come before triton)

import torch

from moelora_lab.dist import ExpertPartition, ep_layer, shard_tp, tp_layer
from moelora_lab.dist.checks import ep_case, make_case_problem, tp_case, default_case
from moelora_lab.dist.ep import count_pairs


def many(rank, world, cases: dict) -> dict:
    """Every case of one world size, in one process group."""
    fns = {"ep": ep_case, "tp": tp_case}
    return {name: fns[kind](rank, world, case) for name, (kind, case) in cases.items()}


def _message(fn) -> str:
    try:
        fn()
    except (ValueError, TypeError) as e:
        return str(e)
    return "no error"


def errors(rank, world) -> dict:
    case = default_case()
    p, _ = make_case_problem(case, world)
    part = ExpertPartition(p.shape.num_experts, world)
    weights = dict(w13=p.w13, w2=p.w2)
    local = part.shard(weights, rank)
    args = (p.x, p.topk_ids, p.topk_weights, p.token_lora)
    counts = count_pairs(p.topk_ids, part)
    lora = {k: list(getattr(p, k)) for k in ("w13_lora_a", "w13_lora_b", "w2_lora_a", "w2_lora_b")}
    replicated = shard_tp(dict(weights, **lora), rank, world, fully_sharded=False)
    return dict(
        partition=_message(lambda: ep_layer(*args, local, ExpertPartition(p.shape.num_experts, 3))),
        local=_message(lambda: ep_layer(*args, weights, part)),
        counts=_message(lambda: ep_layer(*args, local, part, micro_batches=2, counts=counts)),
        ids=_message(lambda: ep_layer(p.x, p.topk_ids + 100, p.topk_weights, p.token_lora, local, part)),
        tp_shards=_message(lambda: tp_layer(*args, replicated, fully_sharded=True)),
    )


def fail_on_one(rank, world):
    if rank == 1:
        raise ValueError("rank one fails")
    return torch.zeros(1)
