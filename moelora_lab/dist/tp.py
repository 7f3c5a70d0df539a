"""Tensor parallelism: every rank holds a slice of every expert; the LoRA is sharded with it.

Shape legend: M tokens (every rank has all of them), E experts, k top-k, L adapters, r rank,
H hidden, I expert intermediate, W ranks, P = M*k pairs, I_w = I/W, r_w = r/W, H_w = H/W.

Per rank (weights from :func:`partition.shard_tp`):

    c1 [P, 2 I_w] = W13_w x              h [P, I_w] = silu(c1g + d13g) * (c1u + d13u)
    c3 [P, H]     = w * W2_w h  (a partial sum over ranks)      y = all_reduce(sum_j c3 + d2)

The LoRA, ``fully_sharded=False``: d13 = B13_w (A13 x) is one call of any path, the one-shot
kernel included (A13 is whole on every rank); d2 = w * B2 (A2_w h) is a partial sum like c3 and
rides in the same all-reduce. ``fully_sharded=True``: A13 holds only r_w of the r rows, so
T13 = A13_w x [2, P, r_w] is **all-gathered along r** before the expand, and A2 holds only I_w
of the I inputs, so T2 = A2_w h [P, r] is **all-reduced** before the expand, which writes its
H_w columns of d2 into c3. The rank intermediate crosses GPUs between shrink and expand: no kernel
can keep it in registers, and the two-kernel path (``paths.launch_shrink`` then
``paths.launch_expand``) is the only one that fits.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from .._backend import on_device
from ..op.dispatch import choose_config
from ..layer import plan_layer
from ..layer.table import AUTO_CPU
from ..base_moe import gemm_tiles, moe_gemm, silu_and_mul, topk_sum
from ..op.face import run_lora
from ..op.paths import KERNEL_CHOICES, get_path, launch_expand, launch_shrink
from ..layer.fp8 import refuse_distributed
from ..layer.grad import no_backward
from ..layer.streams import traced
from ..validate import (ANY_SLOT, FLOAT_DTYPES, LayerDims, check_bool, check_layer_base, check_lora_ranks,
                        check_routing, check_same_device, check_tensor, check_values, routing_ranges,
                        wants_grad)
from .agree import (Same, _all_gather, agree, check_kernels_run, dtype_code, dtype_name, layer_device,
                    run_checks)
from .partition import LORA_KEYS, local_ranks


def _slices(key: str, ws, count: int, x: torch.Tensor) -> list:
    """``local[key]``: ``count`` 4-D tensors in x's dtype, on x's device, all with one memory layout
    (the kernels read every slice with slice 0's strides)."""
    name = f"local[{key!r}]"
    if isinstance(ws, torch.Tensor) or not isinstance(ws, Sequence) or len(ws) != count:
        raise TypeError(f"{name}: expected a list of {count} tensor(s), one per slice, as shard_tp makes it; got "
                        f"{type(ws).__name__}" + (f" of {len(ws)}" if isinstance(ws, Sequence) else ""))
    for s, w in enumerate(ws):
        check_tensor(f"{name}[{s}]", w, ndim=4, dtypes=FLOAT_DTYPES, device=x.device)
        if w.dtype != x.dtype:
            raise TypeError(f"{name}[{s}]: dtype {w.dtype} differs from x's {x.dtype}; the LoRA weights must "
                            "share the layer's dtype (cast them once, when they are loaded)")
        if w.stride() != ws[0].stride():
            raise ValueError(f"{name}: the slices have different memory layouts (strides {ws[0].stride()} and "
                             f"{w.stride()}); the kernels read every slice with slice 0's strides: make them alike")
    return list(ws)


def _lora_dims(local: dict, fully_sharded: bool, world: int, x: torch.Tensor, E: int, H: int, I_w: int):
    """(L, r) of the full adapters, from a rank's shards (a ValueError or TypeError if a shard does not fit)."""
    L, r = _slices("w13_lora_b", local["w13_lora_b"], 2, x)[0].shape[::3]
    if fully_sharded and (r % world or H % world):
        raise ValueError(f"local['w13_lora_b']: a fully sharded LoRA over {world} ranks needs r={r} and H={H} to "
                         f"divide by {world}; pick another world size or fully_sharded=False")
    want = {"w13_lora_a": (2, (L, E, r // world if fully_sharded else r, H)), "w13_lora_b": (2, (L, E, I_w, r)),
            "w2_lora_a": (1, (L, E, r, I_w)), "w2_lora_b": (1, (L, E, H // world if fully_sharded else H, r))}
    for key, (count, shape) in want.items():
        for s, w in enumerate(_slices(key, local[key], count, x)):
            if tuple(w.shape) != shape:
                raise ValueError(f"local[{key!r}][{s}]: shape {tuple(w.shape)} where this rank expects {shape} "
                                 f"for fully_sharded={fully_sharded} over {world} ranks; make the shards with "
                                 f"shard_tp(weights, rank, {world}, fully_sharded={fully_sharded})")
    return L, r


def check_inputs(x, topk_ids, topk_weights, token_lora, local, *, fully_sharded: bool, world: int, lora_ranks,
                 lora_path: str, validate: bool) -> LayerDims:
    """One rank's inputs of :func:`tp_layer`, all of them (the ids' ranges with ``validate``); returns
    the dims of its share (I = I_w, this rank's intermediate columns)."""
    refuse_distributed("tp_layer", local)
    check_bool("fully_sharded", fully_sharded)
    check_bool("validate", validate)
    get_path(lora_path, "lora_path", KERNEL_CHOICES)
    if not isinstance(local, Mapping) or "w13" not in local or "w2" not in local:
        raise TypeError("local: expected this rank's shard_tp(weights, rank, W, fully_sharded=...): a dict with "
                        f"'w13', 'w2' and optionally {', '.join(map(repr, LORA_KEYS))}; got {type(local).__name__}")
    w13 = check_tensor("local['w13']", local["w13"], ndim=3, dtypes=FLOAT_DTYPES, legend="[E, 2 I_w, H]")
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, legend="[M, H]")
    if x.dtype != w13.dtype:
        raise TypeError(f"x: dtype {x.dtype} differs from the local weights' {w13.dtype}; cast x to {w13.dtype} "
                        "(or the weights, once, when they are loaded)")
    E, H, I_w = check_layer_base(x, topk_ids, w13, local["w2"], same_dtype=True)
    if topk_weights is None:
        raise ValueError("topk_weights: required by the layer (the routing weights scale each expert's output)")
    given = [local.get(key) is not None for key in LORA_KEYS]
    if any(given) and not all(given):
        raise ValueError(f"local: give all four of {', '.join(LORA_KEYS)} or none")
    L, r = _lora_dims(local, fully_sharded, world, x, E, H, I_w) if all(given) else (None, None)
    M, k = check_routing(topk_ids, token_lora, E, L or ANY_SLOT, topk_weights, values=False)
    check_same_device(x=x, topk_ids=topk_ids)
    check_kernels_run(x)
    ranges = routing_ranges(topk_ids, token_lora, E, L or ANY_SLOT)
    if L is not None:
        ranges += check_lora_ranks(lora_ranks, L, r)
    if validate:
        check_values(ranges)
    return LayerDims(M, k, E, H, I_w, L, r)


def _must_match(dims: LayerDims | None, x, fully_sharded) -> list:
    """What every rank must pass alike (the same fields on every rank; values of a failed check unused)."""
    ok = dims is not None
    L = dims.L if ok and dims.L is not None else -1
    return [Same("x", "the number of tokens M (every rank passes all the tokens)", dims.M if ok else 0),
            Same("topk_ids", "top-k (columns)", dims.k if ok else 0),
            Same("x", "the hidden size H (x's columns)", dims.H if ok else 0),
            Same("x", "the dtype", dtype_code(x.dtype) if ok else 0, dtype_name),
            Same("local", "the number of experts", dims.E if ok else 0),
            Same("local", "the number of adapter slots L (-1: no LoRA)", L),
            Same("local", "the LoRA rank r (-1: no LoRA)", dims.r if L >= 0 else -1),
            Same("fully_sharded", "the flag", int(fully_sharded) if ok else 0, lambda v: str(bool(v)))]


def tp_layer(x, topk_ids, topk_weights, token_lora, local: dict, *, fully_sharded: bool, group=None,
             lora_ranks=None, lora_path: str = "auto", validate: bool = True, tracer=None) -> torch.Tensor:
    """The MoE layer with LoRA under tensor parallelism: y [M, H], the same on every rank.

    Collective: every rank of ``group`` calls it with the same tokens; the layer runs one stream.

    Parameters
    ----------
    x, topk_ids, topk_weights, token_lora : torch.Tensor
        The same tokens and routing on every rank, as for :func:`moelora_lab.moe_lora_layer`.
    local : dict
        This rank's ``shard_tp(weights, rank, W, fully_sharded=...)``.
    fully_sharded : bool
        True: the LoRA is sharded too and the two-kernel path runs (the rank intermediate must travel);
        False: A replicated, and ``lora_path`` applies.
    group : torch.distributed.ProcessGroup, optional
        Default: the world group.
    lora_ranks, lora_path
        As for :func:`moelora_lab.moe_lora_layer`.
    validate : bool
        False skips the id ranges only, for ids you have checked.
    tracer : profile.timeline.Tracer, optional
        Records every stage, collectives on lane "comm".

    Returns
    -------
    torch.Tensor
        y [M, H], the same on every rank.

    Notes
    -----
    Every rank checks all of its inputs before the first collective: x [M, H] in the local weights'
    dtype and device, the routing [M, k] and [M], the shards, ``lora_ranks``, ``lora_path``, the
    flags and (``validate=True``, one device read) the ids' ranges and ``lora_ranks`` in [0, r]. The
    ranks then agree (one all-gather of a few integers, :func:`agree.agree`): if any rank's inputs are
    wrong, or the ranks disagree on M, k, H, E, the dtype, the adapters or ``fully_sharded``, every
    rank raises the same ValueError or TypeError, naming the argument and the rank that holds it.

    Examples
    --------
    Each rank holds a slice of the expert intermediate I (here 32 over 2 ranks):

    >>> import moelora_lab as ml
    >>> from moelora_lab.dist import shard_tp
    >>> p = ml.make_problem("tiny", ml.LoRAShape(num_loras=2, rank=4), num_tokens=8, seed=0)
    >>> weights = {k: v for k, v in p.layer_inputs().items() if k.startswith(("w13", "w2"))}
    >>> local = shard_tp(weights, 0, 2, fully_sharded=True)
    >>> tuple(local["w13"].shape), tuple(local["w2"].shape)       # [E, 2 I_w, H], [E, H, I_w]
    ((8, 32, 64), (8, 64, 16))

    Every rank then calls ``tp_layer(x, topk_ids, topk_weights, token_lora, local, fully_sharded=True)``;
    ``moelora_lab.dist.checks.tp_case`` does so in two gloo processes on the CPU (several seconds):

    >>> from moelora_lab.dist import run_local
    >>> from moelora_lab.dist.checks import default_case, tp_case
    >>> out = run_local(tp_case, 2, default_case(fully_sharded=True))     # doctest: +SKIP
    >>> [o["ranks_agree"] for o in out]                                   # doctest: +SKIP
    [True, True]
    """
    if wants_grad(x, topk_weights, local):          # no backward: inference runs, a backward says so
        with torch.no_grad():
            y = tp_layer(x, topk_ids, topk_weights, token_lora, local, fully_sharded=fully_sharded, group=group,
                         lora_ranks=lora_ranks, lora_path=lora_path, validate=validate, tracer=tracer)
        return no_backward("tp_layer: has no backward (its collectives and base kernels are not recorded for "
                           "autograd); train with moelora_lab.moe_lora_layer, or call tp_layer under torch.no_grad()",
                           y, x, topk_weights, local)
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    dims, error = run_checks(check_inputs, x, topk_ids, topk_weights, token_lora, local, fully_sharded=fully_sharded,
                             world=world, lora_ranks=lora_ranks, lora_path=lora_path, validate=validate)
    agree(group, error, _must_match(dims, x, fully_sharded), layer_device(x))
    M, k, E, H, I_w, L, r = dims
    if M == 0:                                # every rank has the same M: all skip the collectives
        return x.new_empty(0, H)
    w13, w2 = local["w13"], local["w2"]
    with_lora = L is not None
    P = M * k
    path = "two_kernel" if fully_sharded else lora_path
    with on_device(x):
        # What the kernels read without strides is made contiguous here, once: the adapter ids (the joins,
        # and the block lists on a GPU) and the per-slot ranks. x, the base and LoRA weights, the
        # intermediates and the outputs go to the kernels with their strides; the routing weights are
        # flattened (a copy where needed) into ``weights``, and topk_ids is read through reshape(-1).
        token_lora = token_lora.to(torch.int32).contiguous()
        # planned as for one stream (the op's path rule): the shard's kernels run on the current stream
        plan = plan_layer(topk_ids, token_lora, E, L, r, intermediate=I_w, lora_path=path,
                          schedule=AUTO_CPU, validate=False, lora_ranks=lora_ranks)
        ranks = None if lora_ranks is None else lora_ranks.to(device=x.device, dtype=torch.int32).contiguous()
        weights = topk_weights.reshape(-1).float().contiguous()
        tiles = gemm_tiles(P, E)
        c1 = x.new_empty(P, 2 * I_w)
        h = x.new_empty(P, I_w)
        c3 = x.new_empty(P, H)
        y = x.new_empty(M, H)
        d13 = d2 = None
        with traced(tracer, "base_w13"):
            moe_gemm(x, w13, plan.base_blocks, c1, top_k=k, tiles=tiles)
        if with_lora and r > 0:
            d13 = x.new_empty(P, 2 * I_w)
            _lora_w13(x, topk_ids, topk_weights, token_lora, local, plan, d13, ranks, fully_sharded, group,
                      tracer)
        with traced(tracer, "act"):
            silu_and_mul(c1, h, top_k=k, delta=d13, token_lora=token_lora)
        with traced(tracer, "base_w2"):
            moe_gemm(h, w2, plan.base_blocks, c3, top_k=k, topk_weights=weights, tiles=tiles)
        if with_lora and r > 0:
            d2 = _lora_w2(h, topk_ids, topk_weights, token_lora, local, plan, c3, weights, ranks, fully_sharded,
                          group, tracer)
        with traced(tracer, "sum"):
            topk_sum(c3, y, top_k=k, delta=d2, token_lora=token_lora)
        with traced(tracer, "all_reduce_y", "comm"):
            dist.all_reduce(y, group=group)
    return y


def _config(plan, P, N, S, device, R):
    L, E = plan.num_loras, plan.routing.num_experts
    cfg = choose_config("two_kernel", P, min(P, L * E), N, S, device, rank=R)
    return cfg.replace(block_m=plan.lora_blocks.block_size)


def _lora_w13(x, topk_ids, topk_weights, token_lora, local, plan, d13, ranks, fully_sharded, group, tracer):
    """d13 [P, 2 I_w] for the pairs with an adapter: one op, or shrink, all-gather along r, expand."""
    a13, b13 = local["w13_lora_a"], local["w13_lora_b"]
    M, k = topk_ids.shape
    if not fully_sharded:
        with traced(tracer, "lora_w13"):
            run_lora(x, topk_ids, topk_weights, token_lora, a13, b13, d13.view(M, k, -1), plan.lora_blocks,
                     plan.lora_path, mul_routed_weight=False, add_inputs=False, lora_ranks=ranks)
        return
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    P, r_w, r = M * k, a13[0].shape[2], b13[0].shape[3]
    cfg = _config(plan, P, b13[0].shape[2], 2, x.device, r)
    mine = x.new_empty(2, P, r_w)
    with traced(tracer, "shrink_w13"):
        launch_shrink(x, a13, mine, plan.lora_blocks, cfg, top_k=k, token_rows=True,
                      lora_ranks=local_ranks(ranks, rank, world, r))
    with traced(tracer, "all_gather_T13", "comm"):
        parts = x.new_empty(world * 2, P, r_w)          # ranks stacked along dim 0
        _all_gather(parts, mine, group=group)
        t = parts.view(world, 2, P, r_w).permute(1, 2, 0, 3).reshape(2, P, r)    # rank w: rows r_w w .. r_w (w+1)
    with traced(tracer, "expand_w13"):
        launch_expand(t, b13, d13, d13, plan.lora_blocks, cfg, mul_routed_weight=False, add_inputs=False,
                      lora_ranks=ranks)


def _lora_w2(h, topk_ids, topk_weights, token_lora, local, plan, c3, weights, ranks, fully_sharded, group, tracer):
    """The w2 delta: returned as a partial [P, H] for the sum (replicated B), or written into this
    rank's H_w columns of c3 after the shrink's all-reduce (fully sharded; returns None)."""
    a2, b2 = local["w2_lora_a"], local["w2_lora_b"]
    M, k = topk_ids.shape
    P, H = c3.shape
    if not fully_sharded:
        d2 = torch.empty_like(c3)
        with traced(tracer, "lora_w2"):
            run_lora(h, topk_ids, topk_weights, token_lora, a2, b2, d2.view(M, k, H), plan.lora_blocks,
                     plan.lora_path, mul_routed_weight=True, add_inputs=False, lora_ranks=ranks)
        return d2
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    r, H_w = a2[0].shape[2], b2[0].shape[2]
    cfg = _config(plan, P, H_w, 1, h.device, r)
    t = h.new_empty(1, P, r)
    with traced(tracer, "shrink_w2"):
        launch_shrink(h, a2, t, plan.lora_blocks, cfg, top_k=k, token_rows=False, lora_ranks=ranks)
    with traced(tracer, "all_reduce_T2", "comm"):
        dist.all_reduce(t, group=group)       # rows of pairs without an adapter hold garbage: never read
    with traced(tracer, "expand_w2"):
        launch_expand(t, b2, c3[:, rank * H_w:(rank + 1) * H_w], weights, plan.lora_blocks, cfg,
                      mul_routed_weight=True, add_inputs=True, lora_ranks=ranks)
    return None
