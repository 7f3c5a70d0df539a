"""moelora_lab.adapters against the libraries that write the adapters: tiny random transformers MoE blocks with PEFT
LoRA (no downloads), saved with save_pretrained, loaded with load_peft, and the lab's reference and layer checked
against HF+PEFT's own forward; the round trip; the router; a gallery of layout bugs the check must catch."""
import copy
import json
import warnings

import pytest
import torch

import moelora_lab  # noqa: F401  (first: it picks the interpreter before triton loads)
from moelora_lab import moe_layer_reference, moe_lora_layer
from moelora_lab.adapters import load_peft, read_peft, save_peft
from moelora_lab.routing import route

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import Qwen3MoeConfig  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeForCausalLM  # noqa: E402

# transformers and peft warn about their own deprecations on import and save; not this lab's concern
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning", "ignore::UserWarning")
TOL = 1e-4                    # fp32: relative to the output's largest value
TARGETS = ["experts.gate_up_proj", "experts.down_proj"]
SPECS = [dict(r=4, lora_alpha=8), dict(r=8, lora_alpha=16, use_rslora=True), dict(r=6, lora_alpha=3)]
TOKEN_LORA = torch.tensor([0, 1, 2, -1, 0, 1, 2, -1, 2, 2, 0, 1])


def _model(H=48, I=40, E=8, k=2, seed=0):
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=k,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                         vocab_size=32, head_dim=24, norm_topk_prob=True)
    model = Qwen3MoeForCausalLM(cfg).float()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return model


def _adapters(model, folder, specs=SPECS):
    """One PEFT model per spec (B random, non-zero), each saved with save_pretrained; (models, folders)."""
    models, dirs = [], []
    for i, spec in enumerate(specs):
        pm = get_peft_model(copy.deepcopy(model), LoraConfig(target_modules=[], target_parameters=TARGETS,
                                                             init_lora_weights=False, **spec))
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.3)
        pm.save_pretrained(folder / f"a{i}")
        models.append(pm)
        dirs.append(folder / f"a{i}")
    return models, dirs


def _block(m):
    return (m.base_model.model if isinstance(m, peft.PeftModel) else m).model.layers[0].mlp


@torch.no_grad()
def _hf_truth(model, peft_models, x, token_lora):
    """HF+PEFT's output per token: one forward per adapter (PEFT cannot mix adapters in one batch here)."""
    y = torch.zeros_like(x)
    for l in token_lora.unique().tolist():
        rows = token_lora == l
        y[rows] = _block(model if l < 0 else peft_models[l])(x[None])[0][rows]
    return y


def _routing(model, x):
    gate = _block(model).gate
    weights, ids = route(torch.nn.functional.linear(x, gate.weight), gate.top_k, renormalize=gate.norm_topk_prob,
                         cast_weights=True)
    return ids, weights


def _case(tmp_path, **shape):
    model = _model(**shape)
    peft_models, dirs = _adapters(model, tmp_path)
    x = torch.randn(len(TOKEN_LORA), model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    return model, dirs, x, _hf_truth(model, peft_models, x, TOKEN_LORA)


def _run(model, w, x, **kw):
    experts = _block(model).experts
    ids, weights = _routing(model, x)
    args = (x, ids, weights, TOKEN_LORA, experts.gate_up_proj.detach(), experts.down_proj.detach(),
            w["w13_lora_a"], w["w13_lora_b"], w["w2_lora_a"], w["w2_lora_b"])
    if kw.pop("reference", False):
        return moe_layer_reference(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)        # dual_stream runs on one stream on the CPU
        return moe_lora_layer(*args, lora_ranks=w["lora_ranks"], **kw)


def _error(y, truth):
    return ((y - truth).abs().max() / truth.abs().max()).item()


def test_router_is_hfs_exactly():
    model = _model()
    x = torch.randn(64, 48).bfloat16()
    gate = _block(model).gate.bfloat16()
    _, hf_weights, hf_ids = gate(x)
    weights, ids = route(torch.nn.functional.linear(x, gate.weight), 2, renormalize=True, cast_weights=True)
    assert torch.equal(ids, hf_ids.int()) and torch.equal(weights, hf_weights) and weights.dtype == torch.bfloat16
    assert route(x.float() @ gate.weight.float().T, 2)[0].dtype == torch.float32      # vLLM's convention: fp32


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through the interpreter; the GPU suite checks the kernels")
@pytest.mark.parametrize("schedule", ["reference", "sequential", "dual_stream", "fused"])
def test_three_adapters_of_mixed_rank_alpha_and_rslora_match_hf_peft(tmp_path, schedule):
    model, dirs, x, truth = _case(tmp_path)
    (prefix, w), = load_peft(dirs).items()
    assert prefix == "model.layers.0.mlp.experts" and w["lora_ranks"].tolist() == [4, 8, 6]
    assert [tuple(t.shape) for t in w["w13_lora_a"]] == [(3, 8, 8, 48)] * 2
    y = _run(model, w, x, reference=True) if schedule == "reference" else _run(model, w, x, schedule=schedule)
    assert _error(y, truth) < TOL
    assert torch.equal(y[TOKEN_LORA == -1], y[TOKEN_LORA == -1])       # tokens without an adapter: plain layer


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through the interpreter; the GPU suite checks the kernels")
def test_nesting_not_shapes_decides_when_hidden_equals_intermediate(tmp_path):
    """H = I: gate_up's and down's A have the same shape; the nesting tells them apart."""
    model, dirs, x, truth = _case(tmp_path, H=32, I=32)
    w = load_peft(dirs)["model.layers.0.mlp.experts"]
    assert _error(_run(model, w, x, schedule="sequential"), truth) < TOL


def test_save_then_load_is_exact_and_peft_reads_the_file(tmp_path):
    model, dirs, x, truth = _case(tmp_path)
    w = load_peft(dirs, pack=False)
    for slot in range(3):
        back = load_peft(save_peft(w, tmp_path / f"saved{slot}", slot=slot), pack=False, slot_rank=8)
        for name in ("w13_lora_a", "w13_lora_b", "w2_lora_a", "w2_lora_b"):
            for ours, again in zip(w["model.layers.0.mlp.experts"][name], back["model.layers.0.mlp.experts"][name]):
                assert torch.equal(ours[slot], again[0]), (slot, name)
    from peft import PeftModel
    reread = PeftModel.from_pretrained(copy.deepcopy(model), tmp_path / "saved1")
    rows = TOKEN_LORA == 1
    with torch.no_grad():
        assert _error(_block(reread)(x[None])[0][rows], truth[rows]) < TOL


class _Expert(torch.nn.Module):
    def __init__(self, H, I, names):
        super().__init__()
        for name, shape in zip(names, ((I, H), (I, H), (H, I))):
            setattr(self, name, torch.nn.Linear(shape[1], shape[0], bias=False))
        self.names = names

    def forward(self, x):
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(torch.nn.functional.silu(gate(x)) * up(x))


class _ModuleMoE(torch.nn.Module):
    """An MoE block with one module per expert, as transformers 4.x wrote Mixtral (w1 gate, w3 up, w2 down) and
    OLMoE / Qwen2-MoE (gate_proj, up_proj, down_proj)."""

    def __init__(self, H, I, E, names):
        super().__init__()
        self.experts = torch.nn.ModuleList(_Expert(H, I, names) for _ in range(E))

    def forward(self, x, ids, weights):
        y = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(ids.shape[1]):
                y[t] += weights[t, j] * self.experts[int(ids[t, j])](x[t])
        return y


@pytest.mark.parametrize("names", [("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")], ids=["olmoe", "mixtral"])
def test_per_expert_module_adapters_match_peft(names):
    H, I, E, k = 32, 24, 6, 2
    torch.manual_seed(0)
    block = _ModuleMoE(H, I, E, names)
    states, models = [], []
    for spec in SPECS:
        config = LoraConfig(target_modules=list(names), init_lora_weights=False, **spec)
        m = peft.inject_adapter_in_model(config, copy.deepcopy(block))
        for name, p in m.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.3)
        states.append((peft.get_peft_model_state_dict(m), config.to_dict()))
        models.append(m)
    x = torch.randn(len(TOKEN_LORA), H)
    ids = torch.randint(0, E, (len(TOKEN_LORA), k), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    weights = torch.rand(len(TOKEN_LORA), k, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        truth = torch.zeros_like(x)
        for l in TOKEN_LORA.unique().tolist():
            rows = TOKEN_LORA == l
            truth[rows] = (block if l < 0 else models[l])(x, ids, weights)[rows]
    (prefix, w), = load_peft(states, num_experts=E).items()
    assert prefix == "experts" and w["lora_ranks"].tolist() == [4, 8, 6]
    w13 = torch.stack([torch.cat([getattr(e, names[0]).weight, getattr(e, names[1]).weight]) for e in block.experts])
    w2 = torch.stack([getattr(e, names[2]).weight for e in block.experts])
    y = moe_layer_reference(x, ids, weights, TOKEN_LORA, w13.detach(), w2.detach(), w["w13_lora_a"], w["w13_lora_b"],
                            w["w2_lora_a"], w["w2_lora_b"])
    assert _error(y, truth) < TOL


def _config(**changes):
    return {**dict(peft_type="LORA", r=4, lora_alpha=8, target_parameters=TARGETS), **changes}


@pytest.mark.parametrize("changes, match", [
    (dict(use_dora=True), "DoRA"), (dict(bias="all"), "bias"), (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(peft_type="IA3"), "only LoRA")])
def test_unsupported_adapters_are_refused_by_name(changes, match):
    with pytest.raises(ValueError, match=match):
        load_peft(({}, _config(**changes)))


def test_errors_name_what_the_file_holds(tmp_path):
    attention = {"model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 8),
                 "model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(8, 4)}
    with pytest.raises(ValueError, match="no LoRA on MoE experts found.*self_attn"):
        load_peft((attention, _config(target_parameters=None, target_modules=["q_proj"])))
    model = _model()
    _, dirs = _adapters(model, tmp_path, SPECS[:1])
    ad = read_peft(dirs[0])
    mixed = (dict(ad.tensors, **attention), ad.config)
    with pytest.raises(ValueError, match="2 tensor\\(s\\) are not LoRA on MoE experts.*others='ignore'"):
        load_peft(mixed)
    assert load_peft(mixed, others="ignore").keys() == load_peft(dirs).keys()
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        load_peft(tmp_path)
    with pytest.raises(ValueError, match="slot_rank: 2 is smaller"):
        load_peft(dirs, slot_rank=2)
    only_down = {k: v for k, v in ad.tensors.items() if "base_layer" not in k}
    with pytest.raises(ValueError, match="nesting depths"):
        load_peft((only_down, ad.config))


# ---- the gallery: converters with the layout bugs seen in real tools; the check must catch every one --------

def _bug(w, which):
    """A copy of the loaded weights with one real-world layout bug (see notebook 07)."""
    w = {k: [t.clone() for t in v] if isinstance(v, list) else v for k, v in w.items()}
    (ga, ua), (gb, ub) = w["w13_lora_a"], w["w13_lora_b"]
    if which == "b_expert_major":            # lora_B read as [out, E, r] instead of [out, r, E]
        for b in (gb, ub, w["w2_lora_b"][0]):
            L, E, N, R = b.shape
            b.copy_(b.permute(0, 2, 3, 1).reshape(L, N, E, R).permute(0, 2, 1, 3).clone())
    elif which == "swap_gate_up":
        w["w13_lora_b"] = [ub, gb]
    elif which == "no_scaling":              # scaling (alpha / r, or / sqrt r) dropped: B as stored
        for b in (gb, ub, w["w2_lora_b"][0]):
            b.div_(w["scaling"][:, None, None, None])
    elif which == "separate_a":              # gate and up each given half of the shared A's rank
        R = ga.shape[2] // 2
        ga[:, :, R:], ua[:, :, :R] = 0, 0
    return w


@pytest.mark.parametrize("which", ["b_expert_major", "swap_gate_up", "no_scaling", "separate_a"])
def test_the_check_catches_every_layout_bug(tmp_path, which):
    model, dirs, x, truth = _case(tmp_path)
    w = load_peft(dirs, pack=False)["model.layers.0.mlp.experts"]
    scaling = []
    for spec in SPECS:
        scaling.append(spec["lora_alpha"] / (spec["r"] ** 0.5 if spec.get("use_rslora") else spec["r"]))
    w["scaling"] = torch.tensor(scaling)
    assert _error(_run(model, w, x, reference=True), truth) < TOL
    assert _error(_run(model, _bug(w, which), x, reference=True), truth) > 100 * TOL


def test_saved_config_is_peft_readable(tmp_path):
    model = _model()
    _, dirs = _adapters(model, tmp_path, SPECS[:1])
    folder = save_peft(load_peft(dirs), tmp_path / "out")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert LoraConfig(**{k: v for k, v in config.items() if k != "peft_type"}).target_parameters == TARGETS
