"""The layer with w2's LoRA in K: the w2 GEMM runs over [h | T2] and [w2 | B2], no w2 delta, no w2 join.

Shape legend: M tokens, k top-k, E experts, L adapters, r rank, H hidden, I expert intermediate,
P = M*k pairs.

``pack_w2_in_k`` stores, once per set of adapters, w2_ext [E, H, I + L*r] = [w2 | B2 of slot 0 | ... |
B2 of slot L-1]. The layer then runs w13 as the two-stream layer does (base GEMM on the main stream,
w13's LoRA on the side stream, joined before the activation); the activation writes h into the first
I columns of h_ext [P, I + L*r]; the w2 shrink writes each pair's T2 = A2 h into its adapter's r
columns of the rest and zeros into every other column (one launch, ``kernels/in_k.py``); and the w2
GEMM is the plain grouped GEMM over h_ext and w2_ext, which adds T2 B2^T to each pair's output
inside its pipelined K loop.

What it trades: w2's LoRA delta [P, H] is never written or read back and no LoRA kernel runs beside
the w2 GEMM; in exchange the GEMM's K grows by L*r (every pair multiplies through every slot's
columns, zeros but its own) and the shrink runs between the activation and the GEMM, on the
critical path. ``python -m moelora_lab.bench in_k`` measures where that pays.
"""
from __future__ import annotations

import torch
import triton

from ._backend import INTERPRET, on_device
from .blocks import LayerPlan
from .dispatch import choose_config
from .kernels.in_k import shrink_tail_kernel
from .layer import IN_GEMM, plan_layer
from .moe import gemm_tiles, moe_gemm, silu_and_mul, topk_sum
from .ops import run_lora
from .paths import _precision
from .streams import Streams
from .validate import check_layer_inputs, check_lora_ranks, check_plan, check_values, routing_ranges

FILL_ROWS = 32        # pairs per zero-filling program of the shrink launch


def pack_w2_in_k(w2: torch.Tensor, w2_lora_b) -> torch.Tensor:
    """w2_ext [E, H, I + L*r], contiguous: w2 [E, H, I] followed by B2 [L, E, H, r] of every slot
    (column I + l*r + j is rank j of slot l; scaling folded into B as everywhere). Pack again when an
    adapter slot changes."""
    if not isinstance(w2, torch.Tensor) or w2.dim() != 3:
        raise TypeError(f"w2: expected a tensor [E, H, I], got {getattr(w2, 'shape', type(w2).__name__)}")
    if not isinstance(w2_lora_b, (list, tuple)) or len(w2_lora_b) != 1 or not isinstance(w2_lora_b[0], torch.Tensor):
        raise TypeError("w2_lora_b: expected a list of one tensor [L, E, H, r] (w2 has one slice)")
    b = w2_lora_b[0]
    E, H, _ = w2.shape
    if b.dim() != 4 or tuple(b.shape[1:3]) != (E, H):
        raise ValueError(f"w2_lora_b[0]: expected [L, {E}, {H}, r] for w2 of shape {tuple(w2.shape)}, got {tuple(b.shape)}")
    if b.dtype != w2.dtype or b.device != w2.device:
        raise TypeError(f"w2_lora_b[0]: expected {w2.dtype} on {w2.device} like w2, got {b.dtype} on {b.device}")
    L, r = b.shape[0], b.shape[3]
    return torch.cat([w2, b.permute(1, 2, 0, 3).reshape(E, H, L * r)], dim=2).contiguous()


def _split(w2_ext, w13, w2_lora_a):
    """w2 and B2 as views of w2_ext, checked against I (from w13) and L, r (from w2_lora_a)."""
    if not isinstance(w2_ext, torch.Tensor) or w2_ext.dim() != 3 or not isinstance(w13, torch.Tensor) or w13.dim() != 3:
        raise TypeError("w13, w2_ext: expected tensors [E, 2I, H] and [E, H, I + L*r] (w2_ext from pack_w2_in_k)")
    if not isinstance(w2_lora_a, (list, tuple)) or len(w2_lora_a) != 1 or getattr(w2_lora_a[0], "dim", lambda: 0)() != 4:
        raise TypeError("w2_lora_a: expected a list of one tensor [L, E, r, I]")
    E, H, width = w2_ext.shape
    I = w13.shape[1] // 2
    L, r = w2_lora_a[0].shape[0], w2_lora_a[0].shape[2]
    if width != I + L * r or not w2_ext.is_contiguous():
        raise ValueError(f"w2_ext: expected a contiguous [E, H, I + L*r] = [{E}, {H}, {I + L * r}] (I = {I} from w13, "
                         f"L = {L}, r = {r} from w2_lora_a), got {tuple(w2_ext.shape)}; build it with "
                         "pack_w2_in_k(w2, w2_lora_b)")
    return w2_ext[:, :, :I], [w2_ext[:, :, I:].view(E, H, L, r).permute(2, 0, 1, 3)]


def w2_in_k_layer(x, topk_ids, topk_weights, token_lora, w13, w2_ext, w13_lora_a, w13_lora_b, w2_lora_a, *,
                  plan: LayerPlan | None = None, dual: bool | None = None, lora_ranks: torch.Tensor | None = None,
                  validate: bool = True, tracer=None) -> torch.Tensor:
    """y [M, H] of the MoE layer with LoRA, as :func:`moelora_lab.moe_lora_layer` computes it, with w2's
    LoRA in the w2 GEMM's K (``w2_ext`` from :func:`pack_w2_in_k`). ``plan``: from ``plan_layer(...,
    schedule="sequential")`` on these routing tensors (built here if None). ``dual``: w13's LoRA on a
    side stream (default: on a CUDA GPU; never on the CPU). Other arguments as for the layer."""
    w2, w2_lora_b = _split(w2_ext, w13, w2_lora_a)
    M, k, E, H, I, L, r = check_layer_inputs(x, topk_ids, topk_weights, token_lora, w13, w2, w13_lora_a, w13_lora_b,
                                             w2_lora_a, w2_lora_b)
    ranges = check_lora_ranks(lora_ranks, L, r)
    checked = check_plan(plan, topk_ids, token_lora, E, L, r) if plan is not None else False
    if plan is not None and plan.lora_path in IN_GEMM.values():
        raise ValueError(f"plan: made for an in-GEMM schedule ({plan.lora_path!r}); pass plan_layer(..., "
                         "schedule='sequential')")
    if validate:
        check_values(ranges + ([] if checked else routing_ranges(topk_ids, token_lora, E, L)))
    if x.device.type != "cuda" and not INTERPRET:
        raise ValueError(f"x: the layer's Triton kernels need CUDA tensors (got {x.device}); set "
                         "MOELORA_INTERPRET=1 before importing moelora_lab to run them on the CPU")
    gpu = x.device.type == "cuda" and not INTERPRET
    if dual and not gpu:
        raise ValueError("dual: True needs CUDA streams; leave it None (or False) on the CPU")
    if M == 0:
        return x.new_empty(0, H)
    P, width = M * k, I + L * r
    with on_device(x):
        if plan is None:
            plan = plan_layer(topk_ids, token_lora, E, L, r, hidden=H, intermediate=I, schedule="sequential",
                              validate=False, lora_ranks=lora_ranks)
        if lora_ranks is not None:
            lora_ranks = lora_ranks.to(device=x.device, dtype=torch.int32).contiguous()
        token_lora32 = token_lora.to(torch.int32).contiguous()
        weights = topk_weights.reshape(-1).float().contiguous()
        streams = Streams(gpu if dual is None else dual, x.device, tracer)
        tiles = gemm_tiles(P, E)
        c1 = x.new_empty(P, 2 * I)
        h_ext = x.new_empty(P, width)
        c3, y = x.new_empty(P, H), x.new_empty(M, H)
        d13 = x.new_empty(M, k, 2 * I)
        fork = streams.fork()
        with streams.stage("base_w13", "main"):
            moe_gemm(x, w13, plan.base_blocks, c1, top_k=k, tiles=tiles)
        with streams.side("lora_w13", fork):
            run_lora(x, topk_ids, topk_weights, token_lora, w13_lora_a, w13_lora_b, d13, plan.lora_blocks,
                     plan.lora_path, mul_routed_weight=False, add_inputs=False, lora_ranks=lora_ranks)
        streams.join()
        with streams.stage("act", "main"):
            silu_and_mul(c1, h_ext[:, :I], top_k=k, delta=d13.view(P, 2 * I), token_lora=token_lora32)
        with streams.stage("shrink_w2", "main"):
            _shrink_tail(h_ext, w2_lora_a[0], plan, token_lora32, k, H, I, r, lora_ranks)
        with streams.stage("w2+lora", "main"):
            moe_gemm(h_ext, w2_ext, plan.base_blocks, c3, top_k=k, topk_weights=weights, tiles=tiles)
        with streams.stage("sum", "main"):
            topk_sum(c3, y, top_k=k)
    return y


def _shrink_tail(h_ext, a2, plan, token_lora, top_k: int, H: int, I: int, r: int, lora_ranks) -> None:
    """h_ext's whole tail in one launch: T2 of every pair with an adapter in its slot's columns, zeros
    in every other column."""
    blocks = plan.lora_blocks
    L, E = a2.shape[0], a2.shape[1]
    P = h_ext.shape[0]
    cfg = choose_config("two_kernel", P, min(P, L * E), H, 1, h_ext.device, rank=r)     # the w2 op's shrink tiles
    block_r, rank_tiles = cfg.rank_tiling(r)
    fill = triton.cdiv(P, FILL_ROWS)
    shrink_tail_kernel[(blocks.num_blocks + fill, rank_tiles)](
        h_ext, a2, h_ext[:, I:], *blocks.tensors, token_lora, blocks.block_lora if lora_ranks is None else lora_ranks,
        P, blocks.num_blocks, top_k, I, r, L * r, h_ext.stride(0), *a2.stride(), h_ext.stride(0),
        BLOCK_M=blocks.block_size, BLOCK_K=cfg.block_k, BLOCK_R=block_r, BLOCK_LR=triton.next_power_of_2(L * r),
        FILL_ROWS=FILL_ROWS, DOT_PRECISION=_precision(h_ext), HAS_RANKS=lora_ranks is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
