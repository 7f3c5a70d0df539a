"""PEFT adapter files as ``moelora_lab.adapters`` reads them: the folder or ``(state_dict, config)`` pair,
the config's checks, and the rank and scaling PEFT gives each targeted module or parameter.

Every refusal names the adapter (its folder, or the argument it came in) and says what to fix.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from numbers import Real
from pathlib import Path

import torch

from .._backend import optional_module

UNSUPPORTED = {"use_dora": "DoRA", "lora_bias": "LoRA biases", "use_qalora": "QALoRA", "use_bdlora": "BD-LoRA"}
PEFT_DEFAULTS = {"r": 8, "lora_alpha": 8}       # LoraConfig's defaults, for a config that leaves them out
INSTALL = 'pip install "moelora_lab[adapters]"'


def safetensors_torch():
    """``safetensors.torch``, or an ImportError that names the extra to install."""
    return optional_module("safetensors.torch", install=INSTALL,
                           needed_for="moelora_lab.adapters (PEFT's adapter_model.safetensors)")


@dataclass
class PeftAdapter:
    """One adapter as PEFT saved it: its config and its tensors (names without ``base_model.model.``);
    ``path`` is the folder it was read from (None for a ``(state_dict, config)`` pair)."""

    name: str
    config: dict
    tensors: dict
    path: Path | None = None


def label(ad: PeftAdapter) -> str:
    """How errors name an adapter: its name, and its folder when it has one."""
    return f"{ad.name} ({ad.path})" if ad.path is not None else ad.name


def read_peft(source, name: str | None = None) -> PeftAdapter:
    """A PEFT adapter from a directory (``adapter_config.json`` + ``adapter_model.safetensors``) or a
    tuple ``(state_dict, config)``; ``name`` defaults to the directory's name."""
    return read(source, name, "source")


def read(source, name: str | None, what: str) -> PeftAdapter:
    """``read_peft`` with ``what``, the argument's name in errors (``source``, ``sources[1]``)."""
    if isinstance(source, PeftAdapter):
        return source
    if isinstance(source, tuple):
        if len(source) != 2 or not isinstance(source[0], dict):
            raise TypeError(f"{what}: a tuple must be (state_dict, config), got a tuple of {len(source)} "
                            f"({', '.join(type(s).__name__ for s in source)}); several adapters go in a list")
        tensors, config = source
        name = name or ("adapter" if what == "source" else what)
        bad = [k for k, v in tensors.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
        if bad:
            raise TypeError(f"{what}: the state_dict maps names to torch tensors; {bad[0]!r} holds a "
                            f"{type(tensors[bad[0]]).__name__}")
        path = None
    elif isinstance(source, (str, os.PathLike)):
        config, tensors, path = _read_folder(Path(source))
        name = name or path.name
    else:
        hint = ": a state_dict goes with its config, as (state_dict, config)" if isinstance(source, dict) else ""
        raise TypeError(f"{what}: expected a PEFT adapter folder (str or Path), a (state_dict, config) tuple or a "
                        f"PeftAdapter, got {type(source).__name__}{hint}")
    if not isinstance(config, dict):
        where = f"{path / 'adapter_config.json'} holds" if path is not None else f"{what}: the config is"
        raise TypeError(f"{where} a {type(config).__name__}; expected the adapter_config.json contents as a dict")
    tensors = {k.removeprefix("base_model.model."): v for k, v in tensors.items()}
    return PeftAdapter(name, config, tensors, path)


def _read_folder(folder: Path):
    config_path, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_path.is_file() or not weights.is_file():
        found = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else "not a directory"
        raise FileNotFoundError(f"source: {folder} needs adapter_config.json and adapter_model.safetensors "
                                f"(PEFT's save_pretrained); found {found}")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as exc:                      # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{config_path}: not valid JSON ({exc}); PEFT's save_pretrained writes it: save the "
                         "adapter again or repair the file") from exc
    st = safetensors_torch()
    import safetensors
    try:
        tensors = st.load_file(str(weights))
    except safetensors.SafetensorError as exc:
        raise ValueError(f"{weights}: not a readable safetensors file ({exc}); truncated or not written by "
                         "save_pretrained? Save or copy the adapter again") from exc
    return config, tensors, folder


def is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def is_number(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def check_config(ad: PeftAdapter) -> None:
    """Refuse what the lab does not serve and config values PEFT could not have written."""
    c, lbl = ad.config, label(ad)
    if c.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{lbl}: peft_type {c.get('peft_type')!r}; only LoRA adapters load here")
    bad = [what for key, what in UNSUPPORTED.items() if c.get(key)]
    bad += ["bias={!r}".format(c["bias"])] if c.get("bias", "none") != "none" else []
    bad += [f"modules_to_save={c['modules_to_save']}"] if c.get("modules_to_save") else []
    if bad:
        raise ValueError(f"{lbl}: not supported: {', '.join(bad)} (the lab serves plain LoRA on the experts)")
    if isinstance(c.get("target_parameters"), str):
        raise ValueError(f"{lbl}: target_parameters is the string {c['target_parameters']!r}; PEFT takes a list")
    for key, where, valid, want in (("r", "rank_pattern", is_positive_int, "a positive integer"),
                                    ("lora_alpha", "alpha_pattern", is_number, "a finite number")):
        if key in c and not valid(c[key]):
            raise ValueError(f"{lbl}: {key} = {c[key]!r} in the config; expected {want}")
        patterns = c.get(where) or {}
        if not isinstance(patterns, dict):
            raise ValueError(f"{lbl}: {where} is a {type(patterns).__name__}; expected a dict name -> value")
        for pattern, value in patterns.items():
            if not valid(value):
                raise ValueError(f"{lbl}: {where}[{pattern!r}] = {value!r}; expected {want}")
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"{lbl}: {where} key {pattern!r} is not a regular expression: {exc}") from exc


def _pattern_value(patterns: dict, key: str, default):
    """PEFT's rank_pattern / alpha_pattern: the value of the first pattern the target's name ends with,
    as PEFT's ``get_pattern_key`` finds it; (value, the pattern or None)."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value, pattern
    return default, None


def rank_of(config: dict, key: str) -> tuple[int, str]:
    """The rank PEFT builds target ``key`` with, and where the config says so (for errors)."""
    rank, pattern = _pattern_value(config.get("rank_pattern"), key, config.get("r", PEFT_DEFAULTS["r"]))
    if pattern is not None:
        return rank, f"rank_pattern[{pattern!r}] = {rank}"
    return rank, f"r = {rank}" if "r" in config else f"r = {rank} (PEFT's default: the config has no r)"


def scaling(config: dict, key: str, rank: int) -> float:
    """PEFT's scaling of target ``key``: alpha / r, or alpha / sqrt(r) with use_rslora."""
    alpha, _ = _pattern_value(config.get("alpha_pattern"), key, config.get("lora_alpha", PEFT_DEFAULTS["lora_alpha"]))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
