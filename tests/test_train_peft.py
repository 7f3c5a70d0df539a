"""moelora_lab.train against PEFT on a tiny random transformers Qwen3-MoE block (no downloads): the LoRA gradients
of the MoE layer equal PEFT's own autograd, two adapters trained jointly in one batch follow PEFT training each one
alone, and PEFT reads the trained adapters back. The reference layer runs on the CPU; whatever runs the kernels
(``moe_lora_layer``) runs on the test device (CPU interpreter, or CUDA with --gpu), PEFT beside it."""
import dataclasses
import functools

import pytest
import torch

from moelora_lab import moe_layer_reference, moe_lora_layer  # first: it picks the interpreter before triton loads

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from safetensors.torch import load_file  # noqa: E402

from moelora_lab.train import __main__ as train_cli  # noqa: E402
from moelora_lab.train.loop import (make_setup, peft_outputs, peft_reference_curves,  # noqa: E402
                                    save_adapters, train_adapters)
from moelora_lab.train.peft_grads import (_probe, check_grads_against_peft, choose_layer,  # noqa: E402
                                          grads_in_peft_layout, lab_lora_grads, lora_factors, moe_block,
                                          peft_adapters, peft_lora_grads, relative_error)

# transformers and peft warn about their own deprecations, and about a bare block without a model config
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning", "ignore::UserWarning")
TOL = 1e-4                                   # fp32, relative to the largest value (fp32 dots are IEEE on a GPU too)
# rank 4 with scaling 2, rank 2 with rslora (scaling 3 / sqrt(2)): the stack pads slot 1 and unscales two ways
SPECS = [dict(r=4, lora_alpha=8), dict(r=2, lora_alpha=3, use_rslora=True)]
TOKEN_LORA = torch.tensor([0, 1, -1, 0, 1, 1, 0, -1, 1, 0, 0, 1])


@functools.cache
def _case(device: str):
    """(block, PEFT model, x, token_lora, grad_out) on ``device``, made once per device (same values on each)."""
    block = moe_block("tiny", seed=0, device=device)
    model = peft_adapters(block, SPECS, seed=1, b_std=0.3)          # B random: every factor gets a gradient
    x = torch.randn(len(TOKEN_LORA), 64, generator=torch.Generator().manual_seed(2)).to(device)
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(device)
    return block, model, x, TOKEN_LORA.to(device), grad_out


@pytest.fixture
def case():
    return _case("cpu")


@pytest.mark.parametrize("layer_fn, pack", [(moe_layer_reference, False), (moe_lora_layer, True)],
                         ids=["reference", "moe_lora_layer-packed-b"])
def test_lab_gradients_equal_pefts_in_pefts_layout(device, layer_fn, pack):
    block, model, x, token_lora, grad_out = _case(device if layer_fn is moe_lora_layer else "cpu")
    errors = check_grads_against_peft(model, block, x, token_lora, grad_out, layer_fn=layer_fn, pack=pack)
    assert len(errors) == 2 * 2 * 2                                   # adapters x parameters x (A, B)
    assert max(errors.values()) <= TOL, errors
    for grads in peft_lora_grads(model, x, token_lora, grad_out):     # the check compared real gradients
        assert all(g.abs().max() > 0 for pair in grads.values() for g in pair)


def test_a_wrong_mapping_back_to_peft_is_caught(case):
    block, model, x, _, grad_out = case
    truth = peft_lora_grads(model, x, TOKEN_LORA, grad_out)[1]        # slot 1: rank 2, padded to 4 in the stack
    from moelora_lab.adapters import load_peft
    from moelora_lab.train.peft_grads import adapter_states
    (_, weights), = load_peft(adapter_states(model), num_experts=8, pack=False).items()
    lab = lab_lora_grads(block, weights, x, TOKEN_LORA, grad_out, layer_fn=moe_layer_reference)
    lab = {k: [g[:, :, :2] if k.endswith("_a") else g[..., :2] for g in gs] for k, gs in lab.items()}
    scales = {p: s for p, (_, _, s) in lora_factors(model, "a1").items()}
    right = grads_in_peft_layout(lab, 1, scales)
    assert max(relative_error(right[p][i], truth[p][i]) for p in right for i in (0, 1)) <= TOL
    unscaled = grads_in_peft_layout(lab, 1, {p: 1.0 for p in scales})             # dB_peft = dB_lab: no
    assert relative_error(unscaled["down_proj"][1], truth["down_proj"][1]) > 0.1
    db = lab["w2_lora_b"][0][1]                                                   # [E, H, r]
    expert_major = scales["down_proj"] * db.permute(1, 0, 2).reshape(db.shape[1], -1)   # column e*r + i: no
    assert relative_error(expert_major, truth["down_proj"][1]) > 0.1
    gate_only = lab["w13_lora_a"][0][1].reshape(-1, 64)                           # forgets up's share of A
    assert relative_error(gate_only, truth["gate_up_proj"][0]) > 0.1


@pytest.mark.parametrize("settings", [
    dict(optimizer="adamw", lr=1e-2, weight_decay=0.1, loss="mse", ranks=(4, 2), alphas=(8.0, 3.0),
         no_adapter_tokens=6),
    dict(optimizer="sgd", lr=0.05, momentum=0.9, loss="ce", ranks=(2, 2), b_std=0.1),
], ids=["adamw-mse", "sgd-momentum-ce"])
def test_joint_training_follows_peft_training_each_adapter_alone(tmp_path, settings):
    setup = make_setup("tiny", num_tokens=16, seed=4, **settings)
    run = train_adapters(setup, 6, layer_fn=moe_layer_reference)
    ref = peft_reference_curves(setup, 6)
    assert run.curves.shape == ref.curves.shape == (2, 6)
    assert (run.curves[:, -1] < run.curves[:, 0]).all()                  # both adapters learned
    assert relative_error(run.curves, ref.curves) <= TOL
    assert relative_error(run.outputs, ref.outputs) <= TOL
    folders = save_adapters(run, tmp_path)
    assert relative_error(peft_outputs(setup, folders), run.outputs) <= TOL   # PEFT reads them back
    for l, folder in enumerate(folders):                                  # and the files hold PEFT's own tensors
        saved = load_file(folder / "adapter_model.safetensors")
        nest = {"gate_up_proj": "base_layer.", "down_proj": ""}
        for param, (a, b, _) in lora_factors(ref.model, f"a{l}").items():
            key = f"base_model.model.experts.{nest[param]}lora_"
            assert relative_error(saved[key + "A.weight"], a.detach()) <= TOL
            assert relative_error(saved[key + "B.weight"], b.detach()) <= TOL


def test_joint_training_through_moe_lora_layer_follows_peft(device):
    setup = make_setup("tiny", num_tokens=8, ranks=(2, 2), no_adapter_tokens=2, seed=5, device=device)
    run = train_adapters(setup, 2, layer_fn=moe_lora_layer)
    assert run.layer == "moe_lora_layer"
    assert relative_error(run.curves, peft_reference_curves(setup, 2).curves) <= TOL


def test_the_curve_check_tells_other_settings_apart():
    setup = make_setup("tiny", num_tokens=16, seed=4)
    run = train_adapters(setup, 6, layer_fn=moe_layer_reference)
    assert relative_error(run.curves, peft_reference_curves(dataclasses.replace(setup, lr=2 * setup.lr), 6).curves) > 1e-3


def test_choose_layer_takes_the_kernels_only_when_their_gradients_are_right(device):
    cpu = torch.device("cpu")                  # the reference against itself: 0 only where its sums have one order
    assert _probe(moe_layer_reference, cpu) == 0
    assert _probe(lambda *a: moe_layer_reference(*a).detach(), cpu) == float("inf")
    assert _probe(lambda *a: moe_layer_reference(*a) * 1.001, cpu) > TOL
    assert _probe(moe_lora_layer, torch.device(device)) <= TOL          # the kernels' gradients are right here
    assert choose_layer(device) == (moe_lora_layer, "moe_lora_layer")


def test_bad_arguments_are_named(tmp_path):
    for kw, error, match in ((dict(loss="l1"), ValueError, r"^loss: 'l1'"),
                             (dict(optimizer="adam"), ValueError, r"^optimizer: 'adam'"),
                             (dict(ranks=()), ValueError, r"^ranks: empty"),
                             (dict(ranks=(4, 0)), ValueError, r"^ranks\[1\]: must be >= 1"),
                             (dict(alphas=(1.0,)), ValueError, r"^alphas: 1 values for 2 adapters"),
                             (dict(lr=0.0), ValueError, r"^lr: expected a positive"),
                             (dict(num_tokens=1), ValueError, r"^num_tokens: must be >= 2")):
        with pytest.raises(error, match=match):
            make_setup("tiny", **kw)
    setup = make_setup("tiny", num_tokens=4)
    with pytest.raises(ValueError, match=r"^steps: must be >= 1"):
        train_adapters(setup, 0, layer_fn=moe_layer_reference)
    with pytest.raises(RuntimeError, match=r"^layer_fn: .* carries no gradient"):
        train_adapters(setup, 1, layer_fn=lambda *a: moe_layer_reference(*a).detach())
    with pytest.raises(ValueError, match=r"^run: not a train_adapters result"):
        save_adapters(peft_reference_curves(setup, 1), tmp_path)
    run = train_adapters(setup, 1, layer_fn=moe_layer_reference)
    with torch.no_grad():
        run.lora.b2[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"^run: the trained weights hold NaN"):
        save_adapters(run, tmp_path)


def test_command_line_prints_both_curves_and_agrees(capsys):
    assert train_cli.main(["--steps", "3", "--layer", "reference", "--no-progress", "--tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "a0 lab" in out and "a1 peft" in out and "(agree at --tol" in out
    assert train_cli.main(["--steps", "3", "--layer", "reference", "--no-progress", "--optimizer", "sgd", "--lr", "1e8"]) == 1
