"""Two variants of the LoRA in K that were measured and lost to the ``in_k`` schedule.

Shape legend: M tokens, k top-k, E experts, L adapters, r rank, H hidden, I expert intermediate,
P = M*k pairs, S slices.

- ``w2_in_k_layer``: only w2's LoRA in K; w13 as the two-stream layer runs it (base GEMM on the main
  stream, w13's LoRA on the side stream, joined before the activation), then the activation and w2's
  shrink into h_ext [P, I + L*r] and the plain grouped GEMM over h_ext and w2_ext.
- ``in_k_overlap_layer``: the ``in_k`` schedule with each shrink and its GEMM as one launch, the GEMM
  tiles waiting for the shrink only before their tail K steps (``gemm_after_shrink`` launches
  ``kernels/in_k_overlap``).

Both are timed by ``python -m moelora_lab.bench in_k`` (data/h200/layer_in_k.csv and its README row).
"""
from __future__ import annotations

import torch
import triton

from .._backend import INTERPRET, on_device
from ..blocks import LayerPlan
from ..layer.in_k import W13_ONE_READ, _prepare, act_and_shrink, in_k_call, w2_and_sum
from ..layer.in_k_launch import shrink_parts
from ..layer.in_k_pack import _w2_split
from ..layer.streams import Streams
from ..base_moe import gemm_tiles, launch_tiles, moe_gemm, silu_and_mul, tail_start, topk_sum
from ..op.face import run_lora
from .kernels.in_k_overlap import gemm_after_shrink_kernel


def w2_in_k_layer(x, topk_ids, topk_weights, token_lora, w13, w2_ext, w13_lora_a, w13_lora_b, w2_lora_a, *,
                  plan: LayerPlan | None = None, dual: bool | None = None, lora_ranks: torch.Tensor | None = None,
                  validate: bool = True, tracer=None) -> torch.Tensor:
    """y [M, H] of the MoE layer with LoRA, as :func:`moelora_lab.moe_lora_layer` computes it, with w2's
    LoRA in the w2 GEMM's K (``w2_ext`` from :func:`pack_w2_in_k`). ``plan``: from ``plan_layer(...,
    schedule="sequential")`` on these routing tensors (built here if None). ``dual``: w13's LoRA on a
    side stream (default: on a CUDA GPU; never on the CPU). Other arguments as for the layer."""
    w2, w2_lora_b = _w2_split(w2_ext, w13, w2_lora_a)
    weights = (w13, w2, w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b)
    (M, k, E, H, I, L, r), plan, lora_ranks = _prepare(x, topk_ids, topk_weights, token_lora, weights, plan,
                                                       lora_ranks, validate)
    gpu = x.device.type == "cuda" and not INTERPRET
    if dual and not gpu:
        raise ValueError("dual: True needs CUDA streams; leave it None (or False) on the CPU")
    if M == 0:
        return x.new_empty(0, H)
    P = M * k
    with on_device(x):
        token_lora32 = token_lora.to(torch.int32).contiguous()
        streams = Streams(gpu if dual is None else dual, x.device, tracer)
        c1 = x.new_empty(P, 2 * I)
        h_ext = x.new_empty(P, I + L * r)
        d13 = x.new_empty(M, k, 2 * I)
        fork = streams.fork()
        with streams.stage("base_w13", "main"):
            moe_gemm(x, w13, plan.base_blocks, c1, top_k=k, tiles=plan.tiles)
        with streams.side("lora_w13", fork):
            run_lora(x, topk_ids, topk_weights, token_lora, w13_lora_a, w13_lora_b, d13, plan.lora_blocks,
                     plan.lora_path, mul_routed_weight=False, add_inputs=False, lora_ranks=lora_ranks)
        streams.join()
        act_and_shrink(c1, d13.view(P, 2 * I), h_ext, w2_lora_a[0], plan, token_lora32, streams, k, H, I, r,
                        lora_ranks)
        return w2_and_sum(h_ext, w2_ext, plan, token_lora32, topk_weights.reshape(-1).float().contiguous(), streams, M,
                          k, H)


def in_k_overlap_layer(x, topk_ids, topk_weights, token_lora, w13_ext, w2_ext, w13_lora_a, w2_lora_a, *,
                       plan: LayerPlan | None = None, lora_ranks: torch.Tensor | None = None, validate: bool = True,
                       tracer=None) -> torch.Tensor:
    """:func:`moelora_lab.layer.in_k.in_k_layer` with each shrink and its GEMM as one launch (same arguments)."""
    call = in_k_call(x, topk_ids, topk_weights, token_lora, w13_ext, w2_ext, w13_lora_a, w2_lora_a, plan=plan,
                     lora_ranks=lora_ranks, validate=validate, tracer=tracer)
    M, k, E, H, I, L, r = call.dims
    if M == 0:
        return x.new_empty(0, H)
    P = M * k
    with on_device(x):
        x = x.contiguous()
        streams = Streams(False, x.device, tracer)
        t13 = x.new_empty(2, P, L * r)
        c1, h_ext = x.new_empty(P, 2 * I), x.new_empty(P, I + L * r)
        return _overlapped(x, call.plan, call.token_lora32, call.weights, w13_lora_a, w2_lora_a[0], w13_ext, w2_ext,
                           t13, c1, h_ext, streams, call.lora_ranks, M, k, H, I, r)


def _overlapped(x, plan, token_lora32, weights, a13, a2, w13_ext, w2_ext, t13, c1, h_ext, streams, lora_ranks,
                M: int, k: int, H: int, I: int, r: int):
    """``in_k_overlap_layer`` from its buffers on: each shrink in one launch with its GEMM."""
    P = M * k
    with streams.stage("w13+lora", "main"):
        gemm_after_shrink(x, a13, plan, token_lora32, k, t13, I, r, lora_ranks, x, w13_ext, c1, x_cols=H,
                          tail_at=tail_start(H), token_rows=True, one_read=W13_ONE_READ)
    with streams.stage("act", "main"):
        silu_and_mul(c1, h_ext[:, :I], top_k=k)
    c3, y = x.new_empty(P, H), x.new_empty(M, H)
    with streams.stage("w2+lora", "main"):
        gemm_after_shrink(h_ext, [a2], plan, token_lora32, k, h_ext[:, I:].unsqueeze(0), H, r, lora_ranks, h_ext,
                          w2_ext, c3, x_cols=I, tail_at=I, topk_weights=weights)
    with streams.stage("sum", "main"):
        topk_sum(c3, y, top_k=k)
    return y


def gemm_after_shrink(src, lora_a, plan, token_lora, top_k: int, tail, n_out: int, r: int, lora_ranks, x, w_ext,
                      out, *, x_cols: int, tail_at: int, topk_weights=None, token_rows: bool = False,
                      one_read: bool = False, counters: torch.Tensor | None = None,
                      max_spins: int | None = None) -> torch.Tensor:
    """``layer.in_k_launch.shrink_tail`` and then ``moe_gemm(x, w_ext, plan.base_blocks, out, x_tail=tail)``
    as one launch (``kernels/in_k_overlap``): the GEMM tiles wait for the shrink only before their tail K
    steps. ``x`` [M or P, >= x_cols] with unit column stride; ``tail`` [S, P, C] (a view of x's buffer
    or its own, unit column stride, element-aligned with x); w_ext [E, N, tail_at + C] with x's
    weights in columns [0, x_cols) (zeros up to tail_at) and the tail's from tail_at. Tiles: the
    GEMM's rule (``gemm_tiles``; its warps and stages for the whole launch) and the shrink's.
    ``counters``: int32 [2] zeros on x's device (made here if None); after the launch they hold the
    tickets drawn and the shrink programs done. ``max_spins``: the kernel's MAX_SPINS (its default if None)."""
    s_grid, s_args, s_meta, _ = shrink_parts(src, lora_a, plan, token_lora, top_k, tail, n_out, r, lora_ranks,
                                             token_rows=token_rows, one_read=one_read)
    E, N, K = w_ext.shape
    S, P, C = tail.shape
    offset = tail.data_ptr() - x.data_ptr()
    if K != tail_at + C or x.stride(-1) != 1 or tail.stride(2) != 1 or offset % x.element_size():
        raise ValueError(f"w_ext, tail: expected w_ext [E, N, tail_at + C] = [.., .., {tail_at + C}] and unit column "
                         f"strides, element-aligned with x; got w_ext {tuple(w_ext.shape)}")
    tiles, warps, stages, w_tma, w_desc = launch_tiles(gemm_tiles(P, E), w_ext)
    blocks = plan.base_blocks
    if tiles["BLOCK_M"] != blocks.block_size:
        raise ValueError(f"plan: base blocks of {blocks.block_size} pairs, but the GEMM's tiles take "
                         f"{tiles['BLOCK_M']}; build the plan with plan_layer for this routing")
    n_slice = N // S
    n_gemm = blocks.num_blocks * S * triton.cdiv(n_slice, tiles["BLOCK_N"])
    n_shrink = s_grid[0] * s_grid[1]
    if counters is None:
        counters = torch.zeros(2, dtype=torch.int32, device=x.device)
    elif counters.dtype != torch.int32 or counters.shape != (2,) or counters.device != x.device:
        raise ValueError(f"counters: expected int32 [2] zeros on {x.device}, got {counters.dtype} "
                         f"{tuple(counters.shape)} on {counters.device}")
    mul = topk_weights is not None
    s_meta = {("S_" + k if k in ("BLOCK_M", "BLOCK_K", "TOKEN_ROWS") else k): v for k, v in s_meta.items()}
    gemm_after_shrink_kernel[(n_shrink + n_gemm,)](
        counters, n_shrink, s_grid[1], *s_args,
        x, w_ext, w_desc, out,
        topk_weights if mul else out, blocks.sorted_pairs, blocks.block_expert,
        P, top_k, N, blocks.num_blocks, n_slice, x_cols, tail_at, C, offset // x.element_size(),
        x.stride(0), w_ext.stride(0), w_ext.stride(1), out.stride(0), tail.stride(0), tail.stride(1),
        **s_meta, **tiles, TOKEN_ROWS=x.shape[0] != P or top_k == 1, MUL_ROUTED_WEIGHT=mul, W_TMA=w_tma,
        num_warps=warps, num_stages=stages, **({} if max_spins is None else dict(MAX_SPINS=max_spins)))
    return out
