"""Training several LoRA adapters at once through the MoE layer, and the same training done by PEFT one adapter
at a time: the loss curves agree, and PEFT reads the trained adapters back.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, H hidden, I expert intermediate, V vocabulary.

Why one joint run equals L separate ones:

* the tokens of a batch never meet in an MoE block (the router and the experts act per token), and the joint
  loss is the SUM over adapters of each adapter's MEAN loss over its own tokens, so the gradient of adapter l's
  weights is the gradient of its own loss alone (tokens without an adapter add no LoRA gradient);
* AdamW and SGD update every element from its own gradient and state, so one optimizer over the stacked
  slots [L, E, ...] takes the steps L optimizers take, one per adapter;
* the trainable tensors hold PEFT's numbers (A, and B BEFORE the scaling s, which the forward applies:
  B_lab = s B), only laid out as the lab's slots (``moelora_lab.adapters``), so the optimizer sees PEFT's values.

What remains is rounding: the lab adds s B (A x) to W x, PEFT multiplies x by W + s B A.

The model: a transformers Qwen3-MoE block with random weights (``peft_grads.moe_block``; nothing is
downloaded), tokens x ~ N(0, 1) routed by its router. Loss "mse": each token regresses onto the plain block's
output plus noise of the same size; "ce": logits y @ head^T (a fixed random head [V, H]) against random labels.
"""
from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from ..adapters import load_peft, save_peft
from ..adapters.files import rank_of, scaling
from ..config import MoEShape
from ..validate import check_choice, check_int
from .peft_grads import PARAMS, _needs, adapter_names, adapter_states, choose_layer, lora_factors, moe_block, \
    peft_adapters, route_block

LOSSES = ("mse", "ce")
OPTIMIZERS = ("adamw", "sgd")
VOCAB = 64


@dataclass
class TrainSetup:
    """Everything both trainings share: the block, each adapter's initial PEFT state, the batch, the loss and
    the optimizer's settings. x [M, H]; token_lora [M] (-1: no adapter); target [M, H] ("mse") or labels [M]
    ("ce", with head [V, H]); topk_ids / topk_weights [M, k] from the block's router."""

    block: torch.nn.Module
    specs: list
    init: list
    x: torch.Tensor
    token_lora: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    loss: str
    target: torch.Tensor
    head: torch.Tensor | None
    optimizer: str
    lr: float
    weight_decay: float
    momentum: float

    @property
    def num_adapters(self) -> int:
        return len(self.specs)

    def token_losses(self, y: torch.Tensor, rows=None) -> torch.Tensor:
        """Each token's loss [M] (or [rows]) of the block's output y."""
        target = self.target if rows is None else self.target[rows]
        if self.loss == "mse":
            return ((y - target) ** 2).mean(dim=-1)
        return torch.nn.functional.cross_entropy(y @ self.head.T, target, reduction="none")

    def make_optimizer(self, params):
        if self.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)


def make_setup(shape: MoEShape | str = "tiny", *, num_tokens: int = 32, ranks=(4, 4), alphas=None,
               no_adapter_tokens: int = 0, loss: str = "mse", optimizer: str = "adamw", lr: float = 1e-2,
               weight_decay: float = 0.0, momentum: float = 0.0, b_std: float = 0.0, seed: int = 0,
               device="cpu") -> TrainSetup:
    """A block, L = len(ranks) adapters (PEFT's init; alpha defaults to 2r; B ~ N(0, b_std^2) if b_std > 0)
    and a batch of ``num_tokens`` tokens shared evenly by the adapters plus ``no_adapter_tokens`` without one,
    in a random order."""
    check_choice("loss", loss, LOSSES)
    check_choice("optimizer", optimizer, OPTIMIZERS)
    ranks = [check_int(f"ranks[{i}]", r, low=1) for i, r in enumerate(ranks)]
    L = len(ranks)
    if L == 0:
        raise ValueError("ranks: empty; give one rank per adapter, e.g. ranks=(4, 4)")
    alphas = [2.0 * r for r in ranks] if alphas is None else list(alphas)
    if len(alphas) != L:
        raise ValueError(f"alphas: {len(alphas)} values for {L} adapters; give one per rank, or None for 2r")
    check_int("num_tokens", num_tokens, low=L)
    check_int("no_adapter_tokens", no_adapter_tokens, low=0)
    if not lr > 0:
        raise ValueError(f"lr: expected a positive learning rate, got {lr!r}")
    block = moe_block(shape, seed=seed, device=device)
    specs = [dict(r=r, lora_alpha=a) for r, a in zip(ranks, alphas)]
    init = adapter_states(peft_adapters(block, specs, seed=seed + 1, b_std=b_std))
    gen, H = torch.Generator().manual_seed(seed + 2), block.experts.hidden_dim
    slots = torch.cat([torch.arange(num_tokens) % L, torch.full((no_adapter_tokens,), -1)])
    token_lora = slots[torch.randperm(len(slots), generator=gen)].to(device)
    x = torch.randn(len(slots), H, generator=gen).to(device)
    with torch.no_grad():
        plain = block(x[None])[0]                                          # [M, H]
    head = None
    if loss == "mse":
        target = plain + plain.std() * torch.randn(plain.shape, generator=gen).to(device)
    else:
        head = (torch.randn(VOCAB, H, generator=gen) * 4 / H ** 0.5).to(device)
        target = torch.randint(0, VOCAB, (len(slots),), generator=gen).to(device)
    ids, weights = route_block(block, x)
    return TrainSetup(block, specs, init, x, token_lora, ids, weights, loss, target, head, optimizer, lr,
                      weight_decay, momentum)


@dataclass
class StackedLoRA:
    """The trainable LoRA of L adapters in the lab's slots, holding PEFT's values: a13 [L, E, r, H] (gate_up's
    one A), b13 [L, E, 2I, r] (gate rows, then up rows), a2 [L, E, r, I], b2 [L, E, H, r], B unscaled; scale13 /
    scale2 [L] PEFT's scalings; ranks [L]; prefix the layer's name in the adapter files."""

    a13: torch.Tensor
    b13: torch.Tensor
    a2: torch.Tensor
    b2: torch.Tensor
    scale13: torch.Tensor
    scale2: torch.Tensor
    ranks: torch.Tensor
    prefix: str

    @classmethod
    def from_peft(cls, states, *, num_experts: int, device=None) -> "StackedLoRA":
        """From (state_dict, config) pairs of one MoE layer: ``load_peft`` with every scaling set to 1 (so B
        arrives exactly as PEFT holds it), and the scalings read from the configs."""
        unscaled, scales = [], {p: [] for p in PARAMS}
        for state, config in states:
            patterns = config.get("rank_pattern") or {}
            unscaled.append((state, dict(config, lora_alpha=config.get("r", 8), use_rslora=False,
                                         alpha_pattern=dict(patterns))))
        layers = load_peft(unscaled, num_experts=num_experts, pack=False, device=device)
        if len(layers) != 1:
            raise ValueError(f"states: adapt {len(layers)} MoE layers ({sorted(layers)[:3]}); training takes one")
        (prefix, w), = layers.items()
        for state, config in states:
            for p in PARAMS:
                key = f"{prefix}.{p}"
                scales[p].append(scaling(config, key, rank_of(config, key)[0]))
        leaves = [t.detach().clone().requires_grad_(True)
                  for t in (w["w13_lora_a"][0], torch.cat(w["w13_lora_b"], dim=2), w["w2_lora_a"][0], w["w2_lora_b"][0])]
        s13, s2 = (torch.tensor(scales[p], dtype=leaves[0].dtype, device=device) for p in PARAMS)
        return cls(*leaves, s13, s2, w["lora_ranks"], prefix)

    def parameters(self) -> list:
        return [self.a13, self.b13, self.a2, self.b2]

    def layer_lora(self) -> tuple[list, list, list, list]:
        """w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b as the layer takes them, B scaled."""
        I = self.b13.shape[2] // 2
        s13, s2 = self.scale13.view(-1, 1, 1, 1), self.scale2.view(-1, 1, 1, 1)
        return ([self.a13, self.a13], [s13 * self.b13[:, :, :I], s13 * self.b13[:, :, I:]], [self.a2],
                [s2 * self.b2])

    def weights(self) -> dict:
        """``load_peft``'s result for these adapters (detached): what ``save_peft`` writes."""
        a13, b13, a2, b2 = ([t.detach() for t in ts] for ts in self.layer_lora())
        return {self.prefix: dict(w13_lora_a=a13, w13_lora_b=b13, w2_lora_a=a2, w2_lora_b=b2, lora_ranks=self.ranks)}


@dataclass
class TrainRun:
    """curves [L, steps]: each adapter's mean loss before each step; outputs [M, H] after the last step."""

    curves: torch.Tensor
    outputs: torch.Tensor
    lora: StackedLoRA | None = None
    model: object = None
    layer: str = "peft"


def _steps(steps: int, progress, desc: str):
    """range(steps), wrapped in a tqdm bar when ``progress`` (None: from 100 steps on) and tqdm is installed."""
    if not (progress or (progress is None and steps >= 100)) or importlib.util.find_spec("tqdm") is None:
        return range(steps)
    from tqdm.auto import tqdm
    return tqdm(range(steps), desc=desc, leave=False)


def _plain_rows(setup: TrainSetup) -> torch.Tensor:
    """[M, H]: the plain block's output on the tokens without an adapter, zeros elsewhere."""
    y = torch.zeros_like(setup.x)
    with torch.no_grad():
        y[setup.token_lora < 0] = setup.block(setup.x[None])[0][setup.token_lora < 0]
    return y


def train_adapters(setup: TrainSetup, steps: int = 20, *, layer_fn=None, progress=None) -> TrainRun:
    """Train all adapters of ``setup`` jointly in ONE batch through ``layer_fn`` (the layer's signature, e.g.
    ``moe_layer_reference``; default ``peft_grads.choose_layer``) with the joint loss sum_l mean(loss over l's
    tokens). Returns a ``TrainRun`` with the curves, the outputs and the trained ``StackedLoRA``."""
    check_int("steps", steps, low=1)
    name = getattr(layer_fn, "__name__", "layer_fn")
    if layer_fn is None:
        layer_fn, name = choose_layer(setup.x.device)
    block, L = setup.block, setup.num_adapters
    lora = StackedLoRA.from_peft(setup.init, num_experts=block.experts.num_experts, device=setup.x.device)
    opt = setup.make_optimizer(lora.parameters())
    w13, w2 = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    rows = [setup.token_lora == l for l in range(L)]
    curves = torch.zeros(L, steps, dtype=torch.float64)

    def forward():
        return layer_fn(setup.x, setup.topk_ids, setup.topk_weights, setup.token_lora, w13, w2, *lora.layer_lora())

    bar = _steps(steps, progress, f"{name}, {L} adapters")
    for step in bar:
        y = forward()
        if not y.requires_grad:
            raise RuntimeError(f"layer_fn: {name}'s output carries no gradient to the LoRA weights; pass a "
                               "differentiable layer such as moelora_lab.moe_layer_reference")
        per_token = setup.token_losses(y)
        losses = torch.stack([per_token[r].mean() for r in rows])          # [L]
        opt.zero_grad()
        losses.sum().backward()
        opt.step()
        curves[:, step] = losses.detach().double().cpu()
        if hasattr(bar, "set_postfix") and step % 10 == 0:
            bar.set_postfix(loss=f"{losses.sum().item():.4g}")
    with torch.no_grad():
        outputs = forward()
    return TrainRun(curves, outputs, lora=lora, layer=name)


def peft_reference_curves(setup: TrainSetup, steps: int = 20, *, progress=None) -> TrainRun:
    """PEFT trains each adapter of ``setup`` on its own, from the same init, on its own tokens, with the same
    optimizer settings. Returns a ``TrainRun`` with the curves, the outputs (each adapter's tokens through it,
    the others through the plain block) and the ``PeftModel`` holding the trained adapters."""
    peft = _needs("peft")
    check_int("steps", steps, low=1)
    model = peft_adapters(setup.block, setup.specs)
    for name, (state, _) in zip(adapter_names(model), setup.init):
        peft.set_peft_model_state_dict(model, state, adapter_name=name)
    curves = torch.zeros(setup.num_adapters, steps, dtype=torch.float64)
    outputs = _plain_rows(setup)
    for l, name in enumerate(adapter_names(model)):
        model.set_adapter(name)
        params = [t.requires_grad_(True) for a, b, _ in lora_factors(model, name).values() for t in (a, b)]
        opt = setup.make_optimizer(params)
        rows = setup.token_lora == l
        xs = setup.x[rows][None]                                            # [1, M_l, H]
        for step in _steps(steps, progress, f"PEFT {name}"):
            loss = setup.token_losses(model(xs)[0], rows).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            curves[l, step] = loss.item()
        with torch.no_grad():
            outputs[rows] = model(xs)[0]
    return TrainRun(curves, outputs, model=model)


def save_adapters(run: TrainRun, folder) -> list[Path]:
    """Write each adapter of a joint run as a PEFT folder ``folder/adapter{l}`` (``save_peft``, alpha = s r so
    the files hold PEFT's B; one scaling per adapter must serve gate_up and down, else alpha = r)."""
    if run.lora is None:
        raise ValueError("run: not a train_adapters result (it holds no StackedLoRA); save a PEFT run with "
                         "run.model.save_pretrained")
    lora, out = run.lora, []
    if not all(torch.isfinite(t).all() for t in lora.parameters()):
        raise ValueError("run: the trained weights hold NaN or inf (the training diverged); train again with a "
                         "smaller lr")
    weights = lora.weights()
    for l in range(len(lora.ranks)):
        s13, s2, r = float(lora.scale13[l]), float(lora.scale2[l]), int(lora.ranks[l])
        alpha = s13 * r if s13 == s2 else None
        out.append(save_peft(weights, Path(folder) / f"adapter{l}", slot=l, lora_alpha=alpha))
    return out


def peft_outputs(setup: TrainSetup, folders) -> torch.Tensor:
    """The block's output [M, H] with adapter l read by PEFT from ``folders[l]`` for the tokens of slot l (and
    the plain block for tokens without an adapter)."""
    peft = _needs("peft")
    model, y = None, _plain_rows(setup)
    with torch.no_grad():
        for l, folder in enumerate(folders):
            if model is None:
                model = peft.PeftModel.from_pretrained(copy.deepcopy(setup.block), str(folder), adapter_name="a0")
            else:
                model.load_adapter(str(folder), adapter_name=f"a{l}")
            model.set_adapter(f"a{l}")
            rows = setup.token_lora == l
            y[rows] = model(setup.x[rows][None])[0]
    return y
