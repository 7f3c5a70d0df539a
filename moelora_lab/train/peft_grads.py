"""The LoRA gradients of the MoE layer against PEFT's own, on a transformers Qwen3-MoE block with random weights.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, H hidden, I expert intermediate; K in, N out.

PEFT (``target_parameters`` on the fused experts) holds, per targeted parameter and adapter,

    lora_A.weight [E*r, K]    row e*r + i (expert-major)
    lora_B.weight [N, r*E]    column i*E + e (rank-major)

and adds s * B_e A_e to expert e's weight, s = alpha / r (alpha / sqrt(r) with rslora). ``load_peft`` gives the
lab's slots: gate_up's one A to both w13 slices, and B_lab = s * B_peft split into gate rows [0, I) and up rows
[I, 2I). The chain rule takes the lab's gradients back to PEFT's layout:

    dA_peft[e*r + i]     = dA_gate[l, e, i] + dA_up[l, e, i]       (one A read by both slices; down: dA_down)
    dB_peft[n, i*E + e]  = s * dB_lab[l, e, n, i]                   (B_lab = s B_peft; gate|up rows stacked)

:func:`check_grads_against_peft` runs both autograds on one batch (PEFT one adapter at a time on its own
tokens, the lab all adapters at once) and returns the relative error of every factor.
"""
from __future__ import annotations

import copy
import functools
import math
import warnings

import torch

from .._backend import optional_module
from ..adapters import load_peft
from ..config import LoRAShape, MoEShape, make_problem
from ..reference import moe_layer_reference
from ..routing.host import route

EXPERT_TARGETS = ["experts.gate_up_proj", "experts.down_proj"]
PARAMS = ("gate_up_proj", "down_proj")          # the order transformers' experts module defines them
INSTALL = 'pip install transformers peft'
LORA_KEYS = ("w13_lora_a", "w13_lora_b", "w2_lora_a", "w2_lora_b")


def _needs(name: str):
    return optional_module(name, needed_for="moelora_lab.train's PEFT checks", install=INSTALL)


def moe_block(shape: MoEShape | str = "tiny", *, seed: int = 0, device="cpu"):
    """A transformers ``Qwen3MoeSparseMoeBlock`` (router + fused experts) of ``shape`` with random float32
    weights: router and gate_up_proj ~ N(0, 1/H), down_proj ~ N(0, 1/I); renormalized top-k, as Qwen3-MoE."""
    if isinstance(shape, str):
        shape = MoEShape.from_name(shape)
    if not isinstance(shape, MoEShape):
        raise TypeError(f"shape: expected a MoEShape or a preset name such as 'tiny', got {type(shape).__name__}")
    _needs("transformers")
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    H, I, E = shape.hidden, shape.intermediate, shape.num_experts
    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=shape.top_k,
                            norm_topk_prob=True, experts_implementation="eager")
    block = Qwen3MoeSparseMoeBlock(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(E, H, generator=gen) / math.sqrt(H))
        block.experts.gate_up_proj.copy_(torch.randn(E, 2 * I, H, generator=gen) / math.sqrt(H))
        block.experts.down_proj.copy_(torch.randn(E, H, I, generator=gen) / math.sqrt(I))
    return block.to(device).requires_grad_(False)


def peft_adapters(block, specs, *, seed: int = 0, b_std: float = 0.0):
    """A ``PeftModel`` on a copy of ``block`` holding one LoRA on the experts per spec, named a0, a1, ...

    ``specs``: LoraConfig keywords per adapter (r, lora_alpha, use_rslora). A gets PEFT's own init; B is PEFT's
    zeros, or N(0, b_std^2) when ``b_std`` > 0 (drawn on the CPU from ``seed``, so the device does not matter).
    """
    peft = _needs("peft")
    if not specs:
        raise ValueError("specs: empty; give one dict of LoraConfig keywords per adapter, e.g. [dict(r=4)]")
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")          # PEFT warns that a bare block has no config / task type
        torch.manual_seed(seed)
        model = None
        for l, spec in enumerate(specs):
            config = peft.LoraConfig(target_modules=[], target_parameters=EXPERT_TARGETS, **spec)
            if model is None:
                model = peft.get_peft_model(copy.deepcopy(block), config, adapter_name="a0")
            else:
                model.add_adapter(f"a{l}", config)
            if b_std > 0:
                for _, b, _ in lora_factors(model, f"a{l}").values():
                    with torch.no_grad():
                        b.copy_(torch.randn(b.shape, generator=gen) * b_std)
    model.set_adapter("a0")
    return model


def adapter_names(model) -> list[str]:
    return list(model.peft_config)


def lora_factors(model, adapter: str) -> dict:
    """{"gate_up_proj" | "down_proj": (lora_A.weight [E*r, K], lora_B.weight [N, r*E], scaling)} of one adapter."""
    from peft.tuners.lora.layer import ParamWrapper
    out = {m.parameter_name: (m.lora_A[adapter].weight, m.lora_B[adapter].weight, m.scaling[adapter])
           for m in model.modules() if isinstance(m, ParamWrapper) and adapter in m.lora_A}
    if sorted(out) != sorted(PARAMS):
        raise ValueError(f"model: adapter {adapter!r} has LoRA on {sorted(out)}; expected {list(PARAMS)} "
                         f"(target_parameters={EXPERT_TARGETS})")
    return out


def adapter_states(model) -> list[tuple[dict, dict]]:
    """The adapters as ``load_peft`` reads them: one (state_dict, config) pair per adapter, tensors cloned."""
    peft = _needs("peft")
    out = []
    for name in adapter_names(model):
        state = peft.get_peft_model_state_dict(model, adapter_name=name)
        out.append(({k: v.detach().clone() for k, v in state.items()}, model.peft_config[name].to_dict()))
    return out


def route_block(block, x: torch.Tensor):
    """(topk_ids [M, k] int32, topk_weights [M, k]) of x [M, H] by the block's own router, exactly HF's."""
    gate = block.gate
    weights, ids = route(torch.nn.functional.linear(x, gate.weight), gate.top_k, renormalize=gate.norm_topk_prob,
                         cast_weights=True)
    return ids, weights


def peft_lora_grads(model, x: torch.Tensor, token_lora: torch.Tensor, grad_out: torch.Tensor) -> list[dict]:
    """PEFT's gradients of sum(y * grad_out), per adapter l on its own tokens (token_lora == l):
    [{param: (dA [E*r, K], dB [N, r*E])}] in PEFT's layout."""
    out = []
    for l, name in enumerate(adapter_names(model)):
        model.set_adapter(name)
        factors = lora_factors(model, name)
        leaves = [t for a, b, _ in factors.values() for t in (a, b)]
        for t in leaves:
            t.requires_grad_(True)
            t.grad = None
        rows = token_lora == l
        y = model(x[rows][None])[0]                                      # [M_l, H]
        (y * grad_out[rows]).sum().backward()
        out.append({p: (a.grad.clone(), b.grad.clone()) for p, (a, b, _) in factors.items()})
    return out


def lab_lora_grads(block, weights: dict, x, token_lora, grad_out, *, layer_fn=None) -> dict:
    """The lab's gradients of sum(y * grad_out) with respect to each of ``weights``' LoRA lists (``load_peft``'s
    layer weights, B unpacked or packed), y = layer_fn(x routed by the block, the block's experts, weights)."""
    layer_fn = layer_fn or choose_layer(x.device)[0]
    leaves = {key: [w.detach().clone().requires_grad_(True) for w in weights[key]] for key in LORA_KEYS}
    ids, topk_weights = route_block(block, x)
    experts = block.experts
    y = layer_fn(x, ids, topk_weights, token_lora, experts.gate_up_proj.detach(), experts.down_proj.detach(),
                 *(leaves[key] for key in LORA_KEYS))
    if not y.requires_grad:
        raise RuntimeError("layer_fn: its output does not depend on the LoRA weights through autograd; pass a "
                           "differentiable layer such as moelora_lab.moe_layer_reference")
    (y * grad_out).sum().backward()
    return {key: [t.grad for t in ts] for key, ts in leaves.items()}


def grads_in_peft_layout(lab_grads: dict, slot: int, scales: dict) -> dict:
    """One slot of ``lab_lora_grads`` in PEFT's layout: {param: (dA [E*r, K], dB [N, r*E])}; ``scales``
    {param: s} are PEFT's scalings of that adapter (B_lab = s B_peft, so dB_peft = s dB_lab)."""
    (dag, dau), (dbg, dbu) = lab_grads["w13_lora_a"], lab_grads["w13_lora_b"]
    pairs = {"gate_up_proj": (dag[slot] + dau[slot], torch.cat([dbg[slot], dbu[slot]], dim=1)),   # [E, r, H], [E, 2I, r]
             "down_proj": (lab_grads["w2_lora_a"][0][slot], lab_grads["w2_lora_b"][0][slot])}     # [E, r, I], [E, H, r]
    out = {}
    for param, (da, db) in pairs.items():
        E, r, K = da.shape
        out[param] = (da.reshape(E * r, K), scales[param] * db.permute(1, 2, 0).reshape(db.shape[1], r * E))
    return out


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (0 when both are zero)."""
    scale = want.abs().max().item()
    diff = (got.to(want.dtype) - want).abs().max().item()
    return diff / scale if scale > 0 else diff


def check_grads_against_peft(model, block, x, token_lora, grad_out=None, *, layer_fn=None, pack: bool = False,
                             seed: int = 0) -> dict:
    """Relative error of the lab's gradient of every LoRA factor against PEFT's: {(slot, param, "A" | "B"): err}.

    ``model``: ``peft_adapters(block, ...)``; x [M, H]; token_lora [M] (slot l = the model's l-th adapter, -1
    none); ``grad_out`` [M, H] the upstream gradient (default: N(0, 1) from ``seed``); ``pack``: the layer gets
    B N-fastest (``load_peft(pack=True)``), the gradients come back in that layout, same shape.
    """
    if grad_out is None:
        grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x.device)
    names = adapter_names(model)
    if int(token_lora.max()) >= len(names):
        raise ValueError(f"token_lora: slot {int(token_lora.max())} but the model holds {len(names)} adapters")
    E = block.experts.num_experts
    (prefix, weights), = load_peft(adapter_states(model), num_experts=E, pack=pack, device=x.device).items()
    truth = peft_lora_grads(model, x, token_lora, grad_out)
    lab = lab_lora_grads(block, weights, x, token_lora, grad_out, layer_fn=layer_fn)
    errors = {}
    for l, name in enumerate(names):
        factors = lora_factors(model, name)
        r = int(weights["lora_ranks"][l])
        # the stack pads every slot to the largest rank: cut back to this adapter's r before reshaping
        cut = {key: [g[:, :, :r] if key.endswith("_a") else g[..., :r] for g in gs] for key, gs in lab.items()}
        ours = grads_in_peft_layout(cut, l, {p: s for p, (_, _, s) in factors.items()})
        for param, (da, db) in ours.items():
            errors[l, param, "A"] = relative_error(da, truth[l][param][0])
            errors[l, param, "B"] = relative_error(db, truth[l][param][1])
    return errors


def _probe(layer_fn, device) -> float:
    """Largest relative error of layer_fn's gradients (x and every LoRA weight) against the reference's."""
    p = make_problem("tiny", LoRAShape(num_loras=2, rank=4), num_tokens=8, seed=0, device=device,
                     no_adapter_fraction=0.25)
    args = p.layer_inputs()
    grads = []
    for fn in (layer_fn, moe_layer_reference):
        leaves = {k: [w.clone().requires_grad_(True) for w in args[k]] for k in LORA_KEYS}
        x = args["x"].clone().requires_grad_(True)
        y = fn(x, p.topk_ids, p.topk_weights, p.token_lora, p.w13, p.w2, *(leaves[k] for k in LORA_KEYS))
        if not y.requires_grad:
            return math.inf
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.device)
        (y * g).sum().backward()
        grads.append([x.grad] + [w.grad for k in LORA_KEYS for w in leaves[k]])
    if any(g is None for g in grads[0]):
        return math.inf
    return max(relative_error(a, b) for a, b in zip(*grads))


@functools.lru_cache(maxsize=None)
def _choose(device_type: str):
    from ..layer.face import moe_lora_layer
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            err = _probe(moe_lora_layer, torch.device(device_type))
    except Exception:                            # noqa: BLE001  (any failure: the layer has no backward here)
        err = math.inf
    if err <= 1e-4:
        return moe_lora_layer, "moe_lora_layer"
    return moe_layer_reference, "moe_layer_reference"


def choose_layer(device="cpu"):
    """(layer function, its name) for training on ``device``: ``moe_lora_layer`` when its backward gives the
    reference's gradients (to 1e-4, probed once per device type on a tiny problem), else ``moe_layer_reference``."""
    return _choose(torch.device(device).type)
