"""moelora_lab.quant.files: FP8 experts in the fine-grained FP8 checkpoint layout, the round trip bit for bit, and
every refusal naming the file and the tensor."""
import json

import pytest
import torch

from moelora_lab.quant.files import load_fp8_experts, save_fp8_experts
from moelora_lab.quant.format import FP8Weight, QuantizedExperts, quantize_experts, quantize_weight

st = pytest.importorskip("safetensors.torch")

E, H, I = 3, 256, 128
PRE = "model.layers.0.mlp.experts"


def _experts(seed=0, H=H, I=I, block=(128, 128)):
    g = torch.Generator().manual_seed(seed)
    return quantize_experts(torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g), block)


def _bits(t):
    return t.view(torch.uint8)


def _same(a: QuantizedExperts, b: QuantizedExperts) -> bool:
    return all(torch.equal(_bits(x.data), _bits(y.data)) and torch.equal(x.scale, y.scale)
               and x.block_size == y.block_size for x, y in ((a.w13, b.w13), (a.w2, b.w2)))


@pytest.fixture
def saved(tmp_path):
    ex = _experts()
    save_fp8_experts(tmp_path, ex)
    return tmp_path, ex


def _rewrite(folder, change):
    """Apply ``change`` to the file's tensors (a dict) and write them back."""
    tensors = st.load_file(str(folder / "model.safetensors"))
    change(tensors)
    st.save_file(tensors, str(folder / "model.safetensors"))


def test_layout_on_disk(saved):
    folder, ex = saved
    tensors = st.load_file(str(folder / "model.safetensors"))
    assert len(tensors) == E * 6
    gate, up, down = (tensors[f"{PRE}.1.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj"))
    assert gate.dtype == torch.float8_e4m3fn and gate.shape == up.shape == (I, H) and down.shape == (H, I)
    assert tensors[f"{PRE}.1.gate_proj.weight_scale_inv"].shape == (1, 2)
    assert tensors[f"{PRE}.1.down_proj.weight_scale_inv"].dtype == torch.float32
    assert tensors[f"{PRE}.1.down_proj.weight_scale_inv"].shape == (2, 1)
    # the scale multiplies: gate_proj's value is fp8 * weight_scale_inv, the rows 0..I of the lab's w13
    value = gate.float() * tensors[f"{PRE}.1.gate_proj.weight_scale_inv"].repeat_interleave(128, 0).repeat_interleave(
        128, 1)
    assert torch.equal(value, ex.w13.dequantize()[1, :I])
    assert torch.equal(up.float() * tensors[f"{PRE}.1.up_proj.weight_scale_inv"].repeat_interleave(128, 1),
                       ex.w13.dequantize()[1, I:])
    q = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert q == {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "fmt": "e4m3"}


@pytest.mark.parametrize("block, shape", [((128, 128), (H, I)), ((64, 32), (200, 192)), ((128, 128), (200, 256))])
def test_round_trip_is_bit_exact(tmp_path, block, shape):
    ex = _experts(seed=1, H=shape[0], I=shape[1], block=block)     # H=200: partial blocks at the edges
    save_fp8_experts(tmp_path, ex, layer=3)
    back = load_fp8_experts(tmp_path, layer=3)
    assert _same(back, ex)
    assert back.w13.data.is_contiguous() and back.w13.scale.shape == ex.w13.scale.shape


def test_two_layers_in_one_index_sharded_checkpoint(tmp_path):
    # a sharded checkpoint: one file per layer and model.safetensors.index.json mapping each tensor to its file
    a, b = _experts(2), _experts(3)
    weight_map = {}
    for layer, ex in ((0, a), (1, b)):
        save_fp8_experts(tmp_path / f"l{layer}", ex, layer=layer)
        shard = f"model-0000{layer + 1}-of-00002.safetensors"
        (tmp_path / f"l{layer}" / "model.safetensors").rename(tmp_path / shard)
        weight_map |= {name: shard for name in st.load_file(str(tmp_path / shard))}
    (tmp_path / "l0" / "config.json").rename(tmp_path / "config.json")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert _same(load_fp8_experts(tmp_path, layer=0), a) and _same(load_fp8_experts(tmp_path, layer=1), b)


def test_save_refusals(tmp_path):
    with pytest.raises(TypeError, match=r"^experts: expected a QuantizedExperts"):
        save_fp8_experts(tmp_path, (torch.zeros(1), torch.zeros(1)))
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(E, 2 * 96, H, generator=g), torch.randn(E, H, 96, generator=g)
    with pytest.raises(ValueError, match=r"^experts: I=96 is not a multiple of the block's BN=128, so a scale block of "
                                         r"w13 straddles gate and up"):
        save_fp8_experts(tmp_path, quantize_experts(w13, w2))
    with pytest.raises(ValueError, match=r"^experts: w13 has blocks \(192, 256\) and w2 \(256, 96\); a checkpoint has "
                                         r"one weight_block_size: .* \(per-tensor weights"):
        save_fp8_experts(tmp_path, quantize_experts(w13, w2, None))
    with pytest.raises(ValueError, match=r"^w13 \(1, 256, 256\) and w2 \(1, 256, 100\) are not one layer's"):
        quantize_experts(torch.randn(1, 2 * I, H), torch.randn(1, H, 100))
    mixed = QuantizedExperts(quantize_weight(w13, (32, 128)), quantize_weight(w2, (128, 32)))
    with pytest.raises(ValueError, match=r"^experts: w13 has blocks \(32, 128\) and w2 \(128, 32\)"):
        save_fp8_experts(tmp_path, mixed)
    with pytest.raises(ValueError, match=r"^layer: must be >= 0"):
        save_fp8_experts(tmp_path, _experts(), layer=-1)
    assert not (tmp_path / "model.safetensors").exists()


def _drop(name):
    return lambda t: t.pop(name)


def _set(name, value):
    return lambda t: t.__setitem__(name, value(t[name]))


@pytest.mark.parametrize("change, exc, match", [
    (_drop(f"{PRE}.2.up_proj.weight_scale_inv"), ValueError,
     rf"{PRE}.2.up_proj.weight_scale_inv is missing \(expert 2 of layer 0 needs up_proj.weight"),
    (_drop(f"{PRE}.1.down_proj.weight"), ValueError, rf"tensor {PRE}.1.down_proj.weight is missing"),
    (_set(f"{PRE}.1.up_proj.weight", lambda t: t.float().to(torch.bfloat16)), TypeError,
     rf"model.safetensors: {PRE}.1.up_proj.weight has dtype torch.bfloat16; a fine-grained FP8 checkpoint stores "
     r"torch.float8_e4m3fn"),
    (_set(f"{PRE}.0.gate_proj.weight_scale_inv", lambda t: t.half()), TypeError,
     rf"model.safetensors: {PRE}.0.gate_proj.weight_scale_inv has dtype torch.float16; .* stores torch.float32"),
    (_set(f"{PRE}.2.down_proj.weight", lambda t: t[:, :64].contiguous()), ValueError,
     rf"model.safetensors: {PRE}.2.down_proj.weight has shape \(256, 64\); expected \(256, 128\)"),
    (_set(f"{PRE}.1.gate_proj.weight", lambda t: t[:, :200].contiguous()), ValueError,
     rf"{PRE}.1.gate_proj.weight has shape \(128, 200\); expected \(128, 256\)"),
    (_set(f"{PRE}.1.up_proj.weight_scale_inv", lambda t: t[:, :1].contiguous()), ValueError,
     rf"{PRE}.1.up_proj.weight_scale_inv has shape \(1, 1\) for a weight of \(128, 256\), but .*config.json says "
     r"weight_block_size \[128, 128\], which gives \(1, 2\)"),
    (lambda t: [t.pop(n) for n in list(t) if ".experts.1." in n], ValueError,
     r"layer 0 misses experts \[1\] of E=3, as config.json says: no tensor model.layers.0.mlp.experts.1.gate_proj"),
])
def test_load_refusals_name_file_and_tensor(saved, change, exc, match):
    folder, _ = saved
    _rewrite(folder, change)
    with pytest.raises(exc, match=match):
        load_fp8_experts(folder)


def _config(folder, change):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("change, match", [
    (lambda c: c["quantization_config"].__setitem__("weight_block_size", [64, 128]),
     r"weight_scale_inv has shape \(1, 2\) for a weight of \(128, 256\), but .*config.json says weight_block_size "
     r"\[64, 128\], which gives \(2, 2\); the config and the scales disagree"),
    (lambda c: c["quantization_config"].__setitem__("weight_block_size", None),
     r"config.json: quantization_config weight_block_size is None; expected \[BN, BK\]"),
    (lambda c: c["quantization_config"].__setitem__("weight_block_size", [128, 0]),
     r"weight_block_size is \[128, 0\]"),
    (lambda c: c["quantization_config"].__setitem__("quant_method", "gptq"),
     r"config.json: quant_method 'gptq'; expected a fine-grained FP8 checkpoint"),
    (lambda c: c.pop("quantization_config"), r"config.json: no quantization_config"),
    (lambda c: c["quantization_config"].__setitem__("fmt", "e5m2"), r"fmt 'e5m2'; only e4m3"),
    (lambda c: c.__setitem__("num_experts", 4), r"layer 0 misses experts \[3\] of E=4, as config.json says"),
])
def test_config_refusals(saved, change, match):
    folder, _ = saved
    _config(folder, change)
    with pytest.raises(ValueError, match=match):
        load_fp8_experts(folder)


def test_folder_refusals(saved, tmp_path):
    folder, _ = saved
    with pytest.raises(ValueError, match=r"no expert of layer 2 \(no tensor model.layers.2.mlp.experts.0.gate_proj."
                                         r"weight\); experts found for layers \[0\]"):
        load_fp8_experts(folder, layer=2)
    with pytest.raises(ValueError, match=r"no expert of layer 0 .* for layers \[\] \(prefix 'model.decoder'\)"):
        load_fp8_experts(folder, prefix="model.decoder")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"config.json: missing"):
        load_fp8_experts(empty)
    (empty / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match=r"needs model.safetensors \(or model.safetensors.index.json"):
        load_fp8_experts(empty)
    (empty / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=r"model.safetensors: not a readable safetensors file"):
        load_fp8_experts(empty)
    (folder / "config.json").write_text("{")
    with pytest.raises(ValueError, match=r"config.json: not valid JSON"):
        load_fp8_experts(folder)


def test_rows_not_a_multiple_of_the_block_are_refused(tmp_path):
    # a checkpoint may hold I not a multiple of BN (its own layer reads gate and up apart); the lab's w13 cannot
    ex = _experts(H=256, I=128, block=(64, 128))
    save_fp8_experts(tmp_path, ex)
    _config(tmp_path, lambda c: c["quantization_config"].__setitem__("weight_block_size", [96, 128]))

    def regrid(t):                        # rewrite every scale for BN = 96 so only the straddling is wrong
        for name in [n for n in t if n.endswith("weight_scale_inv")]:
            w = t[name.replace("_scale_inv", "")]
            t[name] = torch.ones(-(-w.shape[0] // 96), -(-w.shape[1] // 128))
    _rewrite(tmp_path, regrid)
    with pytest.raises(ValueError, match=r"I=128 \(gate_proj rows\) is not a multiple of the block's BN=96"):
        load_fp8_experts(tmp_path)


def test_loaded_weights_are_fp8_weights(saved):
    folder, ex = saved
    back = load_fp8_experts(folder, device="cpu")
    assert isinstance(back.w13, FP8Weight) and back.w13.shape == (E, 2 * I, H) and back.w2.shape == (E, H, I)
    assert torch.equal(back.w13.dequantize(), ex.w13.dequantize())
