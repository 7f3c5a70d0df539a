"""FP8 expert weights on disk, in the layout of fine-grained FP8 checkpoints (transformers' ``"fp8"`` quantization
with a ``weight_block_size``, as Qwen3-30B-A3B-FP8 and DeepSeek-V3 ship).

Expert e of layer i is three tensors and their scales:

    {prefix}.{i}.mlp.experts.{e}.gate_proj.weight             float8_e4m3fn [I, H]
    {prefix}.{i}.mlp.experts.{e}.gate_proj.weight_scale_inv   float32 [ceil(I / BN), ceil(H / BK)]
    ... up_proj (as gate_proj), down_proj [H, I] with scales [ceil(H / BN), ceil(I / BK)]

and ``config.json`` holds ``quantization_config = {"quant_method": "fp8", "weight_block_size": [BN, BK],
"activation_scheme": "dynamic", "fmt": "e4m3"}``. Despite its name, ``weight_scale_inv`` MULTIPLIES the FP8
value: weight[n, k] = fp8[n, k] * weight_scale_inv[n // BN, k // BK], exactly the lab's ``FP8Weight.scale``, so
it is stored and read as is. The lab's w13 [E, 2I, H] is gate rows then up rows: gate and up each need whole
scale blocks, so I must be a multiple of BN.

Every refusal names the file (and the tensor) and says what to fix.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from .._backend import optional_module
from ..validate import check_int
from .format import FP8_DTYPE, FP8Weight, QuantizedExperts, _cdiv

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"      # sharded checkpoints: weight_map name -> file
CONFIG = "config.json"
PROJS = ("gate_proj", "up_proj", "down_proj")


def _safetensors():
    return optional_module("safetensors.torch", install='pip install "moelora_lab[adapters]"',
                           needed_for="moelora_lab.quant.files (FP8 checkpoints in .safetensors)")


def _check_place(layer, prefix) -> None:
    check_int("layer", layer, low=0)
    if not isinstance(prefix, str) or not prefix:
        raise TypeError(f"prefix: expected a non-empty str such as 'model.layers', got {prefix!r}")


def _name(prefix: str, layer: int, e: int, proj: str, what: str = "weight") -> str:
    return f"{prefix}.{layer}.mlp.experts.{e}.{proj}.{what}"


def save_fp8_experts(folder, experts: QuantizedExperts, *, layer: int = 0, prefix: str = "model.layers") -> Path:
    """Write ``experts`` as layer ``layer`` of a fine-grained FP8 checkpoint: ``model.safetensors`` (gate_proj,
    up_proj, down_proj and their ``weight_scale_inv`` per expert) and ``config.json`` (its
    ``quantization_config`` with ``weight_block_size`` [BN, BK]); returns the folder. w13 and w2 must share one
    block size (a checkpoint has one) and I must be a multiple of BN (gate and up get whole scale blocks)."""
    if not isinstance(experts, QuantizedExperts):
        raise TypeError(f"experts: expected a QuantizedExperts (moelora_lab.quant.quantize_experts), "
                        f"got {type(experts).__name__}")
    _check_place(layer, prefix)
    w13, w2 = experts.w13, experts.w2
    (E, H, I) = w2.shape                       # QuantizedExperts checked that w13 is [E, 2I, H]
    if w13.block_size != w2.block_size:
        raise ValueError(f"experts: w13 has blocks {w13.block_size} and w2 {w2.block_size}; a checkpoint has one "
                         "weight_block_size: quantize both with the same block_size, such as (128, 128) (per-tensor "
                         "weights, block_size=None, have one block the size of each weight)")
    BN, BK = w13.block_size
    if I % BN:
        raise ValueError(f"experts: I={I} is not a multiple of the block's BN={BN}, so a scale block of w13 straddles "
                         "gate and up rows and cannot be split into gate_proj and up_proj scales; quantize with a "
                         "block_size whose BN divides I, such as (128, 128)")
    SI = I // BN
    tensors = {}
    for e in range(E):
        parts = {"gate_proj": (w13.data[e, :I], w13.scale[e, :SI]), "up_proj": (w13.data[e, I:], w13.scale[e, SI:]),
                 "down_proj": (w2.data[e], w2.scale[e])}
        for proj, (data, scale) in parts.items():
            # clones: safetensors refuses tensors that share memory
            tensors[_name(prefix, layer, e, proj)] = data.detach().to("cpu").clone()
            tensors[_name(prefix, layer, e, proj, "weight_scale_inv")] = scale.detach().to("cpu").clone()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _safetensors().save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [BN, BK],
                                      "activation_scheme": "dynamic", "fmt": "e4m3"},
              "hidden_size": H, "moe_intermediate_size": I, "num_experts": E}
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return folder


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except ValueError as exc:                  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path}: not valid JSON ({exc}); repair the file or save the checkpoint again") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{path}: holds a {type(value).__name__}; expected a JSON object")
    return value


def _block_size(folder: Path) -> tuple[tuple[int, int], dict]:
    """(BN, BK) from config.json's quantization_config, and the config."""
    path = folder / CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; an FP8 checkpoint's config.json names its quantization "
                                "(quantization_config with quant_method 'fp8' and weight_block_size)")
    config = _read_json(path)
    q = config.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") != "fp8":
        got = "no quantization_config" if q is None else f"quant_method {q.get('quant_method')!r}" \
            if isinstance(q, dict) else f"a quantization_config of type {type(q).__name__}"
        raise ValueError(f"{path}: {got}; expected a fine-grained FP8 checkpoint (quant_method 'fp8')")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{path}: quantization_config fmt {q['fmt']!r}; only e4m3 weights are read")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"{path}: quantization_config weight_block_size is {block!r}; expected [BN, BK] such as "
                         "[128, 128] (per-tensor FP8 checkpoints are not read)")
    return (block[0], block[1]), config


def _where(folder: Path) -> dict:
    """Tensor name -> the file holding it (one model.safetensors, or the shards an index lists)."""
    if (folder / INDEX).is_file():
        index = _read_json(folder / INDEX)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{folder / INDEX}: no weight_map (tensor name -> file)")
        return {name: folder / file for name, file in weight_map.items()}
    if not (folder / WEIGHTS).is_file():
        found = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else "not a directory"
        raise FileNotFoundError(f"folder: {folder} needs {WEIGHTS} (or {INDEX} and its shards); found {found}")
    path = folder / WEIGHTS
    return {name: path for name in _open(path).keys()}


def _open(path: Path):
    optional = _safetensors()
    import safetensors
    try:
        return optional.safe_open(str(path), framework="pt")
    except (safetensors.SafetensorError, OSError) as exc:
        raise ValueError(f"{path}: not a readable safetensors file ({exc}); truncated? Save or copy it again") from exc


def load_fp8_experts(folder, *, layer: int = 0, device="cpu", prefix: str = "model.layers") -> QuantizedExperts:
    """Read layer ``layer``'s experts from a fine-grained FP8 checkpoint folder (``model.safetensors`` or a sharded
    one with ``model.safetensors.index.json``, and ``config.json``) as :class:`QuantizedExperts` on ``device``:
    w13 [E, 2I, H] = gate_proj rows then up_proj rows of each expert (their scale blocks likewise), w2 = down_proj.
    The data and scales are the file's, bit for bit."""
    _check_place(layer, prefix)
    folder = Path(folder)
    block, config = _block_size(folder)
    where = _where(folder)
    pattern = re.compile(rf"^{re.escape(prefix)}\.{layer}\.mlp\.experts\.(\d+)\.({'|'.join(PROJS)})\.weight$")
    found = sorted({int(m.group(1)) for m in map(pattern.match, where) if m})
    if not found:
        layers = sorted({int(m.group(1)) for m in map(re.compile(rf"^{re.escape(prefix)}\.(\d+)\.mlp\.experts\.").match,
                                                        where) if m})
        raise ValueError(f"{folder}: no expert of layer {layer} (no tensor {_name(prefix, layer, 0, 'gate_proj')}); "
                         f"experts found for layers {layers}" + ("" if layers else f" (prefix {prefix!r})"))
    # E: the config's expert count (Qwen3-MoE's num_experts, DeepSeek's n_routed_experts), else the largest found
    declared = config.get("num_experts", config.get("n_routed_experts"))
    E = max(found[-1] + 1, declared if isinstance(declared, int) else 0)
    missing = sorted(set(range(E)) - set(found))
    if missing:
        said = f", as {CONFIG} says" if E == declared else ""
        raise ValueError(f"{folder}: layer {layer} misses experts {missing} of E={E}{said}: no tensor "
                         f"{_name(prefix, layer, missing[0], 'gate_proj')}")
    handles: dict = {}
    BN, BK = block

    def read(e: int, proj: str, what: str, dtype: torch.dtype, shape: tuple | None) -> torch.Tensor:
        name = _name(prefix, layer, e, proj, what)
        path = where.get(name)
        if path is None:
            raise ValueError(f"{folder}: tensor {name} is missing (expert {e} of layer {layer} needs {proj}.weight and "
                             f"{proj}.weight_scale_inv)")
        if path not in handles:
            handles[path] = _open(path)
        t = handles[path].get_tensor(name)
        if t.dtype != dtype:
            raise TypeError(f"{path}: {name} has dtype {t.dtype}; a fine-grained FP8 checkpoint stores {dtype}")
        if shape is not None and tuple(t.shape) != shape:
            raise ValueError(f"{path}: {name} has shape {tuple(t.shape)}; expected {shape}")
        return t

    def pair(e: int, proj: str, shape: tuple | None) -> tuple[torch.Tensor, torch.Tensor]:
        w = read(e, proj, "weight", FP8_DTYPE, shape)
        if w.dim() != 2:
            raise ValueError(f"{where[_name(prefix, layer, e, proj)]}: {_name(prefix, layer, e, proj)} has shape "
                             f"{tuple(w.shape)}; expected a 2-D [out, in] weight")
        s = read(e, proj, "weight_scale_inv", torch.float32, None)
        want = (_cdiv(w.shape[0], BN), _cdiv(w.shape[1], BK))
        if tuple(s.shape) != want:
            raise ValueError(f"{where[_name(prefix, layer, e, proj, 'weight_scale_inv')]}: "
                             f"{_name(prefix, layer, e, proj, 'weight_scale_inv')} has shape {tuple(s.shape)} for a "
                             f"weight of {tuple(w.shape)}, but {folder / CONFIG} says weight_block_size [{BN}, {BK}], "
                             f"which gives {want}; the config and the scales disagree")
        return w, s

    gate0, _ = pair(0, "gate_proj", None)
    I, H = gate0.shape
    if I % BN:
        raise ValueError(f"{folder}: I={I} (gate_proj rows) is not a multiple of the block's BN={BN}: the lab's w13 "
                         "stacks gate and up, and a scale block would straddle them")
    w13, s13, w2, s2 = [], [], [], []
    for e in range(E):
        (g, gs), (u, us) = pair(e, "gate_proj", (I, H)), pair(e, "up_proj", (I, H))
        d, ds = pair(e, "down_proj", (H, I))
        w13.append(torch.cat([g, u]))
        s13.append(torch.cat([gs, us]))
        w2.append(d)
        s2.append(ds)
    return QuantizedExperts(
        FP8Weight(torch.stack(w13).to(device), torch.stack(s13).to(device), block),
        FP8Weight(torch.stack(w2).to(device), torch.stack(s2).to(device), block))
