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

    Parameters
    ----------
    sources : str, Path, tuple or list
        A PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``), a ``(state_dict,
        config)`` tuple, or a list of them (slot l = sources[l]).
    num_experts : int, optional
        E. Without it E is inferred: fused experts, lora_A's rows / the config's r (so a config whose r
        is wrong by a factor of the experts cannot be caught: pass it to have r checked); per-expert
        modules, the largest expert index + 1 (pass it when the last experts are untouched).
    slot_rank : int, optional
        The stack's rank (default the largest adapter's; smaller adapters, and experts of smaller rank
        from a rank_pattern, are padded with zeros and ``lora_ranks`` holds each adapter's largest rank).
    pack : bool
        Store B N-fastest (:func:`moelora_lab.pack_lora_b`).
    dtype, device
        Of the returned tensors.
    others : str
        "error" (default) refuses tensors that are not LoRA on experts (attention, embeddings),
        "ignore" skips them.

    Returns
    -------
    dict
        {layer prefix (e.g. "model.layers.0.mlp.experts"): {"w13_lora_a", "w13_lora_b", "w2_lora_a",
        "w2_lora_b", "lora_ranks"}}: the four weight lists ready for ``moe_lora_layer``, scaling folded
        into B.

    Examples
    --------
    >>> import torch
    >>> from moelora_lab.adapters import load_peft, save_peft
    >>> E, r, H, I = 4, 2, 8, 6                      # experts, rank, hidden, expert intermediate
    >>> g = torch.Generator().manual_seed(0)
    >>> experts = "base_model.model.model.layers.0.mlp.experts"          # fused 3D experts, as PEFT saves them
    >>> state = {f"{experts}.base_layer.lora_A.weight": torch.randn(E * r, H, generator=g),    # gate_up_proj
    ...          f"{experts}.base_layer.lora_B.weight": torch.randn(2 * I, r * E, generator=g),
    ...          f"{experts}.lora_A.weight": torch.randn(E * r, I, generator=g),               # down_proj
    ...          f"{experts}.lora_B.weight": torch.randn(H, r * E, generator=g)}
    >>> config = dict(peft_type="LORA", r=r, lora_alpha=2 * r,
    ...               target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    >>> weights = load_peft([(state, config), (state, config)], num_experts=E)     # two slots
    >>> layer = weights["model.layers.0.mlp.experts"]
    >>> [tuple(a.shape) for a in layer["w13_lora_a"]], tuple(layer["w2_lora_b"][0].shape)   # [L, E, r, H], [L, E, H, r]
    ([(2, 4, 2, 8), (2, 4, 2, 8)], (2, 4, 8, 2))
    >>> layer["lora_ranks"].tolist()
    [2, 2]
    >>> # B's column i*E + e holds (rank i, expert e); the scaling lora_alpha / r = 2 is folded in
    >>> torch.equal(layer["w2_lora_b"][0][0], 2 * state[f"{experts}.lora_B.weight"].view(H, r, E).permute(2, 0, 1))
    True
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
    """Write one slot of ``load_peft``'s result as a PEFT adapter on fused 3D experts
    (``target_parameters``), the inverse of ``load_peft`` for that layout.

    Parameters
    ----------
    weights : dict
        ``load_peft``'s result: layer prefix -> layer weights.
    folder : str or Path
        Where ``adapter_config.json`` and ``adapter_model.safetensors`` go (created if missing).
    slot : int
        The slot to write; its rank r comes from ``lora_ranks``. gate and up must share their A (PEFT
        has one A for gate_up_proj).
    lora_alpha : float, optional
        A positive number; defaults to r (scaling 1: B is written as stored, so load -> save -> load is
        exact); another alpha divides B by alpha / r.

    Returns
    -------
    Path
        ``folder``.

    Examples
    --------
    >>> import tempfile
    >>> import torch
    >>> from moelora_lab.adapters import load_peft, save_peft
    >>> E, r, H, I = 4, 2, 8, 6                      # experts, rank, hidden, expert intermediate
    >>> g = torch.Generator().manual_seed(0)
    >>> experts = "base_model.model.model.layers.0.mlp.experts"          # fused 3D experts, as PEFT saves them
    >>> state = {f"{experts}.base_layer.lora_A.weight": torch.randn(E * r, H, generator=g),    # gate_up_proj
    ...          f"{experts}.base_layer.lora_B.weight": torch.randn(2 * I, r * E, generator=g),
    ...          f"{experts}.lora_A.weight": torch.randn(E * r, I, generator=g),               # down_proj
    ...          f"{experts}.lora_B.weight": torch.randn(H, r * E, generator=g)}
    >>> config = dict(peft_type="LORA", r=r, lora_alpha=2 * r,
    ...               target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    >>> weights = load_peft([(state, config), (state, config)], num_experts=E)     # two slots
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     folder = save_peft(weights, tmp, slot=1)
    ...     print(sorted(f.name for f in folder.iterdir()))
    ...     again = load_peft(str(folder))
    ['adapter_config.json', 'adapter_model.safetensors']
    >>> prefix = "model.layers.0.mlp.experts"
    >>> torch.equal(again[prefix]["w2_lora_b"][0][0], weights[prefix]["w2_lora_b"][0][1])      # exact
    True
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
