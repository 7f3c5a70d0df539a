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

import torch
import torch.distributed as dist

from .._backend import on_device
from ..dispatch import choose_config
from ..layer import plan_layer
from ..moe import gemm_tiles, moe_gemm, silu_and_mul, topk_sum
from ..ops import run_lora
from ..paths import launch_expand, launch_shrink
from ..streams import traced
from ..validate import ANY_SLOT, check_routing, check_values, routing_ranges
from .partition import local_ranks


# torch >= 2.13 renames all_gather_into_tensor (and warns on the old name)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _lora_dims(local: dict, fully_sharded: bool, world: int):
    """(L, r) of the full adapters, from a rank's shards (a ValueError if the shards disagree)."""
    a13, b13, a2, b2 = (local[key] for key in ("w13_lora_a", "w13_lora_b", "w2_lora_a", "w2_lora_b"))
    L, r = b13[0].shape[0], b13[0].shape[3]
    I_w, H = local["w2"].shape[2], local["w2"].shape[1]
    want = {"w13_lora_a": (L, r // world if fully_sharded else r, H), "w13_lora_b": (L, I_w, r),
            "w2_lora_a": (L, r, I_w), "w2_lora_b": (L, H // world if fully_sharded else H, r)}
    got = {"w13_lora_a": (a13[0].shape[0], a13[0].shape[2], a13[0].shape[3]),
           "w13_lora_b": (L, b13[0].shape[2], r),
           "w2_lora_a": (a2[0].shape[0], a2[0].shape[2], a2[0].shape[3]),
           "w2_lora_b": (b2[0].shape[0], b2[0].shape[2], b2[0].shape[3])}
    for key in want:
        if want[key] != got[key]:
            raise ValueError(f"local[{key!r}]: (L, rows, cols) {got[key]} where this rank expects {want[key]} for "
                             f"fully_sharded={fully_sharded} over {world} ranks; make the shards with "
                             f"shard_tp(weights, rank, {world}, fully_sharded={fully_sharded})")
    return L, r


def tp_layer(x, topk_ids, topk_weights, token_lora, local: dict, *, fully_sharded: bool, group=None,
             lora_ranks=None, lora_path: str = "auto", validate: bool = True, tracer=None) -> torch.Tensor:
    """The MoE layer with LoRA under tensor parallelism: y [M, H], the same on every rank.

    Every rank passes the same tokens and routing (as :func:`moelora_lab.moe_lora_layer`) and its
    own ``local = shard_tp(weights, rank, W, fully_sharded=...)``; the layer runs one stream.
    ``fully_sharded=True`` forces the two-kernel LoRA path (the intermediate must travel);
    ``lora_path`` applies otherwise. ``validate=False`` skips the id-range checks (a host
    synchronisation). ``tracer`` records every stage, collectives on lane "comm".
    """
    group = group if group is not None else dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    w13, w2 = local["w13"], local["w2"]
    E, H, I_w = w2.shape
    with_lora = local.get("w13_lora_a") is not None
    L, r = _lora_dims(local, fully_sharded, world) if with_lora else (None, None)
    M, k = check_routing(topk_ids, token_lora, E, L or ANY_SLOT, topk_weights, values=False)
    if validate:
        check_values(routing_ranges(topk_ids, token_lora, E, L or ANY_SLOT))
    P = M * k
    path = "two_kernel" if fully_sharded else lora_path
    with on_device(x):
        plan = plan_layer(topk_ids, token_lora, E, L, r, hidden=H, intermediate=I_w, lora_path=path,
                          schedule="sequential", validate=False, lora_ranks=lora_ranks)
        ranks = None if lora_ranks is None else lora_ranks.to(device=x.device, dtype=torch.int32)
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
