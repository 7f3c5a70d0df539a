"""The MoE layer with LoRA, differentiable: an autograd Function around the product layer.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, H hidden, I expert intermediate,
P = M*k pairs; pair p = t*k + j routes token t to expert e = e_p with weight w_p.

The forward is the product layer (``moe_lora_layer`` with the caller's schedule) run without autograd;
it keeps no activation. The backward, given dy [M, H], recomputes the w13 half and runs the chain rule:

    c1 = W13[e] x_t + LoRA13 x_t        [P, 2I]  one grouped GEMM and the op's LoRA kernels (recomputed)
    h  = silu(g) * u                    [P, I]   g | u = c1
    dh_raw = W2[e]^T dy_t               [P, I]   grouped GEMM over W2 viewed transposed
    dh = w_p dh_raw + LoRA2-backward dx          dw_p = dh_raw · h + LoRA2-backward dw
    dg = dh * u * silu'(g),  du = dh * silu(g)   written over c1: dc1 [P, 2I]
    dx_t = sum_j W13[e]^T dc1_p + LoRA13-backward dx

LoRA2's backward takes dy with the routing weights (``mul_routed_weight=True``): its dx is already
w_p-scaled and its factor gradients carry w_p. The LoRA factors' gradients come from the op's backward.
The base weights are frozen: a backward that would need their gradient raises a ValueError that says so
(their gradient is a grouped GEMM with the pairs in K, which the lab's GEMM does not run). The forward runs
whatever requires grad, so inference with weights that are parameters needs no ``torch.no_grad()``; the
experiment schedules, which have no backward, run too and refuse only a backward.

Memory. Saved between forward and backward: references to the inputs (no copies; autograd's version
counters refuse a backward after an in-place change) and the plan's routing metadata, (B * BM + 2B) int32
per block list, B = floor(P / BM) + min(E, P) blocks for the base list (about 4 (P + BM E) bytes) and as
many with L*E for the LoRA list: no [P, *] activation. Transient in the backward, with s = x's element
size: c1 [P, 2I] in x's dtype (the only [P, 2I] buffer: it becomes dc1); at most five [P, I] float32
buffers at once (sigmoid(g), silu(g), dh, and h with LoRA2's dx, or dg with 1 + g (1 - s)), seven where x
is 16-bit (g and u as float32 copies; h is then copied to x's dtype for the op); then dx's pair rows
[P, H] float32, once those are freed. The op's backward adds its own: dy's pair rows [P, H] in x's dtype
(it reads grad_out as [M, k, H] rows, dy is [M, H]) and its rank intermediates; its dx pair rows are added
into the layer's own (``dx_rows``: dh for LoRA2, W13^T dc1's pair rows for LoRA13), so it allocates none. Peak about P (2I s + 6I * 4 + H s) bytes in the [P, I] phase (float32: P (14I + 4H)).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from ..base_moe import moe_gemm, topk_sum
from ..blocks import LayerPlan
from ..op.face import run_lora
from ..op.grad import moe_lora_backward as lora_backward
from ..reference import moe_lora_reference
from ..validate import FLOAT_DTYPES, tensors_in
from .plan import plan_layer, resolve_schedule
from .table import AUTO, AUTO_CPU, get_schedule, schedule_names


@dataclass(frozen=True)
class LayerSetup:
    """What the Function needs besides the tensors: ``forward(x, topk_ids, topk_weights, token_lora, w13, w2,
    w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b, plan=, lora_ranks=, **options) -> y`` (the product layer),
    the plan its backward reads (base blocks, tiles, LoRA blocks and path), the options and the number of
    tensors in each LoRA list (``()``: no LoRA)."""

    forward: Callable
    plan: LayerPlan | None
    options: dict
    slices: tuple


class MoELoRALayerFunction(torch.autograd.Function):
    """y = layer(x, ...) with gradients to x, topk_weights and every LoRA factor (see the module docstring).

    ``apply(setup, x, topk_ids, topk_weights, token_lora, w13, w2, lora_ranks, *lora)``: ``lora`` the four
    LoRA lists flattened (w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b), ``lora_ranks`` [L] or None."""

    @staticmethod
    def forward(ctx, setup: LayerSetup, x, topk_ids, topk_weights, token_lora, w13, w2, lora_ranks, *lora):
        ctx.setup = setup
        ctx.save_for_backward(x, topk_ids, topk_weights, token_lora, w13, w2, lora_ranks, *lora)
        lists = _unflatten(lora, setup.slices)
        return setup.forward(x, topk_ids, topk_weights, token_lora, w13, w2, *lists, plan=setup.plan,
                             lora_ranks=lora_ranks, **setup.options)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, topk_ids, topk_weights, token_lora, w13, w2, lora_ranks, *lora = ctx.saved_tensors
        needs, slices = ctx.needs_input_grad, ctx.setup.slices
        for name, need in (("w13", needs[5]), ("w2", needs[6])):
            if need:
                raise ValueError(f"{name}: requires grad, but the layer's base weights are frozen (its backward gives "
                                 f"gradients to x, topk_weights and the LoRA factors only); call "
                                 f"{name}.requires_grad_(False) once, or pass {name}.detach()")
        need_lora = [any(on) for on in _unflatten(needs[8:], slices)] if lora else [False] * 4
        dx, dtw, dlora = layer_backward(x, topk_ids, topk_weights, token_lora, w13, w2,
                                        _unflatten(lora, slices) if lora else None, lora_ranks, ctx.setup.plan, dy,
                                        need_x=needs[1], need_weights=needs[3], need_lora=tuple(need_lora))
        return (None, dx, None, dtw, None, None, None, None, *dlora)


def no_backward(message: str, y: torch.Tensor, *inputs) -> torch.Tensor:
    """y (computed without autograd) tied to those of ``inputs`` that require grad (tensors, lists of them,
    dicts of either): a forward that serves inference as it is, and a backward through it that raises a
    ValueError with ``message`` instead of giving silently partial gradients."""
    leaves = [t for t in tensors_in(inputs) if t.requires_grad]
    return _NoBackward.apply(message, y, *leaves) if leaves else y



class _NoBackward(torch.autograd.Function):
    """y as it is, tied to the inputs that require grad: the forward serves (inference need not turn autograd
    off), a backward through it raises ``message``."""

    @staticmethod
    def forward(ctx, message: str, y, *leaves):
        ctx.message = message
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        raise ValueError(ctx.message)


def layer_with_grad(forward, x, topk_ids, topk_weights, token_lora, w13, w2, w13_lora_a=None, w13_lora_b=None,
                    w2_lora_a=None, w2_lora_b=None, *, schedule: str = AUTO, plan: LayerPlan | None = None,
                    lora_ranks: torch.Tensor | None = None, in_k=None, **options) -> torch.Tensor:
    """y [M, H] = ``forward(...)`` (``moelora_lab.moe_lora_layer``, which calls this when an input requires
    grad), differentiable in x, topk_weights and the LoRA factors. Inputs as the layer takes them, already
    checked by it; ``options`` go to ``forward`` as they are. ``plan`` is built here when None (for
    ``schedule``) and shared by the forward and the backward."""
    lists = (w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b)
    if schedule != AUTO and get_schedule(schedule).status == "experiment":    # runs; its backward refuses
        trained = ", ".join(repr(n) for n in (AUTO, *schedule_names("product", "baseline")))
        with torch.no_grad():
            y = forward(x, topk_ids, topk_weights, token_lora, w13, w2, *lists, schedule=schedule, plan=plan,
                        lora_ranks=lora_ranks, in_k=in_k, **options)
        return no_backward(f"schedule={schedule!r}: an experiment without a backward; to train, use one of "
                           f"{trained}", y, x, topk_weights, w13, w2, lists)
    with_lora = w13_lora_a is not None
    if plan is None and topk_ids.shape[0] and x.dtype in FLOAT_DTYPES:     # float64 (the spec) reads no plan
        plan = _plan(x, topk_ids, token_lora, w13, w13_lora_a, schedule, lora_ranks, in_k, options)
    slices = tuple(len(t) for t in lists) if with_lora else ()
    setup = LayerSetup(forward, plan, dict(options, schedule=schedule, in_k=in_k), slices)
    flat = [t for ts in lists if ts is not None for t in ts]
    return MoELoRALayerFunction.apply(setup, x, topk_ids, topk_weights, token_lora, w13, w2, lora_ranks, *flat)


def _plan(x, topk_ids, token_lora, w13, lora_a, schedule: str, lora_ranks, in_k, options) -> LayerPlan:
    """The plan the layer would make for this call: for the schedule it resolves to (on the CPU a two-stream
    row runs one stream, and the layer's own call says so)."""
    E, I = w13.shape[0], w13.shape[1] // 2
    L, r = (lora_a[0].shape[0], lora_a[0].shape[2]) if lora_a is not None else (None, None)
    lora_path = options.get("lora_path", AUTO)
    run = AUTO_CPU                                    # the plain layer, as the layer runs it
    if r:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            run = resolve_schedule(schedule, x.device, num_pairs=topk_ids.numel(), num_experts=E, num_loras=L,
                                   rank=r, in_k_columns=L * r if in_k is not None else None,
                                   join=options.get("join", "fold"), lora_path=lora_path)
    return plan_layer(topk_ids, token_lora, E, L, r, intermediate=I, lora_path=lora_path, schedule=run,
                      validate=False, lora_ranks=lora_ranks)


def layer_backward(x, topk_ids, topk_weights, token_lora, w13, w2, lora, lora_ranks, plan, dy, *,
                   need_x: bool = True, need_weights: bool = True, need_lora: tuple = (True,) * 4):
    """(dx [M, H], dtopk_weights [M, k], [gradient of each LoRA factor, flattened]) given dy [M, H]; each in its
    input's dtype, None where not needed (``need_lora``: per LoRA list). ``lora``: the four lists or None;
    ``plan``: the forward's."""
    M, k = topk_ids.shape
    E, I2, H = w13.shape
    I, P = I2 // 2, M * k
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    lists = lora or [[]] * 4
    wanted = need_lora
    active = lora is not None and lora[0][0].shape[2] > 0 and M > 0
    if not active:                                    # no LoRA, rank 0 or no pair: the factors get zeros
        need_lora = (False,) * 4
    need_dc1 = need_x or need_lora[0] or need_lora[1]
    dx = dw = grads13 = grads2 = None
    if M:
        gemm = _Grouped(plan, topk_ids, k, x.dtype in FLOAT_DTYPES)
        ranks = None if lora_ranks is None else lora_ranks.to(device=x.device, dtype=torch.int32).contiguous()
        op = dict(lora_ranks=ranks, blocks=_op_blocks(plan), validate=False)
        a13, b13, a2, b2 = lists
        w = topk_weights.reshape(P, 1).to(acc)
        c1 = torch.empty(P, I2, dtype=x.dtype, device=x.device)                 # recomputed c1, then dc1
        gemm(x, w13, c1)
        if active:
            _add_lora(x, topk_ids, topk_weights, token_lora, a13, b13, c1.view(M, k, I2), ranks, plan, gemm.kernels)
        g, u = c1[:, :I].to(acc), c1[:, I:].to(acc)                               # views where x is float32
        sig = torch.sigmoid(g)
        silu = g * sig
        h = silu * u                                                              # [P, I]
        dh = torch.empty(P, I, dtype=acc, device=x.device)
        gemm(dy, w2, dh, transposed=True)                                         # dh_raw = W2^T dy_t
        dw = torch.linalg.vecdot(dh, h) if need_weights else None                 # [P]
        if need_dc1:
            dh.mul_(w)                                                            # dh = w_p dh_raw
        needs2 = _needs(need_dc1, need_weights, need_lora[2], need_lora[3])
        if active and needs2:                             # LoRA2's dx (already w-scaled) is added into dh's rows
            grads2 = lora_backward(h.to(x.dtype), topk_ids, topk_weights, token_lora, a2, b2,
                                   dy.unsqueeze(1).expand(M, k, H), mul_routed_weight=True, needs=needs2,
                                   dx_rows=dh if need_dc1 else None, **op)
        if dw is not None and grads2 is not None:
            dw += grads2.topk_weights.reshape(P).to(acc)
        del h
        if need_dc1:
            _act_backward(dh, g, u, sig, silu, c1)
            del g, u, sig, silu, dh
            pairs = None
            if need_x:
                pairs = torch.empty(P, H, dtype=acc, device=x.device)
                gemm(c1, w13, pairs, transposed=True)                             # W13^T dc1_p
            needs13 = _needs(need_x, False, need_lora[0], need_lora[1])
            if active and needs13:                        # LoRA13's dx pair rows are added into the base's
                grads13 = lora_backward(x, topk_ids, topk_weights, token_lora, a13, b13, c1.view(M, k, I2),
                                        mul_routed_weight=False, needs=needs13, dx_rows=pairs, **op)
            if need_x:
                dx = gemm.sum_slots(pairs, M)
    if need_x:
        dx = torch.zeros_like(x) if dx is None else dx.to(x.dtype)
    dtw = None
    if need_weights:
        dtw = torch.zeros_like(topk_weights) if dw is None else dw.view(M, k).to(topk_weights.dtype)
    found = [getattr(grads, n) if grads else None for grads in (grads13, grads2) for n in ("lora_a", "lora_b")]
    dlora = [None if not on else torch.zeros_like(t) if got is None else got[s].to(t.dtype)
             for ts, on, got in zip(lists, wanted, found) for s, t in enumerate(ts)]
    return dx, dtw, dlora


def _act_backward(dh, g, u, sig, silu, out) -> None:
    """dc1 = [dh * u * silu'(g) | dh * silu(g)] into out [P, 2I] (c1's buffer: g and u are read first), with
    silu'(g) = s (1 + g (1 - s)), s = sigmoid(g); ``sig`` and ``silu`` are overwritten."""
    I = g.shape[1]
    dg = dh * u
    sig.mul_(torch.sub(1, sig).mul_(g).add_(1))
    dg.mul_(sig)
    out[:, :I].copy_(dg)
    out[:, I:].copy_(silu.mul_(dh))


def _needs(x: bool, topk_weights: bool, lora_a: bool, lora_b: bool) -> list:
    """The names the op's backward computes (the others come back None)."""
    return [n for n, on in (("x", x), ("topk_weights", topk_weights), ("lora_a", lora_a), ("lora_b", lora_b)) if on]


def _op_blocks(plan):
    """The plan's LoRA blocks where the op's backward takes them (a power of two >= 16 pairs per block)."""
    blocks = None if plan is None else plan.lora_blocks
    size = blocks.block_size if blocks is not None else 0
    return blocks if size >= 16 and size & (size - 1) == 0 else None


class _Grouped:
    """The backward's grouped GEMMs: out[p] = W[e_p] @ row(p) (``transposed``: W[e_p]^T @ row(p)), rows of
    [M, K] token rows or [P, K] pair rows. The lab's grouped GEMM over the plan's base blocks (W^T as a
    strided view, its tiles by pointer); in float64, which the kernels do not take (the gradient checks),
    one torch matmul per expert."""

    def __init__(self, plan, topk_ids, k: int, kernels: bool):
        self.plan, self.k, self.kernels = plan, k, kernels
        self.experts = topk_ids.reshape(-1).long()

    def __call__(self, rows, w, out, *, transposed: bool = False):
        if self.kernels:
            tiles = dict(self.plan.tiles, W_TMA=False) if transposed else self.plan.tiles
            return moe_gemm(rows, w.transpose(1, 2) if transposed else w, self.plan.base_blocks, out,
                            top_k=self.k, tiles=tiles)
        src = rows if rows.shape[0] == out.shape[0] else rows.repeat_interleave(self.k, dim=0)
        for e in torch.unique(self.experts).tolist():
            sel = self.experts == e
            out[sel] = src[sel].to(out.dtype) @ (w[e] if transposed else w[e].T).to(out.dtype)
        return out

    def sum_slots(self, pairs, M: int):
        """[M, H]: the sum of each token's k pair rows."""
        if self.kernels:
            return topk_sum(pairs, torch.empty(M, pairs.shape[1], dtype=pairs.dtype, device=pairs.device),
                            top_k=self.k)
        return pairs.view(M, self.k, -1).sum(dim=1)


def _add_lora(x, topk_ids, topk_weights, token_lora, lora_a, lora_b, out, ranks, plan, kernels: bool):
    """out [M, k, S*N] += the LoRA delta of pairs with an adapter: the op's kernels on the plan's LoRA blocks,
    or (float64) the spec on weights cut to each slot's rank."""
    if kernels:
        run_lora(x, topk_ids, topk_weights, token_lora, lora_a, lora_b, out, plan.lora_blocks, plan.lora_path,
                 mul_routed_weight=False, add_inputs=True, lora_ranks=ranks)
        return
    if ranks is not None:
        keep = torch.arange(lora_a[0].shape[2], device=x.device) < ranks[:, None]           # [L, r]
        lora_a = [torch.where(keep[:, None, :, None], a, torch.zeros_like(a)) for a in lora_a]
        lora_b = [torch.where(keep[:, None, None, :], b, torch.zeros_like(b)) for b in lora_b]
    out += moe_lora_reference(x, topk_ids, topk_weights, token_lora, lora_a, lora_b).to(out.dtype)


def _unflatten(flat, slices: tuple) -> list:
    """The four LoRA lists from their tensors in order (``slices``: how many each holds; () gives Nones)."""
    if not slices:
        return [None] * 4
    out, at = [], 0
    for n in slices:
        out.append(list(flat[at:at + n]))
        at += n
    return out
