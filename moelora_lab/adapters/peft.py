"""``load_peft`` and ``save_peft``: PEFT adapter folders to the lab's stack of slots, and one slot back.

Shape legend: L adapters (slots), E experts, r rank, H hidden, I expert intermediate; K in, N out.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..op.face import pack_lora_b
from .files import is_number, is_positive_int, read, safetensors_torch
from .layouts import EXPERT_PARAMETERS, WEIGHT_KEYS, _layers, _slices


def load_peft(sources, *, num_experts: int | None = None, slot_rank: int | None = None, pack: bool = True,
              dtype: torch.dtype = torch.float32, device=None, others: str = "error") -> dict:
    """PEFT adapters of MoE experts in the lab's layout, one slot per adapter.

    sources: a PEFT directory, a ``(state_dict, config)`` tuple, or a list of them (slot l = sources[l]).
    num_experts: E. Without it E is inferred: fused experts, lora_A's rows / the config's r (so a
    config whose r is wrong by a factor of the experts cannot be caught: pass it to have r checked);
    per-expert modules, the largest expert index + 1 (pass it when the last experts are untouched).
    slot_rank: the stack's rank (default the largest adapter's; smaller adapters, and experts of
    smaller rank from a rank_pattern, are padded with zeros and ``lora_ranks`` holds each adapter's
    largest rank). pack: store B N-fastest (``pack_lora_b``). others: "error" (default) refuses tensors
    that are not LoRA on experts (attention, embeddings), "ignore" skips them.
    Returns {layer prefix (e.g. "model.layers.0.mlp.experts"): {"w13_lora_a", "w13_lora_b", "w2_lora_a",
    "w2_lora_b", "lora_ranks"}}, the four weight lists ready for ``moe_lora_layer``.
    """
    if others not in ("error", "ignore"):
        raise ValueError(f"others: expected 'error' or 'ignore', got {others!r}")
    for arg, value in (("num_experts", num_experts), ("slot_rank", slot_rank)):
        if value is not None and not is_positive_int(value):
            raise ValueError(f"{arg}: expected a positive integer or None, got {value!r}")
    items = sources if isinstance(sources, list) else [sources]
    names = [f"sources[{i}]" for i in range(len(items))] if isinstance(sources, list) else ["sources"]
    if not items:
        raise ValueError("sources: empty list; give at least one adapter")
    adapters = [_layers(read(s, n if isinstance(s, tuple) else None, n), num_experts, others)
                for s, n in zip(items, names)]
    prefixes = list(adapters[0])
    for i, layers in enumerate(adapters[1:], start=1):
        if sorted(layers) != sorted(prefixes):
            raise ValueError(f"sources[{i}] adapts layers {sorted(layers)[:3]}..., sources[0] {sorted(prefixes)[:3]}...: "
                             "every adapter of one stack must adapt the same MoE layers")
    out = {}
    for prefix in prefixes:
        per_slot = [_slices(layers[prefix], f"{n}: {prefix}") for layers, n in zip(adapters, names)]
        ranks = [max(a.shape[1] for a, _ in s.values()) for s in per_slot]
        R = slot_rank or max(ranks)
        if R < max(ranks):
            raise ValueError(f"slot_rank: {R} is smaller than an adapter's rank {max(ranks)}")
        stacked = {}
        for proj in ("gate", "up", "down"):
            a = torch.zeros(len(per_slot), *per_slot[0][proj][0].shape[:1], R, per_slot[0][proj][0].shape[2])
            b = torch.zeros(len(per_slot), *per_slot[0][proj][1].shape[:2], R)
            for l, s in enumerate(per_slot):
                sa, sb = s[proj]
                if sa.shape[0] != a.shape[1]:
                    raise ValueError(f"{names[l]}: {prefix} has {sa.shape[0]} experts, {names[0]} {a.shape[1]}: one "
                                     "stack serves one model; an r that disagrees with the tensors gives a wrong E: "
                                     "check adapter_config.json, or pass num_experts=")
                if sa.shape[2] != a.shape[3] or sb.shape[1] != b.shape[2]:
                    raise ValueError(f"{names[l]}: {prefix} {proj} A {tuple(sa.shape)} / B {tuple(sb.shape)} differ "
                                     f"from {names[0]}'s in K or N")
                a[l, :, :sa.shape[1]], b[l, :, :, :sb.shape[2]] = sa, sb
            stacked[proj] = (a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))
        w13_b = [stacked["gate"][1], stacked["up"][1]]
        out[prefix] = dict(w13_lora_a=[stacked["gate"][0], stacked["up"][0]],
                           w13_lora_b=pack_lora_b(w13_b) if pack else w13_b,
                           w2_lora_a=[stacked["down"][0]],
                           w2_lora_b=pack_lora_b([stacked["down"][1]]) if pack else [stacked["down"][1]],
                           lora_ranks=torch.tensor(ranks, dtype=torch.int32, device=device))
    return out


def save_peft(weights: dict, folder, *, slot: int = 0, lora_alpha: float | None = None) -> Path:
    """Write slot ``slot`` of ``load_peft``'s result (prefix -> layer weights) as a PEFT adapter on fused
    3D experts (``target_parameters``), the inverse of ``load_peft`` for that layout.

    The slot's rank r comes from ``lora_ranks``. ``lora_alpha`` (a positive number) defaults to r
    (scaling 1: B is written as stored, so load -> save -> load is exact); another alpha divides B by
    alpha / r. gate and up must share their A (PEFT has one A for gate_up_proj). Returns the folder.
    """
    if not isinstance(weights, dict) or not weights:
        raise ValueError(f"weights: expected load_peft's result (prefix -> layer weights), got "
                         f"{'an empty dict' if isinstance(weights, dict) else type(weights).__name__}")
    if lora_alpha is not None and not (is_number(lora_alpha) and lora_alpha > 0):
        raise ValueError(f"lora_alpha: {lora_alpha!r}; expected a positive finite number (B is written divided by "
                         "lora_alpha / r), or None for r")
    tensors, rank = {}, None
    for prefix, w in weights.items():
        missing = [k for k in WEIGHT_KEYS if not isinstance(w, dict) or k not in w]
        if missing:
            raise ValueError(f"weights: {prefix} lacks {missing}; expected load_peft's layer weights")
        L = len(w["lora_ranks"])
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < L:
            raise ValueError(f"slot: {slot!r} is not a slot of weights, which holds {L}: 0 <= slot < {L}")
        r = int(w["lora_ranks"][slot])
        if r < 1:
            raise ValueError(f"weights: {prefix}: slot {slot} has rank {r}; there is no LoRA to save")
        if rank not in (None, r):
            raise ValueError(f"weights: slot {slot} has rank {rank} in one layer and {r} in {prefix}; PEFT stores one r")
        rank = r
        (ga, ua), (gb, ub) = w["w13_lora_a"], w["w13_lora_b"]
        if not torch.equal(ga[slot, :, :r], ua[slot, :, :r]):
            raise ValueError(f"weights: {prefix}: gate and up have different A's in slot {slot}; PEFT's gate_up_proj "
                             "LoRA has one A for both")
        scale = (lora_alpha if lora_alpha is not None else r) / r
        pairs = {"gate_up_proj": (ga[slot, :, :r], torch.cat([gb[slot, :, :, :r], ub[slot, :, :, :r]], dim=1)),
                 "down_proj": (w["w2_lora_a"][0][slot, :, :r], w["w2_lora_b"][0][slot, :, :, :r])}
        for i, param in enumerate(EXPERT_PARAMETERS):            # the first wrapped is the innermost
            a, b = pairs[param]
            E = a.shape[0]
            key = f"base_model.model.{prefix}." + "base_layer." * (len(EXPERT_PARAMETERS) - 1 - i)
            tensors[key + "lora_A.weight"] = a.reshape(E * r, a.shape[2]).contiguous().cpu()
            tensors[key + "lora_B.weight"] = (b / scale).permute(1, 2, 0).reshape(b.shape[1], r * E).contiguous().cpu()
    save_file = safetensors_torch().save_file
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = dict(peft_type="LORA", r=rank, lora_alpha=lora_alpha if lora_alpha is not None else rank,
                  target_modules=[], target_parameters=[f"experts.{p}" for p in EXPERT_PARAMETERS], use_rslora=False,
                  use_dora=False, bias="none", lora_dropout=0.0, fan_in_fan_out=False, rank_pattern={},
                  alpha_pattern={}, modules_to_save=None, inference_mode=True, task_type=None)
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder
