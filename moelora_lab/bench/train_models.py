"""What ``python -m moelora_lab.bench train`` runs: one case's tensors, the variants' training steps, the
gradients they must give, and the floor model of one forward + backward.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, H hidden, I expert intermediate, P = M*k pairs.

Every variant starts from the same routing (``topk_ids``, ``topk_weights`` of the benchmarks' seeded routing):
the router (its linear, softmax and top-k) is outside every step; each step builds its own routing metadata
(the lab's plan, a sort by expert) from that routing, as a model's MoE layer does in each call. A step is one
forward and one backward (``torch.autograd.grad``, so no ``.grad`` accumulates) and returns its gradients.
The base weights are frozen everywhere; the transformers block holds the lab's very w13 / w2 tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .. import moe_layer_reference, moe_lora_layer
from ..adapters import load_peft
from ..config import MoEShape, layer_lora_weights
from ..layer import resolve_schedule
from ..profile.traffic import Traffic, Workload
from ..train.peft_grads import (LORA_KEYS, PARAMS, adapter_states, grads_in_peft_layout, lora_factors, moe_block,
                                peft_adapters)
from .common import base_weights, device, sweep_routing

VARIANTS = ("lab_lora", "lab_base", "grouped_mm_base", "hf_peft", "hf_base")
WITH_LORA = ("lab_lora", "hf_peft")
BASE_OF = {"lab_lora": "lab_base", "hf_peft": "hf_base"}     # each LoRA variant's own base, for the LoRA's share
SLICES = (2, 2, 1, 1)                                       # tensors per list of LORA_KEYS


@dataclass
class Base:
    """One preset's frozen base: w13 [E, 2I, H], w2 [E, H, I]; ``block`` a transformers Qwen3-MoE sparse block
    holding them (None where transformers is missing); ``hf`` what the HF variants run, or why they cannot."""
    shape: MoEShape
    w13: torch.Tensor
    w2: torch.Tensor
    block: object
    hf: str


@dataclass
class Adapters:
    """L adapters of rank r: ``lora`` the lab's leaves (LORA_KEYS -> lists, B N-fastest, requiring grad);
    ``model`` a PeftModel holding the same adapters a0..a{L-1} on a copy of the block (or None); ``peft`` what
    the hf_peft variant runs, or why it cannot."""
    rank: int
    lora: dict
    model: object
    peft: str


@dataclass
class Case:
    """One (preset, M, r) case: x and the upstream gradient dy [M, H], the routing (topk_ids [M, k] int32,
    topk_weights [M, k] float32, token_lora [M] int32)."""
    base: Base
    adapters: Adapters
    x: torch.Tensor
    dy: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    token_lora: torch.Tensor


@dataclass
class Variant:
    """``step()`` one forward + backward -> its gradients; ``want(ref)`` the same gradients from the reference
    (``reference_grads``); ``impl`` what ran; ``grads`` what it differentiates."""
    step: Callable
    want: Callable
    impl: str
    grads: str


def build_base(shape: MoEShape, dtype: torch.dtype, seed: int, gen: torch.Generator) -> Base:
    """The base weights inside a transformers block (``peft_grads.moe_block``), its experts on ``grouped_mm``
    where this transformers registers it (else its eager loop); without transformers, ``base_weights``."""
    try:
        block = moe_block(shape, seed=seed, device=device()).to(dtype)
    except ImportError as exc:
        w13, w2 = base_weights(shape, gen, dtype)
        return Base(shape, w13, w2, None, f"ImportError: {exc}")
    import transformers
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        choice = "grouped_mm" if "grouped_mm" in ALL_EXPERTS_FUNCTIONS else "eager"
    except ImportError:
        choice = "eager"
    config = block.experts.config
    config._experts_implementation = choice
    ran = getattr(config, "_experts_implementation", None) or "eager"
    return Base(shape, block.experts.gate_up_proj.detach(), block.experts.down_proj.detach(), block,
                f"transformers {transformers.__version__} experts={ran}")


def build_adapters(base: Base, num_loras: int, rank: int, seed: int, gen: torch.Generator,
                   dtype: torch.dtype) -> Adapters:
    """PEFT adapters (``peft_adapters``: lora_alpha = 2r, so s = 2, B ~ N(0, 1/r)) on a copy of the block and
    the same adapters in the lab's layout (``load_peft``); without transformers or peft, random lab weights."""
    model, why = None, base.hf
    if base.block is not None:
        try:
            model = peft_adapters(base.block, [dict(r=rank, lora_alpha=2 * rank)] * num_loras, seed=seed,
                                  b_std=rank ** -0.5)
        except ImportError as exc:
            why = f"ImportError: {exc}"
    if model is None:
        weights = layer_lora_weights(base.shape, num_loras, rank, gen, dtype)
        return Adapters(rank, _leaves(weights), None, why)
    import peft
    (_, weights), = load_peft(adapter_states(model), num_experts=base.shape.num_experts, pack=True, dtype=dtype,
                              device=device()).items()
    factor = lora_factors(model, "a0")[PARAMS[0]][0]
    return Adapters(rank, _leaves(weights), model,
                    f"{base.hf}, peft {peft.__version__} (adapters {str(factor.dtype).removeprefix('torch.')})")


def _leaves(weights: dict) -> dict:
    return {key: [w.detach().requires_grad_(True) for w in weights[key]] for key in LORA_KEYS}


def build_case(base: Base, adapters: Adapters, num_tokens: int, num_loras: int, seed: int, gen, dtype,
               assign: str = "uniform") -> Case:
    """The routing of ``common.sweep_routing`` (sequences given adapters as ``assign`` says) and x, dy ~ N(0, 1)
    drawn on the device."""
    ids, tw, tl = sweep_routing(base.shape, num_loras, num_tokens, seed, assign)
    x = torch.randn(num_tokens, base.shape.hidden, device=device(), generator=gen, dtype=dtype)
    dy = torch.randn(num_tokens, base.shape.hidden, device=device(), generator=gen, dtype=dtype)
    return Case(base, adapters, x, dy, ids, tw, tl)


def _flat(lora: dict) -> list:
    return [t for key in LORA_KEYS for t in lora[key]]


def reference_grads(case: Case, with_lora: bool) -> list:
    """[dx, then the gradient of every LoRA factor in LORA_KEYS order (with_lora)] of sum(y * dy) through
    ``moe_layer_reference`` (float32 arithmetic, per-expert matmuls); without LoRA every token_lora is -1."""
    x = case.x.detach().requires_grad_(True)
    lora = [case.adapters.lora[key] for key in LORA_KEYS]
    tl = case.token_lora if with_lora else torch.full_like(case.token_lora, -1)
    y = moe_layer_reference(x, case.topk_ids, case.topk_weights, tl, case.base.w13, case.base.w2, *lora)
    inputs = [x, *_flat(case.adapters.lora)] if with_lora else [x]
    return list(torch.autograd.grad(y, inputs, case.dy.to(y.dtype)))


def _unflat(flat: list) -> dict:
    out, at = {}, 0
    for key, n in zip(LORA_KEYS, SLICES):
        out[key], at = flat[at:at + n], at + n
    return out


def lab_variant(case: Case, with_lora: bool) -> Variant:
    """``moe_lora_layer`` with gradients to x (and every LoRA factor), its plan built inside the step."""
    x = case.x.detach().requires_grad_(True)
    lists = [case.adapters.lora[key] for key in LORA_KEYS] if with_lora else []
    inputs = [x, *_flat(case.adapters.lora)] if with_lora else [x]
    c = case

    def step():
        y = moe_lora_layer(x, c.topk_ids, c.topk_weights, c.token_lora, c.base.w13, c.base.w2, *lists,
                           validate=False)
        return list(torch.autograd.grad(y, inputs, c.dy))

    M, k = c.topk_ids.shape
    impl = "moe_lora_layer (no LoRA)"
    if with_lora:
        L, r = c.adapters.lora["w13_lora_a"][0].shape[0], c.adapters.rank
        impl = "moe_lora_layer schedule=" + resolve_schedule("auto", x.device, num_pairs=M * k, num_loras=L, rank=r,
                                                              num_experts=c.base.shape.num_experts)
    return Variant(step, lambda ref: ref["lora" if with_lora else "base"], impl, "x+lora" if with_lora else "x")


def grouped_mm_layer(x, topk_ids, topk_weights, w13, w2):
    """The base MoE layer on torch._grouped_mm, differentiable in x: pairs sorted by expert, offsets from the
    sort, y [M, H] = sum over k of w * W2[e] (silu(g) * u), g | u = W13[e] x. Raises where it is missing."""
    if not hasattr(torch, "_grouped_mm"):
        raise RuntimeError(f"torch._grouped_mm is missing in torch {torch.__version__}; it needs torch >= 2.8")
    M, k = topk_ids.shape
    E, I = w13.shape[0], w13.shape[1] // 2
    sorted_experts, order = torch.sort(topk_ids.reshape(-1), stable=True)                         # [P]
    offs = torch.searchsorted(sorted_experts, torch.arange(E, device=x.device, dtype=sorted_experts.dtype),
                              right=True).to(torch.int32)                                          # [E] ends
    c1 = torch._grouped_mm(x[order // k], w13.transpose(1, 2), offs=offs)                         # [P, 2I]
    h = F.silu(c1[:, :I]) * c1[:, I:]                                                              # [P, I]
    c3 = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)                                       # [P, H]
    c3 = c3 * topk_weights.reshape(-1)[order, None].to(c3.dtype)
    unsort = torch.empty_like(order)
    unsort[order] = torch.arange(order.numel(), device=x.device)
    return c3[unsort].view(M, k, -1).sum(dim=1)


def grouped_mm_variant(case: Case) -> Variant:
    x = case.x.detach().requires_grad_(True)
    c = case

    def step():
        y = grouped_mm_layer(x, c.topk_ids, c.topk_weights, c.base.w13, c.base.w2)
        return list(torch.autograd.grad(y, [x], c.dy))

    return Variant(step, lambda ref: ref["base"], "torch._grouped_mm", "x")


def hf_base_variant(case: Case) -> Variant:
    """The block's experts (router excluded) on the case's routing, weights in x's dtype as HF's router gives."""
    if case.base.block is None:
        raise RuntimeError(f"hf_base needs transformers: {case.base.hf}")
    x = case.x.detach().requires_grad_(True)
    experts, ids, tw, dy = case.base.block.experts, case.topk_ids.long(), case.topk_weights.to(x.dtype), case.dy

    def step():
        return list(torch.autograd.grad(experts(x, ids, tw), [x], dy))

    return Variant(step, lambda ref: ref["base"], case.base.hf, "x")


def hf_peft_variant(case: Case) -> Variant:
    """PEFT's experts (router excluded), gradients to x and the active adapter's factors. PEFT runs one adapter
    per call: with L adapters, one call per adapter on its own tokens (rows gathered before the step)."""
    model = case.adapters.model
    if model is None:
        raise RuntimeError(f"hf_peft needs transformers and peft: {case.adapters.peft}")
    experts, names = model.get_base_model().experts, list(model.peft_config)
    segments = []
    for l, name in enumerate(names):
        rows = (case.token_lora == l).nonzero().squeeze(1)
        if rows.numel():
            x = case.x[rows].detach().requires_grad_(True)
            factors = lora_factors(model, name)
            params = [t for p in PARAMS for t in factors[p][:2]]
            segments.append((l, name, rows, x, case.topk_ids[rows].long(), case.topk_weights[rows].to(x.dtype),
                             case.dy[rows], params, {p: factors[p][2] for p in PARAMS}))

    def step():
        out = []
        for _, name, _, x, ids, tw, dy, params, _ in segments:
            if len(names) > 1:
                model.set_adapter(name)
            out += torch.autograd.grad(experts(x, ids, tw), [x, *params], dy)
        return out

    def want(ref):
        dx, lab = ref["lora"][0], _unflat(ref["lora"][1:])
        out = []
        for l, _, rows, *_, scales in segments:
            peft_layout = grads_in_peft_layout(lab, l, scales)
            out += [dx[rows], *(t for p in PARAMS for t in peft_layout[p])]
        return out

    return Variant(step, want, case.adapters.peft, "x+lora")


def build_variant(name: str, case: Case) -> Variant:
    if name in ("lab_lora", "lab_base"):
        return lab_variant(case, name == "lab_lora")
    builders = {"grouped_mm_base": grouped_mm_variant, "hf_base": hf_base_variant, "hf_peft": hf_peft_variant}
    return builders[name](case)


def train_floor(shape, rank: int, workload: Workload, *, dtype_bytes: int = 2, with_lora: bool = True) -> Traffic:
    """Lower bounds of one forward + backward of the layer, gradients to x and (with_lora) every LoRA factor,
    base frozen. Each bound holds on its own: the byte floor saves nothing between the passes (recomputing costs
    no bytes), the FLOP floor recomputes nothing (saving costs no FLOPs); matmul FLOPs only (the activation,
    routing weights and top-k sum add O(P (I + H)), under 1% at these shapes).

    With P = M*k, P_a the pairs with an adapter, T_e touched experts, T touched (adapter, expert), b bytes per
    element, W = T_e*3*I*H*b the base weights read and A = T*3r(H + I)*b the LoRA factors (w13: 2 slices of
    A [r, H] and B [I, r]; w2: A [r, I], B [H, r]):
      bytes  forward  read x M*H*b, W, A; write y M*H*b
             backward read dy M*H*b, x M*H*b, W, A; write dx M*H*b and the factors' gradients A
      FLOPs  base     forward 2P(2I*H + H*I) = 6P*I*H; backward the same 6P*I*H (dh = W2^T dy, dx = W13^T dc1;
                      no weight gradient)
             LoRA     forward 2P_a*S*r(K + N) per op = 6P_a*r(H + I); backward twice that, 12P_a*r(H + I)
                      (dB = dout^T t, dt = B^T dout, dA = dt x^T, dx += A^T dt)
    ``with_lora`` False leaves out every LoRA term."""
    H, I, k = shape.hidden, shape.intermediate, shape.top_k
    if workload.top_k != k:
        raise ValueError(f"workload: top_k is {workload.top_k} but shape.top_k is {k}; count it with the layer's k")
    M, P, b = workload.num_tokens, workload.num_tokens * k, dtype_bytes
    pa = workload.pairs_with_adapter if with_lora else 0
    rows, base_w = M * H * b, workload.touched_experts * 3 * I * H * b
    lora_w = workload.touched_adapter_experts * 3 * rank * (H + I) * b if with_lora else 0
    reads = [("fwd_x", rows), ("fwd_base_weights", base_w), ("fwd_lora_weights", lora_w),
             ("bwd_dy", rows), ("bwd_x", rows), ("bwd_base_weights", base_w), ("bwd_lora_weights", lora_w)]
    writes = [("fwd_y", rows), ("bwd_dx", rows), ("bwd_lora_grads", lora_w)]
    flops = 12 * P * I * H + 18 * pa * rank * (H + I)
    return Traffic(sum(n for _, n in reads), sum(n for _, n in writes), flops, 2, tuple(reads + writes))
