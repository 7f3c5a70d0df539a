"""The table of backward paths of the LoRA op: one row per way of computing its gradients, with its launcher
(the kernels in ``kernels/lora_grad.py`` and ``kernels/lora_grad_one_shot.py``).

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, K in, N out, S slices, P = M*k pairs,
B blocks.

Launchers take a validated :class:`GradCall` (``grad.moe_lora_backward`` builds it) and return
:class:`LoRAGrads` in float32 (float64 for float64 inputs), as the spec does. Every path is deterministic
(two runs, the same bits) except ``one_shot_atomic``, which ``auto`` never picks.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import triton

from .._backend import INTERPRET
from ..blocks import BlockList
from ..kernels.lora_grad import grad_rank_kernel, grad_weight_kernel
from ..kernels.lora_grad_one_shot import grad_one_shot_kernel
from ..reference import LoRAGrads, moe_lora_backward_reference
from .dispatch import KernelConfig, choose_config

GRAD_NAMES = ("x", "topk_weights", "lora_a", "lora_b")
_BITS = {"x": 1, "topk_weights": 2, "lora_a": 4, "lora_b": 8}        # the kernels' GRADS mask


class GradCall(NamedTuple):
    """One validated backward call, as every backward launcher receives it."""

    x: torch.Tensor                  # [M, K] token rows or [P, K] pair rows
    topk_ids: torch.Tensor           # [M, k]
    topk_weights: torch.Tensor | None
    token_lora: torch.Tensor         # [M], as given (launch_reference applies ``enabled`` itself)
    lora_a: list                     # S x [L, E, r, K], x's dtype
    lora_b: list                     # S x [L, E, N, r]
    grad_out: torch.Tensor           # [P, S*N] in x's dtype, columns contiguous
    blocks: BlockList | None         # disabled slots' blocks marked unused (Triton paths)
    lora_ranks: torch.Tensor | None  # [L] int
    enabled: torch.Tensor | None     # [L] bool
    mul_routed_weight: bool
    needs: frozenset                 # names of GRAD_NAMES to compute
    config: KernelConfig | None
    dx_rows: torch.Tensor | None = None   # [P, K] float32 (float64) contiguous: x's pair rows are added into it

    @property
    def dims(self):
        M, k = self.topk_ids.shape
        L, E, R, K = self.lora_a[0].shape
        return M, k, L, E, R, K, self.lora_b[0].shape[2], len(self.lora_a)


@dataclass(frozen=True)
class GradPath:
    """A way to compute the backward."""

    name: str
    launcher: str | Callable     # (GradCall) -> LoRAGrads, or "module:function" imported on first use
    summary: str
    kernels: str
    triton: bool
    deterministic: bool = True   # False: atomics, never picked by ``auto``

    @property
    def launch(self) -> Callable[[GradCall], LoRAGrads]:
        if callable(self.launcher):
            return self.launcher
        module, function = self.launcher.split(":")
        return getattr(importlib.import_module(module), function)


def launch_reference(call: GradCall) -> LoRAGrads:
    x = call.x
    if call.dx_rows is not None and x.shape[0] != call.dx_rows.shape[0]:
        x = x.repeat_interleave(call.topk_ids.shape[1], dim=0)       # pair rows: dx per pair, not summed
    grads = moe_lora_backward_reference(x, call.topk_ids, call.topk_weights, call.token_lora, call.lora_a,
                                        call.lora_b, call.grad_out, mul_routed_weight=call.mul_routed_weight,
                                        lora_ranks=call.lora_ranks, enabled=call.enabled)
    if call.dx_rows is not None and "x" in call.needs:
        grads.x = call.dx_rows.add_(grads.x)
    return LoRAGrads(*(getattr(grads, name) if name in call.needs else None for name in GRAD_NAMES))


def group_table(blocks: BlockList, num_experts: int, ranks: torch.Tensor, *, per_block: bool = False):
    """(groups [G, 4] int32 rows (key = l*E + e or -1, rank, first, end), group_blocks [B] int32): the blocks
    of each (adapter, expert) in block-list order, G = L*E; ``per_block``: one row per block (G = B). Tensor
    ops only, no device read."""
    lora, expert = blocks.block_lora.long(), blocks.block_expert.long()
    L, E, B = ranks.numel(), num_experts, lora.numel()
    used = lora >= 0
    key = torch.where(used, lora * E + expert, torch.full_like(lora, L * E))           # [B], L*E: unused
    if per_block:
        b = torch.arange(B, device=key.device)
        rank = torch.where(used, ranks.long()[lora.clamp(min=0)], 0)
        rows = torch.stack([torch.where(used, key, -1), rank, b, b + 1], 1)
        return rows.to(torch.int32).contiguous(), b.to(torch.int32)
    order = torch.sort(key, stable=True).indices                                      # block ids, group by group
    counts = torch.zeros(L * E + 1, dtype=torch.long, device=key.device).scatter_add_(0, key, torch.ones_like(key))
    end = counts[:L * E].cumsum(0)
    rows = torch.stack([torch.arange(L * E, device=key.device), ranks.long().repeat_interleave(E),
                        end - counts[:L * E], end], 1)
    return rows.to(torch.int32).contiguous(), order.to(torch.int32)


def _buffers(call: GradCall, zero_weights: bool):
    """(dx rows [P, K], dw [P], dA [S, L, E, r, K], dB [S, L, E, N, r]) in the accumulation dtype; a
    one-element stand-in for each gradient not asked for. dA, dB: every element is written by the kernels
    (uninitialised) unless ``zero_weights`` (atomics add into them)."""
    M, k, L, E, R, K, N, S = call.dims
    acc = torch.float64 if call.x.dtype == torch.float64 else torch.float32
    new = torch.zeros if zero_weights else torch.empty

    def make(name, shape, alloc):
        return alloc(shape if name in call.needs else (1,), dtype=acc, device=call.x.device)
    dx_rows = call.dx_rows if call.dx_rows is not None and "x" in call.needs else make("x", (M * k, K), torch.zeros)
    return (dx_rows, make("topk_weights", (M * k,), torch.zeros),
            make("lora_a", (S, L, E, R, K), new), make("lora_b", (S, L, E, N, R), new))


def _grads(call: GradCall, dx_rows, dw, da, db) -> LoRAGrads:
    M, k, L, E, R, K, N, S = call.dims
    dx = dx_rows
    if "x" in call.needs and call.x.shape[0] == M and k > 1 and call.dx_rows is None:
        dx = dx_rows.view(M, k, K).sum(1)                  # token rows: a token's k pairs, in a fixed order
    return LoRAGrads(dx if "x" in call.needs else None,
                     dw.view(M, k) if "topk_weights" in call.needs else None,
                     list(da.unbind(0)) if "lora_a" in call.needs else None,
                     list(db.unbind(0)) if "lora_b" in call.needs else None)


def _launch_args(call: GradCall):
    """What every Triton launcher shares: tiles, slice launches, ranks, weights, the GRADS mask."""
    M, k, L, E, R, K, N, S = call.dims
    cfg = call.config
    if cfg is None:
        cfg = choose_config("two_kernel", M * k, min(M * k, L * E), N, S, call.x.device, rank=R)
        if not INTERPRET:      # a first guess, not yet timed: what the sm_90 builds hold without spilling
            cfg = cfg.replace(block_n=64, block_k=64, max_block_r=64, num_warps=8 if call.blocks.block_size >= 64 else 4)
    block_r, _ = cfg.rank_tiling(R)
    ranks = (torch.full((L,), R, dtype=torch.int32, device=call.x.device) if call.lora_ranks is None
             else call.lora_ranks.to(device=call.x.device, dtype=torch.int32).clamp(max=R).contiguous())
    acc = torch.float64 if call.x.dtype == torch.float64 else torch.float32
    weights = call.topk_weights.reshape(-1).to(acc).contiguous() if call.mul_routed_weight else ranks
    grads = sum(_BITS[n] for n in call.needs)
    per_row = k if not (call.x.shape[0] == M * k and k > 1) else 1
    launches = [(s0, min(2, S - s0)) for s0 in range(0, S, 2)]
    return cfg, block_r, ranks, weights, grads, per_row, launches


def launch_two_kernel(call: GradCall) -> LoRAGrads:
    """grad_rank_kernel per block (T, dT to HBM; dx, dw), then grad_weight_kernel per group and tile."""
    M, k, L, E, R, K, N, S = call.dims
    x, a, b, g, blocks = call.x, call.lora_a, call.lora_b, call.grad_out, call.blocks
    cfg, block_r, ranks, weights, grads, per_row, launches = _launch_args(call)
    dx_rows, dw, da, db = _buffers(call, zero_weights=False)
    groups, group_blocks = group_table(blocks, E, ranks)
    tiles = (triton.cdiv(N, cfg.block_n) if grads & 8 else 0) + (triton.cdiv(K, cfg.block_k) if grads & 4 else 0)
    for s0, ns in launches:
        inter = torch.empty((2, ns, M * k, R) if grads & 12 else (1,), dtype=x.dtype, device=x.device)
        a1, b1 = a[min(s0 + 1, S - 1)], b[min(s0 + 1, S - 1)]
        meta = dict(BLOCK_M=blocks.block_size, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_R=block_r,
                    TWO_SLICES=ns == 2, MUL_ROUTED_WEIGHT=call.mul_routed_weight, GRADS=grads,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        grad_rank_kernel[(blocks.num_blocks,)](
            x, a[s0], a1, b[s0], b1, g[:, s0 * N:], weights, inter, dx_rows, dw, *blocks.tensors, ranks,
            M * k, per_row, K, N, R, *x.stride(), *a[0].stride(), *b[0].stride(), g.stride(0), **meta)
        if tiles:
            grad_weight_kernel[(L * E, ns, tiles)](
                x, g[:, s0 * N:], weights, inter, da[s0:] if grads & 4 else da, db[s0:] if grads & 8 else db,
                blocks.sorted_pairs, groups, group_blocks, M * k, per_row, K, N, R, L * E, *x.stride(), g.stride(0),
                **meta)
    return _grads(call, dx_rows, dw, da, db)


def launch_one_shot(call: GradCall, atomic: bool = False) -> LoRAGrads:
    """grad_one_shot_kernel: one program per (adapter, expert) group (``atomic``: per block, dA and dB added
    with atomics); T and dT never leave registers."""
    M, k, L, E, R, K, N, S = call.dims
    x, a, b, g, blocks = call.x, call.lora_a, call.lora_b, call.grad_out, call.blocks
    cfg, block_r, ranks, weights, grads, per_row, launches = _launch_args(call)
    dx_rows, dw, da, db = _buffers(call, zero_weights=atomic)
    groups, group_blocks = group_table(blocks, E, ranks, per_block=atomic)
    for s0, ns in launches:
        a1, b1 = a[min(s0 + 1, S - 1)], b[min(s0 + 1, S - 1)]
        grad_one_shot_kernel[(groups.shape[0],)](
            x, a[s0], a1, b[s0], b1, g[:, s0 * N:], weights, dx_rows, dw, da[s0:] if grads & 4 else da,
            db[s0:] if grads & 8 else db, blocks.sorted_pairs, groups, group_blocks, M * k, per_row, K, N, R, E,
            L * E, *x.stride(), *a[0].stride(), *b[0].stride(), g.stride(0),
            BLOCK_M=blocks.block_size, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_R=block_r, TWO_SLICES=ns == 2,
            MUL_ROUTED_WEIGHT=call.mul_routed_weight, ATOMIC=atomic, GRADS=grads, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
    return _grads(call, dx_rows, dw, da, db)


def launch_one_shot_atomic(call: GradCall) -> LoRAGrads:
    return launch_one_shot(call, atomic=True)


GRAD_PATHS: dict[str, GradPath] = {p.name: p for p in (
    GradPath("reference", launch_reference, "the spec in PyTorch, one matmul per (adapter, expert)",
             "moelora_lab/reference.py", triton=False),
    GradPath("two_kernel", launch_two_kernel, "per block T and dT to HBM with dx and dw, then per group and tile "
             "dA and dB", "moelora_lab/kernels/lora_grad.py", triton=True),
    GradPath("one_shot", launch_one_shot, "per group, T and dT in registers feeding dA, dB, dx and dw",
             "moelora_lab/kernels/lora_grad_one_shot.py", triton=True),
    GradPath("one_shot_atomic", launch_one_shot_atomic, "the one-shot kernel per block, dA and dB added with "
             "atomics (not bit-reproducible)", "moelora_lab/kernels/lora_grad_one_shot.py", triton=True,
             deterministic=False),
)}
GRAD_PATH_CHOICES = tuple(GRAD_PATHS) + ("auto",)
