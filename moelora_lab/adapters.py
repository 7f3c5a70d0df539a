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
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .ops import pack_lora_b

EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")   # definition order in transformers' fused experts modules
MODULE_NAMES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
UNSUPPORTED = {"use_dora": "DoRA", "lora_bias": "LoRA biases", "use_qalora": "QALoRA", "use_bdlora": "BD-LoRA"}
FUSED = re.compile(r"^(?P<prefix>(?:.*\.)?experts)\.(?P<nest>(?:base_layer\.)*)lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
MODULE = re.compile(r"^(?P<prefix>(?:.*\.)?experts)\.(?P<e>\d+)\.(?P<proj>[a-z0-9_]+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


@dataclass
class PeftAdapter:
    """One adapter as PEFT saved it: its config and its tensors (names without ``base_model.model.``)."""

    name: str
    config: dict
    tensors: dict


def read_peft(source, name: str | None = None) -> PeftAdapter:
    """A PEFT adapter from a directory (``adapter_config.json`` + ``adapter_model.safetensors``) or a
    tuple ``(state_dict, config)``; ``name`` defaults to the directory's name."""
    if isinstance(source, PeftAdapter):
        return source
    if isinstance(source, tuple) and len(source) == 2 and isinstance(source[0], dict):
        tensors, config = source
        name = name or "adapter"
    else:
        folder = Path(source)
        config_path, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
        if not config_path.exists() or not weights.exists():
            found = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else "not a directory"
            raise FileNotFoundError(f"source: {folder} needs adapter_config.json and adapter_model.safetensors "
                                    f"(PEFT's save_pretrained); found {found}")
        from safetensors.torch import load_file
        config, tensors, name = json.loads(config_path.read_text()), load_file(str(weights)), name or folder.name
    if not isinstance(config, dict):
        raise TypeError(f"config: expected the adapter_config.json contents as a dict, got {type(config).__name__}")
    tensors = {k.removeprefix("base_model.model."): v for k, v in tensors.items()}
    return PeftAdapter(name, config, tensors)


def _check_config(ad: PeftAdapter) -> None:
    c = ad.config
    if c.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{ad.name}: peft_type {c.get('peft_type')!r}; only LoRA adapters load here")
    bad = [what for key, what in UNSUPPORTED.items() if c.get(key)]
    bad += ["bias={!r}".format(c["bias"])] if c.get("bias", "none") != "none" else []
    bad += [f"modules_to_save={c['modules_to_save']}"] if c.get("modules_to_save") else []
    if bad:
        raise ValueError(f"{ad.name}: not supported: {', '.join(bad)} (the lab serves plain LoRA on the experts)")


def _pattern_value(patterns: dict, key: str, default):
    """PEFT's rank_pattern / alpha_pattern: the value of the first pattern the target's name ends with."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def _scaling(config: dict, key: str, rank: int) -> float:
    alpha = _pattern_value(config.get("alpha_pattern"), key, config.get("lora_alpha", 8))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _fused_layers(ad: PeftAdapter, keys: list[str], num_experts) -> dict:
    """prefix -> {"gate_up": (A [E, r, H], B [E, 2I, r]), "down": (A [E, r, I], B [E, H, r])}, B scaled."""
    targets = [t.rpartition(".")[2] for t in ad.config.get("target_parameters") or []]
    order = [p for p in EXPERT_PARAMETERS if p in targets]
    unknown = sorted(set(targets) - set(EXPERT_PARAMETERS))
    if unknown:
        raise ValueError(f"{ad.name}: target_parameters {unknown} are not MoE expert weights the lab knows "
                         f"({', '.join(EXPERT_PARAMETERS)})")
    by_layer: dict = {}
    for key in keys:
        m = FUSED.match(key)
        by_layer.setdefault(m["prefix"], {})[(m["nest"].count("base_layer."), m["ab"])] = ad.tensors[key]
    layers = {}
    for prefix, found in by_layer.items():
        depths = sorted({d for d, _ in found}, reverse=True)          # deepest = wrapped first
        if len(depths) != len(order) or any((d, ab) not in found for d in depths for ab in "AB"):
            raise ValueError(f"{ad.name}: {prefix} holds LoRA pairs at nesting depths {depths} for target_parameters "
                             f"{order}; expected one lora_A/lora_B pair per targeted parameter")
        layer = {}
        for depth, param in zip(depths, order):
            a, b = found[depth, "A"].float(), found[depth, "B"].float()
            name = f"{prefix}.{param}"
            rank = _pattern_value(ad.config.get("rank_pattern"), name, ad.config.get("r"))
            E = num_experts or (a.shape[0] // rank if rank else None)
            if not E or a.shape[0] % E or b.shape[1] != a.shape[0]:
                raise ValueError(f"{ad.name}: {name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not "
                                 f"split into E = {E} experts of rank {rank}; pass num_experts=")
            r = a.shape[0] // E
            a_e = a.reshape(E, r, a.shape[1])                                   # row e*r + i
            b_e = b.reshape(b.shape[0], r, E).permute(2, 0, 1)                  # column i*E + e
            layer["gate_up" if param == "gate_up_proj" else "down"] = (a_e, b_e * _scaling(ad.config, name, r))
        if len(layer) == 2:
            (ga, gb), (da, db) = layer["gate_up"], layer["down"]
            if ga.shape[2] != db.shape[1] or gb.shape[1] != 2 * da.shape[2]:
                raise ValueError(f"{ad.name}: {prefix}: the nesting order gives gate_up A {tuple(ga.shape)} / B "
                                 f"{tuple(gb.shape)} and down A {tuple(da.shape)} / B {tuple(db.shape)}, which do not "
                                 "fit one layer (gate_up reads H and writes 2I, down reads I and writes H)")
        layers[prefix] = layer
    return layers


def _module_layers(ad: PeftAdapter, keys: list[str], num_experts) -> dict:
    """prefix -> {"gate": (A [E, r, H], B [E, I, r]), "up": ..., "down": (A [E, r, I], B [E, H, r])}."""
    found: dict = {}
    for key in keys:
        m = MODULE.match(key)
        found.setdefault(m["prefix"], {})[(MODULE_NAMES[m["proj"]], int(m["e"]), m["ab"])] = (key, ad.tensors[key])
    layers = {}
    for prefix, items in found.items():
        E = num_experts or 1 + max(e for _, e, _ in items)
        layer = {}
        for proj in ("gate", "up", "down"):
            experts = {e for p, e, _ in items if p == proj}
            if not experts:
                continue
            if max(experts) >= E:
                raise ValueError(f"{ad.name}: {prefix} has expert {max(experts)} but num_experts={E}")
            (_, a0), (_, b0) = items[proj, min(experts), "A"], items[proj, min(experts), "B"]
            a_e = torch.zeros(E, *a0.shape)                 # experts without a LoRA get zeros: no delta
            b_e = torch.zeros(E, *b0.shape)
            for e in experts:
                (key, a), (_, b) = items[proj, e, "A"], items[proj, e, "B"]
                name = key.split(".lora_A")[0]
                a_e[e], b_e[e] = a.float(), b.float() * _scaling(ad.config, name, a.shape[0])
            layer[proj] = (a_e, b_e)
        layers[prefix] = layer
    return layers


def _layers(ad: PeftAdapter, num_experts, others: str) -> dict:
    _check_config(ad)
    fused = [k for k in ad.tensors if FUSED.match(k)]
    modules = [k for k in ad.tensors if MODULE.match(k) and MODULE.match(k)["proj"] in MODULE_NAMES]
    rest = sorted(set(ad.tensors) - set(fused) - set(modules))
    if not fused and not modules:
        raise ValueError(f"{ad.name}: no LoRA on MoE experts found; its {len(ad.tensors)} tensor(s) start "
                         f"{sorted(ad.tensors)[:3]} (target_modules={ad.config.get('target_modules')}, "
                         f"target_parameters={ad.config.get('target_parameters')})")
    if rest and others == "error":
        raise ValueError(f"{ad.name}: {len(rest)} tensor(s) are not LoRA on MoE experts (e.g. {rest[:3]}); the lab "
                         "serves expert LoRA only: pass others='ignore' to skip them")
    layers = _fused_layers(ad, fused, num_experts) if fused else {}
    for prefix, layer in (_module_layers(ad, modules, num_experts) if modules else {}).items():
        if prefix in layers:
            raise ValueError(f"{ad.name}: {prefix} has both fused and per-expert LoRA")
        layers[prefix] = layer
    return layers


def _slices(layer: dict) -> dict:
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
        raise ValueError(f"the adapter has no LoRA on {', '.join(missing)}: the layer takes LoRA on w13 and w2 "
                         "together")
    return out


def load_peft(sources, *, num_experts: int | None = None, slot_rank: int | None = None, pack: bool = True,
              dtype: torch.dtype = torch.float32, device=None, others: str = "error") -> dict:
    """PEFT adapters of MoE experts in the lab's layout, one slot per adapter.

    sources: a PEFT directory, a ``(state_dict, config)`` tuple, or a list of them (slot l = sources[l]).
    num_experts: E, when the file alone cannot give it (per-expert modules with the last experts
    untouched; fused experts with a rank_pattern). slot_rank: the stack's rank (default the largest
    adapter's; smaller adapters are padded with zeros and ``lora_ranks`` holds their ranks). pack:
    store B N-fastest (``pack_lora_b``). others: "error" (default) refuses tensors that are not LoRA on
    experts (attention, embeddings), "ignore" skips them.
    Returns {layer prefix (e.g. "model.layers.0.mlp.experts"): {"w13_lora_a", "w13_lora_b", "w2_lora_a",
    "w2_lora_b", "lora_ranks"}}, the four weight lists ready for ``moe_lora_layer``.
    """
    if others not in ("error", "ignore"):
        raise ValueError(f"others: expected 'error' or 'ignore', got {others!r}")
    items = sources if isinstance(sources, list) else [sources]
    if not items:
        raise ValueError("sources: empty list; give at least one adapter")
    adapters = [_layers(read_peft(s), num_experts, others) for s in items]
    prefixes = list(adapters[0])
    for i, layers in enumerate(adapters[1:], start=1):
        if sorted(layers) != sorted(prefixes):
            raise ValueError(f"sources[{i}] adapts layers {sorted(layers)[:3]}..., sources[0] {sorted(prefixes)[:3]}...: "
                             "every adapter of one stack must adapt the same MoE layers")
    out = {}
    for prefix in prefixes:
        per_slot = [_slices(layers[prefix]) for layers in adapters]
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
                if sa.shape[0] != a.shape[1] or sa.shape[2] != a.shape[3] or sb.shape[1] != b.shape[2]:
                    raise ValueError(f"sources[{l}]: {prefix} {proj} A {tuple(sa.shape)} / B {tuple(sb.shape)} differ "
                                     f"from sources[0]'s in E, K or N")
                a[l, :, :sa.shape[1]], b[l, :, :, :sb.shape[2]] = sa, sb
            stacked[proj] = (a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))
        w13_b = [stacked["gate"][1], stacked["up"][1]]
        out[prefix] = dict(w13_lora_a=[stacked["gate"][0], stacked["up"][0]],
                           w13_lora_b=pack_lora_b(w13_b) if pack else w13_b,
                           w2_lora_a=[stacked["down"][0]],
                           w2_lora_b=pack_lora_b([stacked["down"][1]]) if pack else [stacked["down"][1]],
                           lora_ranks=torch.tensor(ranks, dtype=torch.int32, device=device))
    return out


def save_peft(weights: dict, folder, *, slot: int = 0, lora_alpha: float | None = None, name: str = "default") -> Path:
    """Write slot ``slot`` of ``load_peft``'s result (prefix -> layer weights) as a PEFT adapter on fused
    3D experts (``target_parameters``), the inverse of ``load_peft`` for that layout.

    The slot's rank r comes from ``lora_ranks``. ``lora_alpha`` defaults to r (scaling 1: B is written
    as stored, so load -> save -> load is exact); another alpha divides B by alpha / r. gate and up must
    share their A (PEFT has one A for gate_up_proj). Returns the folder.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    tensors, rank = {}, None
    for prefix, w in weights.items():
        r = int(w["lora_ranks"][slot])
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
    if rank is None:
        raise ValueError("weights: empty; expected load_peft's result (prefix -> layer weights)")
    folder.mkdir(parents=True, exist_ok=True)
    config = dict(peft_type="LORA", r=rank, lora_alpha=lora_alpha if lora_alpha is not None else rank,
                  target_modules=[], target_parameters=[f"experts.{p}" for p in EXPERT_PARAMETERS], use_rslora=False,
                  use_dora=False, bias="none", lora_dropout=0.0, fan_in_fan_out=False, rank_pattern={},
                  alpha_pattern={}, modules_to_save=None, inference_mode=True, task_type=None)
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder
