"""``run_local`` workers of tests/test_dist.py and tests/test_dist_inputs.py (importable by name in the
spawned processes)."""
from __future__ import annotations

import moelora_lab  # noqa: F401  (must come before triton)

import torch

from moelora_lab.dist import ExpertPartition, ep_layer, shard_tp, tp_layer
from moelora_lab.dist.checks import ep_case, make_case_problem, tp_case, default_case
from moelora_lab.dist.ep import count_pairs
from moelora_lab.reference import moe_layer_reference


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


# ---- crashes: processes that die without a report ---------------------------------------------


def exit_on_one(rank, world):
    """Rank 1 leaves at once with exit code 3, reporting nothing; the others finish their work."""
    import os
    if rank == 1:
        os._exit(3)
    return rank


def killed_on_one(rank, world):
    """Rank 1 is killed by SIGKILL (as the out-of-memory killer does); the others wait for it in a
    barrier, which fails when its connection drops."""
    import os
    import signal
    import torch.distributed as dist
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    return rank


# ---- small seeded problems for the input checks and the fuzz -----------------------------------


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _problem(spec: dict) -> dict:
    """The whole batch of one case (the same on every rank), in fp32 on the CPU: x, routing, base and
    LoRA weights, the slots' ranks and where nothing may read (``dead`` [L, r]: the ranks past each slot's
    own, and every rank of a slot no token uses)."""
    g = _gen(spec["seed"])
    E, k, H, I, M = spec["E"], spec["k"], spec["H"], spec["I"], sum(spec["tokens"])
    L, r = spec.get("L"), spec.get("r")
    x = torch.randn(M, H, generator=g)
    scores = torch.rand(M, E, generator=g)
    topk_ids = scores.argsort(1, descending=True)[:, :k].to(torch.int32)          # k distinct experts per token
    topk_weights = torch.softmax(torch.randn(M, k, generator=g), 1)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g) / I ** 0.5
    p = dict(x=x, topk_ids=topk_ids, topk_weights=topk_weights, w13=w13, w2=w2, L=L, r=r)
    if L is None:
        p["token_lora"] = torch.full((M,), -1, dtype=torch.int32)
        return p
    used = spec.get("used_slots", list(range(L)))                 # slots the tokens may use; others: poison
    pick = torch.randint(-1, len(used), (M,), generator=g)
    p["token_lora"] = torch.where(pick < 0, -1, torch.tensor(used)[pick.clamp(min=0)]).to(torch.int32)
    scale = 0.5
    p["w13_lora_a"] = [torch.randn(L, E, r, H, generator=g) / H ** 0.5 for _ in range(2)]
    p["w13_lora_b"] = [torch.randn(L, E, I, r, generator=g) * scale / max(r, 1) ** 0.5 for _ in range(2)]
    p["w2_lora_a"] = [torch.randn(L, E, r, I, generator=g) / I ** 0.5]
    p["w2_lora_b"] = [torch.randn(L, E, H, r, generator=g) * scale / max(r, 1) ** 0.5]
    ranks = spec.get("lora_ranks")
    real = torch.tensor(ranks if ranks is not None else [r] * L)
    dead = torch.arange(r)[None, :] >= real[:, None]                              # [L, r]: ranks past a slot's
    for l in range(L):
        if l not in used:
            dead[l] = True                                                      # a slot no token uses
    p["lora_ranks"] = None if ranks is None else torch.tensor(ranks, dtype=torch.int32)
    p["dead"] = dead
    return p


LORA = ("w13_lora_a", "w13_lora_b", "w2_lora_a", "w2_lora_b")


def _weights(p, dtype, *, poison: bool, packed: bool = False) -> dict:
    """The layer's weights in ``dtype``; ``poison``: NaN wherever nothing may read (A rows and B columns
    past a slot's rank, every weight of a slot no token uses), else zeros there (what the spec reads)."""
    w = dict(w13=p["w13"].to(dtype), w2=p["w2"].to(dtype))
    if p["L"] is None:
        return w
    fill = float("nan") if poison else 0.0
    dead = p["dead"]
    for key in LORA:
        out = []
        for t in p[key]:
            t = t.clone()
            if key.endswith("_a"):
                t[dead[:, None, :, None].expand_as(t)] = fill
            else:
                t[dead[:, None, None, :].expand_as(t)] = fill
            t = t.to(dtype)
            if packed and key.endswith("_b"):
                t = t.transpose(2, 3).contiguous().transpose(2, 3)                 # N fastest in memory
            out.append(t)
        w[key] = out
    return w


def _spec_output(p, dtype) -> torch.Tensor:
    """The spec on the clean weights (zeros where the layer's copy holds NaN), fp32 [M, H]."""
    w = _weights(p, dtype, poison=False)
    if p["L"] is None:
        E, H, I = p["w2"].shape
        zero = dict(w13_lora_a=[torch.zeros(1, E, 1, H, dtype=dtype)] * 2,
                    w13_lora_b=[torch.zeros(1, E, I, 1, dtype=dtype)] * 2,
                    w2_lora_a=[torch.zeros(1, E, 1, I, dtype=dtype)], w2_lora_b=[torch.zeros(1, E, H, 1, dtype=dtype)])
        w.update(zero)
    return moe_layer_reference(p["x"].to(dtype), p["topk_ids"], p["topk_weights"], p["token_lora"], w["w13"], w["w2"],
                               *(w[key] for key in LORA))


def _ranks_layout(lora_ranks, spec: dict):
    """The slots' ranks as the case asks: with ``strided``, an int32 view with the full rank r between
    its values (a kernel that ignored the stride would read rows past a slot's rank: NaN); else int64."""
    if lora_ranks is None:
        return None
    if spec.get("strided"):
        return torch.stack([lora_ranks, torch.full_like(lora_ranks, spec["r"])], 1).reshape(-1)[::2]
    return lora_ranks.long()


def _layouts(x, topk_ids, topk_weights, token_lora, spec: dict):
    """The same values in the memory layouts the case asks for: x a strided view of a NaN-filled buffer,
    topk_ids int64 in column-major order, topk_weights a strided view beside NaN, token_lora strided
    with -1 between its values."""
    if spec.get("strided"):
        buf = torch.full((x.shape[0], 2 * x.shape[1]), float("nan"), dtype=x.dtype)
        buf[:, 1::2] = x
        x = buf[:, 1::2]
        topk_ids = topk_ids.long().T.contiguous().T
        wbuf = torch.full((topk_weights.shape[0], 2 * topk_weights.shape[1]), float("nan"))
        wbuf[:, ::2] = topk_weights
        topk_weights = wbuf[:, ::2]
        token_lora = torch.stack([token_lora, -1 * torch.ones_like(token_lora)], 1).reshape(-1)[::2]
    return x, topk_ids, topk_weights, token_lora


def _fuzz_case(rank, world, spec: dict, group) -> dict:
    dtype = DTYPES[spec["dtype"]]
    p = _problem(spec)
    ref = _spec_output(p, dtype)
    weights = _weights(p, dtype, poison=True, packed=spec.get("packed", False))
    x = p["x"].to(dtype)
    if spec.get("grad"):                      # inputs that require grad: the forward serves, a backward refuses
        x.requires_grad_()
        for w in (t for key in LORA for t in (weights.get(key) or [])):
            w.requires_grad_()
    if spec["layer"] == "ep":
        tokens = spec["tokens"]
        lo, hi = sum(tokens[:rank]), sum(tokens[:rank + 1])
        part = ExpertPartition(spec["E"], world)
        local = part.shard(weights, rank)
        args = _layouts(x[lo:hi], p["topk_ids"][lo:hi], p["topk_weights"][lo:hi], p["token_lora"][lo:hi], spec)
        y = ep_layer(*args, local, part, group=group, lora_ranks=_ranks_layout(p.get("lora_ranks"), spec),
                     micro_batches=spec.get("micro_batches", 1), lora_path=spec.get("lora_path", "auto"))
        ref = ref[lo:hi]
    else:
        local = shard_tp(weights, rank, world, fully_sharded=spec["fully_sharded"])
        args = _layouts(x, p["topk_ids"], p["topk_weights"], p["token_lora"], spec)
        y = tp_layer(*args, local, fully_sharded=spec["fully_sharded"], group=group,
                     lora_ranks=_ranks_layout(p.get("lora_ranks"), spec), lora_path=spec.get("lora_path", "auto"))
    refusal = None
    if spec.get("grad"):
        try:
            y.sum().backward()
        except ValueError as e:
            refusal = str(e)
        y = y.detach()
    scale = float(ref.abs().max()) if ref.numel() else 1.0
    err = float((y.float() - ref).abs().max()) / max(scale, 1e-6) if y.numel() else 0.0
    return dict(rel_err=err, finite=bool(torch.isfinite(y).all()), shape=tuple(y.shape), want=tuple(ref.shape),
                dtype=str(y.dtype).replace("torch.", ""), refusal=refusal)


def fuzz(rank, world, specs: dict) -> dict:
    """Every fuzz case of one world size in one process group; a case that raises is reported, not fatal."""
    import traceback
    from datetime import timedelta
    import torch.distributed as dist
    group = dist.new_group(timeout=timedelta(seconds=60))     # a rank left waiting gives up sooner
    out = {}
    for name, spec in specs.items():
        try:
            out[name] = _fuzz_case(rank, world, spec, group)
        except Exception:
            out[name] = dict(error=traceback.format_exc(limit=4))
    return out


DTYPES = {"float32": torch.float32, "float16": torch.float16}


# ---- bad inputs: every rank must raise the same error -------------------------------------------

BASE = dict(seed=7, E=4, k=2, H=16, I=8, L=2, r=4, lora_ranks=[4, 2], dtype="float32")


def _base(world: int) -> dict:
    """The valid call the bad-input cases change: sizes that split over ``world`` ranks."""
    return BASE if world == 2 else dict(BASE, H=12, I=6, r=3, lora_ranks=[3, 2])


def _bad_call(rank, world, layer: str, change: str, bad_ranks, group):
    """The keyword arguments of one valid call of ``layer``, then ``change`` made on ``bad_ranks``."""
    tokens = [3] * world if layer == "ep" else [4]
    spec = dict(_base(world), tokens=tokens)
    p = _problem(spec)
    weights = _weights(p, torch.float32, poison=False)
    if layer == "ep":
        part = ExpertPartition(spec["E"], world)
        lo, hi = 3 * rank, 3 * rank + 3
        call = dict(x=p["x"][lo:hi], topk_ids=p["topk_ids"][lo:hi], topk_weights=p["topk_weights"][lo:hi],
                    token_lora=p["token_lora"][lo:hi], local=part.shard(weights, rank), partition=part)
    else:
        call = dict(x=p["x"], topk_ids=p["topk_ids"], topk_weights=p["topk_weights"], token_lora=p["token_lora"],
                    local=shard_tp(weights, rank, world, fully_sharded=True), fully_sharded=True)
    call.update(group=group, lora_ranks=p["lora_ranks"])
    if rank in bad_ranks:
        CHANGES[change](call, p, weights, rank, world)
    return call


def _set(**values):
    def change(call, p, weights, rank, world):
        call.update(values)
    return change


def _edit(key, fn):
    def change(call, p, weights, rank, world):
        call[key] = fn(call[key])
    return change


def _cell(t, value):
    t = t.clone()
    t.view(-1)[0] = value
    return t


def _no_lora(call, p, weights, rank, world):
    call["local"] = {key: w for key, w in call["local"].items() if key in ("w13", "w2")}


def _lora_fp16(call, p, weights, rank, world):
    call["local"] = {key: [t.half() for t in w] if key in LORA else w for key, w in call["local"].items()}


def _slice_layout(call, p, weights, rank, world):
    b = list(call["local"]["w13_lora_b"])
    b[1] = b[1].transpose(2, 3).contiguous().transpose(2, 3)
    call["local"] = dict(call["local"], w13_lora_b=b)


def _fewer_tokens(call, p, weights, rank, world):
    for key in ("x", "topk_ids", "topk_weights", "token_lora"):
        call[key] = call[key][:-1]


def _replicated(call, p, weights, rank, world):
    call.update(fully_sharded=False, local=shard_tp(weights, rank, world, fully_sharded=False))


def _counts_of_fewer_pairs(call, p, weights, rank, world):
    from moelora_lab.dist.ep_checks import Counts
    send = [0] * world
    send[0] = call["topk_ids"].numel() - 1
    call["counts"] = Counts([send], [[0] * world])


def _counts_everywhere(call, p, weights, rank, world):
    from moelora_lab.dist.ep_checks import Counts
    owner = call["partition"].owner(call["topk_ids"])
    call["counts"] = Counts([torch.bincount(owner.reshape(-1), minlength=world).tolist()], [[0] * world])


CHANGES = {
    "token_lora_range": _edit("token_lora", lambda t: _cell(t, BASE["L"])),
    "token_lora_shape": _edit("token_lora", lambda t: torch.cat([t, t[:1]])),
    "token_lora_dtype": _edit("token_lora", lambda t: t.float()),
    "topk_weights_shape": _edit("topk_weights", lambda t: t[:, :1]),
    "topk_weights_rows": _edit("topk_weights", lambda t: t[:-1]),
    "topk_weights_missing": _set(topk_weights=None),
    "topk_ids_range": _edit("topk_ids", lambda t: _cell(t, BASE["E"])),
    "topk_ids_negative": _edit("topk_ids", lambda t: _cell(t, -1)),
    "topk_ids_float": _edit("topk_ids", lambda t: t.float()),
    "x_columns": _edit("x", lambda t: torch.cat([t, t[:, :1]], 1)),
    "x_rows": _edit("x", lambda t: t[:-1]),
    "x_fp16": _edit("x", lambda t: t.half()),
    "x_3d": _edit("x", lambda t: t[None]),
    "x_list": _edit("x", lambda t: t.tolist()),
    "lora_ranks_range": _set(lora_ranks=torch.tensor([BASE["r"] + 1, 1], dtype=torch.int32)),
    "lora_ranks_shape": _set(lora_ranks=torch.tensor([1], dtype=torch.int32)),
    "lora_ranks_float": _set(lora_ranks=torch.tensor([1.0, 1.0])),
    "validate_str": _set(validate="no"),
    "validate_off_token_lora_shape": lambda call, *a: (_set(validate=False)(call, *a),
                                                       CHANGES["token_lora_shape"](call, *a)),
    "fully_sharded_str": _set(fully_sharded="yes"),
    "fully_sharded_int": _set(fully_sharded=1),
    "fully_sharded_differs": _replicated,
    "micro_batches_differ": _set(micro_batches=2),
    "micro_batches_zero": _set(micro_batches=0),
    "no_lora_here": _no_lora,
    "lora_fp16": _lora_fp16,
    "slice_layouts_differ": _slice_layout,
    "fewer_tokens": _fewer_tokens,
    "schedule_in_k": _set(schedule="in_k"),
    "lora_path_unknown": _set(lora_path="fastest"),
    "counts_wrong_pairs": _counts_of_fewer_pairs,
    "counts_only_here": _counts_everywhere,
    "local_not_a_dict": _set(local=[1, 2]),
    "full_weights_as_local": lambda call, p, weights, rank, world: call.update(local=weights),
    "x_fp16_or_token_lora": lambda call, *a: CHANGES["x_fp16" if a[2] == 0 else "token_lora_range"](call, *a),
}


def bad_inputs(rank, world, cases: dict) -> dict:
    """Each case calls a layer with one change made on some ranks (``(layer, change, bad_ranks)``) and
    records what this rank raised: ``(type name, message)``, or ``("no error", finite)``. A last valid
    call of each layer shows that the group still works after them."""
    import traceback
    from datetime import timedelta
    import torch.distributed as dist
    group = dist.new_group(timeout=timedelta(seconds=20))     # a rank left waiting gives up sooner
    layers = {"ep": ep_layer, "tp": tp_layer}
    out = {}
    for name, (layer, change, bad_ranks) in cases.items():
        try:
            call = _bad_call(rank, world, layer, change, bad_ranks, group)
            y = layers[layer](**call)
            out[name] = ("no error", bool(torch.isfinite(y).all()))
        except (TypeError, ValueError) as e:
            out[name] = (type(e).__name__, str(e))
        except Exception as e:
            out[name] = (type(e).__name__, traceback.format_exc(limit=3))
    for layer in ("ep", "tp"):
        spec = dict(_base(world), layer=layer, tokens=[3] * world if layer == "ep" else [4], fully_sharded=True)
        try:
            out[f"after_{layer}"] = _fuzz_case(rank, world, spec, group)
        except Exception:
            out[f"after_{layer}"] = dict(error=traceback.format_exc(limit=4))
    return out


def interpreter_state(rank, world) -> tuple:
    """Whether this process runs the kernels on the interpreter, and why."""
    import os
    return moelora_lab.INTERPRET, os.environ.get("MOELORA_INTERPRET")
