"""The two ways PEFT stores MoE experts' LoRA, read into the lab's layout (see the package docstring).

Shape legend: L adapters (slots), E experts, r rank, H hidden, I expert intermediate; K in, N out.
"""
from __future__ import annotations

import re

import torch

from .files import PeftAdapter, check_config, label, rank_of, scaling


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


