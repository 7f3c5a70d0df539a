"""``python -m moelora_lab.train``: train two LoRA adapters jointly in one batch through the MoE layer, train them
again with PEFT one at a time, and print both loss curves.

    python -m moelora_lab.train --steps 50                                   # tiny block, on the CPU
    python -m moelora_lab.train --steps 200 --device cuda --shape qwen3-30b-a3b --tokens 512

Every shape is a transformers Qwen3-MoE block with RANDOM weights of that preset's layer shape (qwen3-30b-a3b:
hidden 2048, moe intermediate 768, 128 experts, top-8): nothing is downloaded. The real model's weights would
change the numbers, not the agreement the run checks. In float32 the block of qwen3-30b-a3b takes 2.4 GB,
and the PEFT run holds a second copy.
"""
from __future__ import annotations

import argparse
import sys
import tempfile

import torch

from ..config import PRESETS
from ..layer.face import moe_lora_layer
from ..reference import moe_layer_reference
from .loop import LOSSES, OPTIMIZERS, make_setup, peft_outputs, peft_reference_curves, save_adapters, \
    train_adapters
from .peft_grads import choose_layer, relative_error


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m moelora_lab.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps of each training (default 20)")
    parser.add_argument("--device", default="cpu", help="where the block and the adapters live: cpu or cuda")
    parser.add_argument("--shape", default="tiny", choices=sorted(PRESETS),
                        help="the layer's shape, a preset of moelora_lab.PRESETS with random weights (default tiny)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens with an adapter, shared evenly by the two")
    parser.add_argument("--no-adapter-tokens", type=int, default=0, help="more tokens, served without an adapter")
    parser.add_argument("--ranks", type=int, nargs=2, default=(4, 4), metavar="R", help="rank of each adapter")
    parser.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS, help="the torch optimizer of both runs")
    parser.add_argument("--lr", type=float, default=1e-2, help="learning rate (default 1e-2)")
    parser.add_argument("--weight-decay", type=float, default=0.0, help="weight decay (AdamW: decoupled)")
    parser.add_argument("--momentum", type=float, default=0.0, help="SGD's momentum")
    parser.add_argument("--loss", default="mse", choices=LOSSES,
                        help="mse: regress onto the plain block's output plus noise; ce: a random head and labels")
    parser.add_argument("--layer", default="auto", choices=("auto", "reference", "moe_lora_layer"),
                        help="the joint run's layer; auto: moe_lora_layer if its backward matches the reference "
                             "here, else the reference (on the CPU the kernels run under the Triton interpreter, "
                             "seconds a step even at tiny: the reference is the same math, fast)")
    parser.add_argument("--skip-peft", action="store_true", help="train the joint run only (no PEFT, no files)")
    parser.add_argument("--tol", type=float, default=1e-3,
                        help="largest relative gap between the curves (and reloaded outputs) counted as agreement")
    parser.add_argument("--seed", type=int, default=0, help="seed of the block, the adapters and the batch")
    parser.add_argument("--every", type=int, default=0, help="print every n-th step (default: about 20 lines)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="a tqdm bar per training (default: from 100 steps, when tqdm is installed)")
    return parser


def _table(lab: torch.Tensor, peft: torch.Tensor | None, every: int) -> str:
    L, steps = lab.shape
    cols = [f"a{l} {side}" for l in range(L) for side in (("lab", "peft") if peft is not None else ("lab",))]
    lines = ["step " + " ".join(f"{c:>12}" for c in cols)]
    for s in sorted(set(range(0, steps, every)) | {steps - 1}):
        vals = [v for l in range(L) for v in ((lab[l, s], peft[l, s]) if peft is not None else (lab[l, s],))]
        lines.append(f"{s:4d} " + " ".join(f"{float(v):12.6g}" for v in vals))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("--device cuda: no CUDA GPU here; run on the CPU with --device cpu", file=sys.stderr)
        return 2
    setup = make_setup(args.shape, num_tokens=args.tokens, ranks=args.ranks, no_adapter_tokens=args.no_adapter_tokens,
                       loss=args.loss, optimizer=args.optimizer, lr=args.lr, weight_decay=args.weight_decay,
                       momentum=args.momentum, seed=args.seed, device=args.device)
    layer_fn, name = {"reference": (moe_layer_reference, "moe_layer_reference"),
                      "moe_lora_layer": (moe_lora_layer, "moe_lora_layer")}.get(args.layer) or choose_layer(args.device)
    print(f"shape {args.shape}: {setup.x.shape[0]} tokens, adapters of rank {list(args.ranks)}, {args.optimizer} "
          f"lr {args.lr}, loss {args.loss}, on {args.device}; the joint run goes through {name}")
    run = train_adapters(setup, args.steps, layer_fn=layer_fn, progress=args.progress)
    every = args.every or max(1, args.steps // 20)
    if args.skip_peft or not torch.isfinite(run.curves).all():
        print(_table(run.curves, None, every))
        if not torch.isfinite(run.curves).all():
            print("the joint run diverged (a loss is NaN or inf): try a smaller --lr", file=sys.stderr)
            return 1
        return 0
    ref = peft_reference_curves(setup, args.steps, progress=args.progress)
    print(_table(run.curves, ref.curves, every))
    gap = relative_error(run.curves, ref.curves)
    with tempfile.TemporaryDirectory() as folder:
        reread = peft_outputs(setup, save_adapters(run, folder))
    out_gap = relative_error(run.outputs, reread)
    ok = gap <= args.tol and out_gap <= args.tol
    print(f"joint vs PEFT, largest relative gap of the curves: {gap:.3g}; PEFT reading the saved adapters gives the "
          f"trained outputs to {out_gap:.3g} ({'agree' if ok else 'DIFFER'} at --tol {args.tol:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
