"""``python -m moelora_lab.bench grad``: the LoRA op's backward, path by path (``op.grad_paths.GRAD_PATHS``) x
presets x {w13, w2} x M x rank: the data the backward's ``auto`` rule (``op.grad.choose_grad_path``) is read
against.

Each call computes every gradient the layer asks of the op (x's, the routing weights' on w2, every A and B),
eagerly as a training step runs it (no CUDA graph, the routing's blocks built inside the call): CUDA events with
L2 flushed (``triton.testing.do_bench``), the paths of a case in ``ROUNDS`` interleaved rounds
(``timing.interleave``). Before anything is timed, each path's gradients are checked against the spec
(``reference.moe_lora_backward_reference``, float32 on the same inputs): a path off by more than
``common.close``'s tolerance stops the sweep. ``auto`` is timed as a path of its own, ``ran`` the path it picked.
``bytes`` is the byte model's count of the path that ran (``profile.grad_traffic.grad_op_traffic``),
``floor_bytes`` what every backward must move, ``floor_us`` the floor at the copy rate measured in the same run.
On the CPU (the pipeline's tests) rows carry the wall clock of a few calls, never a GPU's time, and say so in
``device``.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, K in, N out, S slices, P = M*k pairs.
"""
from __future__ import annotations

import sys

import torch

from ..config import MoEShape, random_lora_weights
from ..op.grad import backward_plan, moe_lora_backward
from ..op.grad_paths import GRAD_PATH_CHOICES
from ..profile import timing
from ..profile.grad_traffic import GradWorkload, grad_op_traffic
from ..reference import moe_lora_backward_reference
from .common import close, device, eager_sampler, progress, seeded_generator, sweep_parser, sweep_routing

NAME = "grad"
PATHS = tuple(p for p in GRAD_PATH_CHOICES if p != "reference")     # the Triton paths and auto
ROUNDS = 3
WARMUP_MS, REP_MS = 25.0, 200.0     # do_bench's warm-up in the first round; call time per path, all rounds
CPU_STEPS = 1                       # wall-clock calls per round on the CPU (the pipeline's tests)


def add_parser(sub):
    p = sweep_parser(sub, NAME, "the LoRA op's backward paths x presets x M x rank", name="grad",
                     tokens=(16, 128, 512, 2048, 8192), ranks=(16, 64))
    p.add_argument("--ops", nargs="+", choices=["w13", "w2"], default=["w13", "w2"],
                   help="projections: w13 (gate and up), w2 (down) (default: both)")
    p.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS),
                   help="backward paths to time, auto included (default: all)")
    return p


def _gradients(got) -> list:
    """The gradients of one call, in a fixed order (None where the op computes none)."""
    return [got.x, got.topk_weights, *got.lora_a, *got.lora_b]


def build_case(shape: MoEShape, op: str, rank: int, M: int, lora, args, gen, dtype) -> tuple[dict, dict]:
    """The inputs of one case ({x, topk_ids, topk_weights, token_lora, lora_a, lora_b, grad_out,
    mul_routed_weight}) and the spec's gradients, float32 on the same inputs."""
    lora_a, lora_b = lora
    K, N, S = lora_a[0].shape[3], lora_b[0].shape[2], len(lora_a)
    topk_ids, topk_w, token_lora = sweep_routing(shape, args.loras, M, args.seed, args.adapters)
    rows_in = M if op == "w13" else M * shape.top_k
    inputs = dict(x=torch.randn(rows_in, K, device=device(), generator=gen, dtype=dtype), topk_ids=topk_ids,
                  topk_weights=topk_w, token_lora=token_lora, lora_a=lora_a, lora_b=lora_b,
                  grad_out=torch.randn(M, shape.top_k, S * N, device=device(), generator=gen, dtype=dtype),
                  mul_routed_weight=op == "w2")
    as32 = {n: ([w.float() for w in v] if isinstance(v, list) else v.float() if n in ("x", "grad_out") else v)
            for n, v in inputs.items()}
    return inputs, moe_lora_backward_reference(**as32)


def check_paths(calls: dict, want, case: str) -> None:
    """Every path's gradients against the spec's, before anything is timed; a RuntimeError names the first off."""
    expected = _gradients(want)
    for path, call in calls.items():
        for i, (g, w) in enumerate(zip(_gradients(call()), expected)):
            if (g is None) != (w is None) or (g is not None and not close(g.float(), w)):
                err = "missing" if g is None else f"off by up to {float((g.float() - w).abs().max()):.3g}"
                raise RuntimeError(f"{case}: path {path!r}: gradient {i} (x, topk_weights, A..., B...) is {err}")


def run(args) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    prov = timing.provenance(args.command)
    on_gpu = torch.device(device()).type == "cuda"
    copy_bps = timing.copy_bandwidth()
    print(f"{prov['gpu']}: copy ceiling {copy_bps / 1e12:.3f} TB/s", file=sys.stderr)
    gen = seeded_generator(args.seed)
    rows = []
    cases = [(MoEShape.from_name(p), r, op) for p in args.presets for r in args.ranks for op in args.ops]
    bar = progress(total=len(cases) * len(args.tokens), desc="grad", unit="case")
    for shape, rank, op in cases:
        L, E, k = args.loras, shape.num_experts, shape.top_k
        lora = random_lora_weights(shape, op, L, rank, gen, dtype)
        K, N, S = lora[0][0].shape[3], lora[1][0].shape[2], len(lora[0])
        for M in args.tokens:
            bar.update()
            inputs, want = build_case(shape, op, rank, M, lora, args, gen, dtype)
            calls = {p: (lambda p=p: moe_lora_backward(**inputs, path=p, validate=False)) for p in args.paths}
            name = f"{shape.name} {op} M={M} r={rank}"
            check_paths(calls, want, name)
            sample = eager_sampler(calls, rounds=ROUNDS, warmup_ms=WARMUP_MS, rep_ms=REP_MS, cpu_steps=CPU_STEPS)
            timed = timing.interleave(list(calls), ROUNDS, sample)
            for path in args.paths:
                t = timed[path]
                if not isinstance(t, timing.Timing):
                    raise t                             # a path that cannot run here is a bug, not a data point
                ran, block_m = backward_plan(path, inputs["x"], M * k, L * E, N, S, rank)
                work = GradWorkload.from_routing(inputs["topk_ids"], inputs["token_lora"], E, L, block_m)
                traffic = grad_op_traffic(ran, work, in_features=K, out_features=N, num_slices=S, rank=rank,
                                          x_rows="token" if op == "w13" else "pair",
                                          dtype_bytes=inputs["x"].element_size(), mul_routed_weight=op == "w2")
                rows.append(dict(
                    preset=shape.name, op=op, path=path, ran=ran, M=M, rank=rank, loras=L, dtype=args.dtype,
                    block_m=block_m, us_median=round(t.median_us, 2), us_p20=round(t.p20_us, 2),
                    us_p80=round(t.p80_us, 2), bytes=traffic.total.bytes, floor_bytes=traffic.floor.bytes,
                    floor_us=round(traffic.floor.floor_us(copy_bps), 2),
                    achieved_tbps=round(traffic.total.bytes / (t.median_us * 1e-6) / 1e12, 4),
                    copy_tbps=round(copy_bps / 1e12, 4), device=prov["gpu"] if on_gpu else "cpu", **prov))
        del lora
        if on_gpu:
            torch.cuda.empty_cache()
    bar.close()
    return rows
