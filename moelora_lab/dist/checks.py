"""Distributed layers against the single-process layer and the spec, one case per call.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, H hidden, I intermediate, W ranks.

``ep_case`` and ``tp_case`` are ``run_local`` workers (``fn(rank, W, case)``): every rank draws the
same seeded problem, runs its share through the distributed layer, runs the whole batch through
:func:`moelora_lab.moe_lora_layer` in one process and through the PyTorch spec, and returns the
largest differences (relative to the spec's largest value). The tests, the two-GPU run and
notebook 08 use them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..config import LoRAShape, MoEShape, make_problem
from ..layer import moe_lora_layer
from ..layer.table import AUTO_CPU
from ..reference import moe_layer_reference
from ..routing.host import route
from .ep import ep_layer
from .partition import LORA_KEYS, ExpertPartition, shard_tp

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def default_case(**changes) -> dict:
    """A small case for the CPU interpreter: tiny preset, 2 adapters of rank 8 (change any key)."""
    case = dict(preset="tiny", tokens=[6, 4, 5, 3], num_loras=2, rank=8, adapter_ranks=None,
                no_adapter_fraction=0.25, hot_rank=None, micro_batches=1, lora=True, dtype="float32",
                device="cpu", seed=0, fully_sharded=True, lora_path="auto", schedule="auto")
    case.update(changes)
    return case


_PROBLEMS: dict = {}
_PROBLEM_KEYS = ("preset", "tokens", "num_loras", "rank", "adapter_ranks", "no_adapter_fraction", "hot_rank", "dtype",
                 "device", "seed")


def make_case_problem(case: dict, world: int):
    """The whole batch of a case (the same on every rank): a Problem, routed as the case says (the
    last one is kept: cases of one process that differ only in the layer reuse it)."""
    key = (world,) + tuple(repr(case[k]) for k in _PROBLEM_KEYS)
    if key not in _PROBLEMS:
        _PROBLEMS.clear()
        _PROBLEMS[key] = _draw(case, world)
    return _PROBLEMS[key]


def _draw(case: dict, world: int):
    shape = MoEShape.from_name(case["preset"])
    tokens = case["tokens"][:world]
    device = _device(case)
    p = make_problem(shape, LoRAShape(case["num_loras"], case["rank"]), max(1, sum(tokens)),
                     dtype=DTYPES[case["dtype"]], seed=case["seed"], adapter_ranks=case["adapter_ranks"],
                     no_adapter_fraction=case["no_adapter_fraction"], num_sequences=max(1, sum(tokens) // 2))
    if case["hot_rank"] is not None:                 # every pair to the experts of one rank
        ex = ExpertPartition(shape.num_experts, world).experts_of(case["hot_rank"])
        logits = torch.full_like(p.router_logits, float("-inf"))
        logits[:, ex.start:ex.stop] = p.router_logits[:, ex.start:ex.stop]
        p.topk_weights, p.topk_ids = route(logits, min(shape.top_k, len(ex)))
    for name in ("x", "topk_weights", "topk_ids", "token_lora", "w13", "w2") + LORA_KEYS:
        t = getattr(p, name)
        setattr(p, name, [w.to(device) for w in t] if isinstance(t, tuple) else t.to(device))
    return p, tokens


def _device(case) -> torch.device:
    if case["device"] == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(case["device"])


def _weights(p, with_lora: bool) -> dict:
    w = dict(w13=p.w13, w2=p.w2)
    if with_lora:
        w.update({key: list(getattr(p, key)) for key in LORA_KEYS})
    return w


def _ranks(case):
    ranks = case["adapter_ranks"]
    return None if ranks is None else torch.tensor(ranks, dtype=torch.int32)


def _compare(y, whole, spec, scale) -> dict:
    scale = float(scale.abs().max().clamp_min(1e-6))
    return dict(vs_layer=float((y.float() - whole.float()).abs().max() / scale) if y.numel() else 0.0,
                vs_spec=float((y.float() - spec).abs().max() / scale) if y.numel() else 0.0,
                rows=int(y.shape[0]), finite=bool(torch.isfinite(y).all()))


def _single(p, case, with_lora):
    lora = {key: getattr(p, key) for key in LORA_KEYS} if with_lora else {}
    # the whole layer on one device and one stream: what the parallel layers must match
    whole = moe_lora_layer(p.x, p.topk_ids, p.topk_weights, p.token_lora, p.w13, p.w2, **lora,
                           schedule=AUTO_CPU, lora_ranks=_ranks(case))
    no_adapter = torch.full_like(p.token_lora, -1)          # the spec without LoRA: no token has an adapter
    spec = moe_layer_reference(p.x, p.topk_ids, p.topk_weights, p.token_lora if with_lora else no_adapter, p.w13,
                               p.w2, **{key: getattr(p, key) for key in LORA_KEYS})
    return whole, spec


def ep_case(rank: int, world: int, case: dict) -> dict:
    """Expert parallelism over the group: this rank's tokens are its slice of ``case['tokens']``."""
    p, tokens = make_case_problem(case, world)
    part = ExpertPartition(p.shape.num_experts, world)
    local = part.shard(_weights(p, case["lora"]), rank)
    lo, hi = sum(tokens[:rank]), sum(tokens[:rank + 1])
    y = ep_layer(p.x[lo:hi], p.topk_ids[lo:hi], p.topk_weights[lo:hi], p.token_lora[lo:hi], local, part,
                 lora_ranks=_ranks(case), micro_batches=case["micro_batches"], schedule=case["schedule"],
                 lora_path=case["lora_path"])
    whole, spec = _single(p, case, case["lora"])
    received = _received(p.topk_ids[:sum(tokens)], part, rank)
    return dict(_compare(y, whole[lo:hi], spec[lo:hi], spec), received=received)


def _received(topk_ids, part, rank) -> int:
    """Pairs of the whole batch whose expert this rank owns (what its experts step computes)."""
    return int((part.owner(topk_ids) == rank).sum())


def tp_case(rank: int, world: int, case: dict) -> dict:
    """Tensor parallelism over the group: every rank runs the whole batch (``sum(case['tokens'])``)."""
    from .tp import tp_layer
    p, tokens = make_case_problem(case, world)
    local = shard_tp(_weights(p, case["lora"]), rank, world, fully_sharded=case["fully_sharded"])
    y = tp_layer(p.x, p.topk_ids, p.topk_weights, p.token_lora, local, fully_sharded=case["fully_sharded"],
                 lora_ranks=_ranks(case), lora_path=case["lora_path"])
    whole, spec = _single(p, case, case["lora"])
    same = [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(same, y.contiguous())
    agree = max(float((o.float() - y.float()).abs().max()) for o in same) if y.numel() else 0.0
    n = sum(tokens)
    return dict(_compare(y[:n], whole[:n], spec[:n], spec), ranks_agree=agree == 0.0,
                lora_bytes=sum(t.numel() * t.element_size() for key in LORA_KEYS for t in local.get(key) or []))
