"""Real adapters in and out: PEFT LoRA adapters of MoE experts in the lab's layout, and back.

Shape legend: L adapters (slots), E experts, r rank, H hidden, I expert intermediate; K in, N out.

The lab's layout, per MoE layer (what ``moe_lora_layer`` takes): w13 = gate|up as two slices,
``w13_lora_a`` 2 x [L, E, r, H], ``w13_lora_b`` 2 x [L, E, I, r]; w2 (down) as one slice,
``w2_lora_a`` 1 x [L, E, r, I], ``w2_lora_b`` 1 x [L, E, H, r]; the scaling folded into B; slots of
smaller rank padded with zeros and their true ranks in ``lora_ranks`` [L].

PEFT stores MoE experts' LoRA in one of two ways:

* **fused 3D experts** (``target_parameters=["experts.gate_up_proj", "experts.down_proj"]``, the
  layout of transformers 5 MoE models: ``gate_up_proj`` [E, 2I, H], rows [0, I) gate, [I, 2I) up, and
  ``down_proj`` [E, H, I]). One LoRA per parameter with the rank per expert: ``lora_A.weight``
  [E*r, in], row e*r + i (expert-major); ``lora_B.weight`` [out, r*E], column i*E + e (rank-major).
  gate and up share ONE A (it spans the 2I outputs), so both of our w13 slices get that A and B is
  split by rows. The file does not name the parameters: PEFT nests one wrapper per targeted
  parameter, the first wrapped innermost, so a layer holds ``...experts.base_layer.lora_A.weight``
  (the parameter the experts module defines first: gate_up_proj) and ``...experts.lora_A.weight``
  (the next: down_proj). Shapes alone cannot tell them apart when H = I; the nesting can, and the
  shapes are only checked for consistency (``EXPERT_PARAMETERS`` gives the order).
* **per-expert modules** (older checkpoints: ``experts.{e}.gate_proj`` / ``up_proj`` /
  ``down_proj``, or Mixtral's ``w1`` / ``w3`` / ``w2``): one LoRA per expert and projection,
  ``lora_A.weight`` [r, in], ``lora_B.weight`` [out, r]; gate and up have their own A's.

Scaling: lora_alpha / r, or lora_alpha / sqrt(r) with ``use_rslora``; ``rank_pattern`` and
``alpha_pattern`` override r and alpha for the targets they match.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from .adapter_files import (UNSUPPORTED, PeftAdapter, check_config, is_number, is_positive_int, label, rank_of, read,
                            read_peft, safetensors_torch, scaling)
from .ops import pack_lora_b

__all__ = ["EXPERT_PARAMETERS", "FUSED", "MODULE", "MODULE_NAMES", "UNSUPPORTED", "PeftAdapter", "load_peft",
           "read_peft", "save_peft"]

EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")   # definition order in transformers' fused experts modules
MODULE_NAMES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
FUSED = re.compile(r"^(?P<prefix>(?:.*\.)?experts)\.(?P<nest>(?:base_layer\.)*)lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
MODULE = re.compile(r"^(?P<prefix>(?:.*\.)?experts)\.(?P<e>\d+)\.(?P<proj>[a-z0-9_]+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
WEIGHT_KEYS = ("w13_lora_a", "w13_lora_b", "w2_lora_a", "w2_lora_b", "lora_ranks")


def _matrices(lbl: str, key_a: str, a, key_b: str, b) -> None:
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"{lbl}: {key_a} {tuple(a.shape)} and {key_b} {tuple(b.shape)}: PEFT saves lora_A and "
                         "lora_B as 2-D matrices; the file was not written by save_pretrained")


def _fused_experts(ad: PeftAdapter, name: str, a, b, num_experts) -> tuple[int, int, str]:
    """(E, r, where the config gives r) of one fused pair, lora_A [E*r, K] and lora_B [N, r*E]: r is the
    config's (PEFT builds the pair with it); E is num_experts, else lora_A's rows / r."""
    lbl, (rank, where), rows = label(ad), rank_of(ad.config, name), a.shape[0]
    if b.shape[1] != rows:
        raise ValueError(f"{lbl}: {name}: lora_A {tuple(a.shape)} has {rows} rows but lora_B {tuple(b.shape)} "
                         f"{b.shape[1]} columns; PEFT saves E*r of each")
    if num_experts:
        if rows % num_experts:
            raise ValueError(f"{lbl}: {name}: lora_A {tuple(a.shape)} has {rows} rows = E*r, not a multiple of "
                             f"num_experts={num_experts}: is that the model's number of experts?")
        if rows // num_experts != rank:
            r = rows // num_experts
            raise ValueError(f"{lbl}: {name}: with num_experts={num_experts} the tensors are rank {r} (lora_A "
                             f"{tuple(a.shape)}, E*r rows) but the config says {where}: fix it in adapter_config.json "
                             f"to {r}, or correct num_experts")
        return num_experts, rank, where
    if rows % rank:
        raise ValueError(f"{lbl}: {name}: lora_A {tuple(a.shape)} has {rows} rows = E*r, not a multiple of the "
                         f"config's {where}: the config disagrees with the tensors; fix it in adapter_config.json "
                         "(pass num_experts= and this error names the tensors' rank)")
    return rows // rank, rank, where


def _fused_layers(ad: PeftAdapter, keys: list[str], num_experts) -> dict:
    """prefix -> {"gate_up": (A [E, r, H], B [E, 2I, r]), "down": (A [E, r, I], B [E, H, r])}, B scaled."""
    lbl = label(ad)
    targets = [t.rpartition(".")[2] for t in ad.config.get("target_parameters") or []]
    order = [p for p in EXPERT_PARAMETERS if p in targets]
    unknown = sorted(set(targets) - set(EXPERT_PARAMETERS))
    if unknown:
        raise ValueError(f"{lbl}: target_parameters {unknown} are not MoE expert weights the lab knows "
                         f"({', '.join(EXPERT_PARAMETERS)})")
    by_layer: dict = {}
    for key in keys:
        m = FUSED.match(key)
        found, slot = by_layer.setdefault(m["prefix"], {}), (m["nest"].count("base_layer."), m["ab"])
        if slot in found:
            raise ValueError(f"{lbl}: {found[slot][0]} and {key} are both the lora_{m['ab']} of one parameter of "
                             f"{m['prefix']}; PEFT saves one per targeted parameter")
        found[slot] = (key, ad.tensors[key])
    layers, counts = {}, []
    for prefix, found in by_layer.items():
        depths = sorted({d for d, _ in found}, reverse=True)          # deepest = wrapped first
        if len(depths) != len(order) or any((d, ab) not in found for d in depths for ab in "AB"):
            raise ValueError(f"{lbl}: {prefix} holds LoRA pairs at nesting depths {depths} for target_parameters "
                             f"{order}; expected one lora_A/lora_B pair per targeted parameter")
        layer = {}
        for depth, param in zip(depths, order):
            (key_a, a), (key_b, b) = found[depth, "A"], found[depth, "B"]
            _matrices(lbl, key_a, a, key_b, b)
            name = f"{prefix}.{param}"
            E, r, where = _fused_experts(ad, name, a, b, num_experts)
            if counts and counts[0][0] != E:                            # one model: one E (num_experts= gives one)
                E0, name0, where0 = counts[0]
                raise ValueError(f"{lbl}: lora_A rows / r gives {name0} {E0} experts ({where0}) but {name} {E} "
                                 f"({where}): an r in adapter_config.json disagrees with the tensors; fix it, or "
                                 "pass num_experts= and the error names the tensors' rank")
            counts.append((E, name, where))
            a, b = a.float(), b.float()
            a_e = a.reshape(E, r, a.shape[1])                                   # row e*r + i
            b_e = b.reshape(b.shape[0], r, E).permute(2, 0, 1)                  # column i*E + e
            layer["gate_up" if param == "gate_up_proj" else "down"] = (a_e, b_e * scaling(ad.config, name, r))
        if len(layer) == 2:
            (ga, gb), (da, db) = layer["gate_up"], layer["down"]
            if ga.shape[2] != db.shape[1] or gb.shape[1] != 2 * da.shape[2]:
                raise ValueError(f"{lbl}: {prefix}: the nesting order gives gate_up A {tuple(ga.shape)} / B "
                                 f"{tuple(gb.shape)} and down A {tuple(da.shape)} / B {tuple(db.shape)}, which do not "
                                 "fit one layer (gate_up reads H and writes 2I, down reads I and writes H)")
        layers[prefix] = layer
    return layers


def _module_pair(ad: PeftAdapter, prefix: str, proj: str, e: int, pair: dict):
    """One expert's (A [r, K], B [N, r] times PEFT's scaling for that module), r checked against the config."""
    lbl = label(ad)
    for ab, other in (("A", "B"), ("B", "A")):
        if ab not in pair:
            key = pair[other][0]
            at = MODULE.match(key).start("ab")
            raise ValueError(f"{lbl}: {prefix}: expert {e}'s {proj} projection has {key} but not "
                             f"{key[:at] + ab + key[at + 1:]}; PEFT saves lora_A and lora_B together: the file is "
                             "incomplete, save the adapter again")
    (key_a, a), (key_b, b) = pair["A"], pair["B"]
    _matrices(lbl, key_a, a, key_b, b)
    module = key_a[:MODULE.match(key_a).start("ab") - len(".lora_")]
    rank, where = rank_of(ad.config, module)
    # PEFT builds this module's lora_A / lora_B at the config's rank and refuses a file of another: so do we
    if a.shape[0] != rank or b.shape[1] != rank:
        raise ValueError(f"{lbl}: {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} are of rank "
                         f"{a.shape[0]} / {b.shape[1]} but the config says {where}, the rank PEFT builds this module "
                         "with: fix it in adapter_config.json (a rank_pattern entry for modules of another rank)")
    return a.float(), b.float() * scaling(ad.config, module, rank)


def _module_layers(ad: PeftAdapter, keys: list[str], num_experts) -> dict:
    """prefix -> {"gate": (A [E, r, H], B [E, I, r]), "up": ..., "down": (A [E, r, I], B [E, H, r])}, B scaled;
    experts of smaller rank padded with zeros to the projection's largest."""
    lbl, found = label(ad), {}
    for key in keys:
        m = MODULE.match(key)
        proj, e = MODULE_NAMES[m["proj"]], int(m["e"])
        pair = found.setdefault(m["prefix"], {}).setdefault((proj, e), {})
        if m["ab"] in pair:
            raise ValueError(f"{lbl}: {pair[m['ab']][0]} and {key} are both the {proj} lora_{m['ab']} of expert {e}; "
                             "one file names each projection one way (gate_proj/up_proj/down_proj or w1/w3/w2)")
        pair[m["ab"]] = (key, ad.tensors[key])
    E = num_experts or 1 + max(e for items in found.values() for _, e in items)     # one E for all layers
    layers = {}
    for prefix, items in found.items():
        layer = {}
        for proj in ("gate", "up", "down"):
            experts = sorted(e for p, e in items if p == proj)
            if not experts:
                continue
            if experts[-1] >= E:
                raise ValueError(f"{lbl}: {prefix} has expert {experts[-1]} but num_experts={E}")
            pairs = {e: _module_pair(ad, prefix, proj, e, items[proj, e]) for e in experts}
            a0, b0 = pairs[experts[0]]
            R = max(a.shape[0] for a, _ in pairs.values())
            a_e = torch.zeros(E, R, a0.shape[1])            # experts without a LoRA, and ranks past an expert's:
            b_e = torch.zeros(E, b0.shape[0], R)            # zeros, no delta
            for e, (a, b) in pairs.items():
                if a.shape[1] != a0.shape[1] or b.shape[0] != b0.shape[0]:
                    raise ValueError(f"{lbl}: {prefix}: expert {e}'s {proj} reads {a.shape[1]} and writes {b.shape[0]}"
                                     f", expert {experts[0]}'s {a0.shape[1]} and {b0.shape[0]}: one layer's experts "
                                     "have one shape")
                a_e[e, :a.shape[0]], b_e[e, :, :b.shape[1]] = a, b
            layer[proj] = (a_e, b_e)
        sizes = {p: (a.shape[2], b.shape[1]) for p, (a, b) in layer.items()}          # (reads, writes)
        want = {"gate": ("H", "I"), "up": ("H", "I"), "down": ("I", "H")}
        dims: dict = {}
        for p, size in sizes.items():
            for letter, n in zip(want[p], size):
                if dims.setdefault(letter, n) != n:
                    raise ValueError(f"{lbl}: {prefix}: the projections do not fit one layer: (reads, writes) "
                                     f"{sizes}; gate and up read H and write I, down reads I and writes H")
        layers[prefix] = layer
    return layers


def _layers(ad: PeftAdapter, num_experts, others: str) -> dict:
    check_config(ad)
    lbl = label(ad)
    fused = [k for k in ad.tensors if FUSED.match(k)]
    modules = [k for k in ad.tensors if MODULE.match(k) and MODULE.match(k)["proj"] in MODULE_NAMES]
    rest = sorted(set(ad.tensors) - set(fused) - set(modules))
    if not fused and not modules:
        raise ValueError(f"{lbl}: no LoRA on MoE experts found; its {len(ad.tensors)} tensor(s) start "
                         f"{sorted(ad.tensors)[:3]} (target_modules={ad.config.get('target_modules')}, "
                         f"target_parameters={ad.config.get('target_parameters')})")
    if rest and others == "error":
        raise ValueError(f"{lbl}: {len(rest)} tensor(s) are not LoRA on MoE experts (e.g. {rest[:3]}); the lab "
                         "serves expert LoRA only: pass others='ignore' to skip them")
    layers = _fused_layers(ad, fused, num_experts) if fused else {}
    for prefix, layer in (_module_layers(ad, modules, num_experts) if modules else {}).items():
        if prefix in layers:
            raise ValueError(f"{lbl}: {prefix} has both fused and per-expert LoRA")
        layers[prefix] = layer
    return layers


def _slices(layer: dict, where: str) -> dict:
    """Our slices of one adapter's layer: gate, up, down as (A [E, r, K], B [E, N, r])."""
    if "gate_up" in layer:
        a, b = layer["gate_up"]
        I = b.shape[1] // 2
        out = {"gate": (a, b[:, :I]), "up": (a, b[:, I:])}                  # ONE A shared by gate and up
    else:
        out = {p: layer[p] for p in ("gate", "up") if p in layer}
    if "down" in layer:
        out["down"] = layer["down"]
    missing = [p for p in ("gate", "up", "down") if p not in out]
    if missing:
        raise ValueError(f"{where}: the adapter has no LoRA on {', '.join(missing)}: the layer takes LoRA on w13 "
                         "and w2 together")
    return out


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
