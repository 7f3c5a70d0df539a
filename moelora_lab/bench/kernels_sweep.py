"""``python -m moelora_lab.bench kernels``: the LoRA op's paths x presets x {w13, w2} x M x rank.

Each path of a case is first checked against the reference (``moe_lora_reference``), then timed the
way ``profile.timing`` describes (CUDA graph, L2 flushed, median and 20/80 percentiles; the paths of
a case in interleaved rounds, so a drift of the GPU lands on all of them) and written to a CSV with
provenance, plus plots drawn from that CSV. Achieved
bandwidth is the byte model's minimum bytes for the path over the time, next to a copy ceiling
measured in the same run. ``--tune`` times a grid of one-shot / two-kernel tiles per case instead
of the default configs; ``--time-alignment`` also times the routing metadata.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, K in, N out, S slices.
"""
from __future__ import annotations

import sys

import torch

from ..routing.device import make_blocks
from ..config import MoEShape, random_lora_weights
from ..op.dispatch import choose_config
from ..op.face import moe_lora
from ..op.paths import KERNEL_CHOICES, PATHS, resolve_path
from ..profile import timing
from ..profile.traffic import count_workload, lora_op_traffic
from ..reference import moe_lora_reference
from ..routing.host import block_list
from .common import close, device, progress, seeded_generator, sweep_parser, sweep_routing

NAME = "kernels"
ROUNDS = 3              # the paths of a case are timed in interleaved rounds (``timing.time_cuda_interleaved``)


def add_parser(sub):
    k = sweep_parser(sub, NAME, "LoRA op paths x presets x M x rank", name="kernels",
                     presets=("qwen3-30b-a3b", "deepseek-v2-lite"), tokens=(1, 8, 32, 128, 512, 2048, 8192),
                     ranks=(16, 64, 128, 256))
    k.add_argument("--ops", nargs="+", choices=["w13", "w2"], default=["w13", "w2"],
                   help="projections: w13 (gate and up), w2 (down) (default: both)")
    k.add_argument("--paths", nargs="+", choices=KERNEL_CHOICES, default=list(KERNEL_CHOICES),
                   help="LoRA paths to time, auto included (default: all)")
    k.add_argument("--small-batch-max-tokens", type=int, default=512,
                   help="skip the per-pair kernel above this M (it re-reads weights per pair)")
    k.add_argument("--time-alignment", action="store_true", help="also time block_list() per case")
    k.add_argument("--tune", action="store_true", help="time a grid of one-shot / two-kernel tiles per case")


def _variants(args):
    """(path, config override) pairs to time: the default configs, or a tuning grid with ``--tune``."""
    if not args.tune:
        return [(path, {}) for path in args.paths]
    grid = [("one_shot", dict(n_chunks=c, block_n=bn)) for bn in (64, 128) for c in (1, 2, 4, 8, 16, 32)]
    return grid + [("two_kernel", dict(block_n=bn)) for bn in (64, 128)]


def _timing_row(t) -> dict:
    return dict(us_median=round(t.median_us, 2), us_p20=round(t.p20_us, 2), us_p80=round(t.p80_us, 2))


def _check(runs, out, delta, case: str) -> None:
    """Each run's output (it adds into ``out``) against ``out`` + the reference's ``delta``, from the same
    ``out`` each time, before anything is timed: a path or tile that computes a wrong result stops the sweep."""
    base = out.clone()
    want = base.float() + delta
    for path, real, cfg, fn in runs:
        out.copy_(base)
        got = fn().float()
        if not close(got, want):
            raise RuntimeError(f"{case}: path {path!r} (ran {real}, {cfg}) differs from the reference by up to "
                               f"{float((got - want).abs().max()):.3g}")
    out.copy_(base)


def run(args) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    prov = timing.provenance(args.command)
    copy_bps, flops_per_s = timing.copy_bandwidth(), timing.matmul_rate(dtype)
    ceilings = dict(copy_tbps=round(copy_bps / 1e12, 4), matmul_tflops=round(flops_per_s / 1e12, 1))
    print(f"{prov['gpu']}: copy ceiling {ceilings['copy_tbps']:.3f} TB/s, {args.dtype} matmul "
          f"{ceilings['matmul_tflops']} TFLOP/s", file=sys.stderr)
    gen = seeded_generator(args.seed)
    rows = []
    cases = [(MoEShape.from_name(p), r, op) for p in args.presets for r in args.ranks for op in args.ops]
    bar = progress(total=len(cases) * len(args.tokens), desc="kernels", unit="case")
    for shape, rank, op in cases:
        L, E, k = args.loras, shape.num_experts, shape.top_k
        lora_a, lora_b = random_lora_weights(shape, op, L, rank, gen, dtype)
        k_in, n_out, S = lora_a[0].shape[3], lora_b[0].shape[2], len(lora_a)
        for M in args.tokens:
            bar.update()
            runs, work, inputs = build_case(shape, op, rank, M, lora_a, lora_b, args, gen, dtype)
            case, x = dict(preset=shape.name, op=op), inputs["x"]
            timed = timing.time_cuda_interleaved({i: run[3] for i, run in enumerate(runs)}, rounds=ROUNDS)
            for i, (path, real, cfg, _) in enumerate(runs):
                t = timed[i]
                if not isinstance(t, timing.Timing):
                    raise t                             # a path that cannot run here is a bug, not a data point
                traffic = lora_op_traffic(real, work, in_features=k_in, out_features=n_out, num_slices=S,
                                          rank=rank, x_rows="token" if op == "w13" else "pair",
                                          dtype_bytes=x.element_size(), add_inputs=True)
                rows.append(dict(
                    **case, path=path, ran=real, M=M, rank=rank, loras=L, dtype=args.dtype,
                    block_m=cfg.block_m, block_n=cfg.block_n, n_chunks=cfg.n_chunks, **_timing_row(t),
                    bytes=traffic.bytes, flops=traffic.flops, floor_us=round(traffic.floor_us(copy_bps), 2),
                    achieved_tbps=round(traffic.bytes / (t.median_us * 1e-6) / 1e12, 4), **ceilings, **prov))
            if args.time_alignment:
                cfg = choose_config("one_shot", M * k, inputs["groups"], n_out, S, x.device)
                t = timing.time_cuda(lambda: make_blocks(inputs["topk_ids"], inputs["token_lora"], E, L, cfg.block_m))
                rows.append(dict(**case, path="align", ran="align", M=M, rank=rank, loras=L, dtype=args.dtype,
                                 block_m=cfg.block_m, block_n=0, n_chunks=1, **_timing_row(t), bytes=0, flops=0,
                                 floor_us=0, achieved_tbps=0, **ceilings, **prov))
        del lora_a, lora_b
        torch.cuda.empty_cache()
    bar.close()
    return rows


def build_case(shape, op: str, rank: int, M: int, lora_a, lora_b, args, gen, dtype):
    """One case of the sweep, checked: [(path, the op it runs, its config, the call)], the workload, and the
    inputs (x, topk_ids, token_lora, and the (adapter, expert) groups the pairs touch). Every run adds into
    the same ``out`` and has been checked against the reference (``_check``), so a path or tile that
    computes a wrong result stops the sweep before it is measured."""
    L, E, k = args.loras, shape.num_experts, shape.top_k
    k_in, n_out, S = lora_a[0].shape[3], lora_b[0].shape[2], len(lora_a)
    topk_ids, topk_w, token_lora = sweep_routing(shape, L, M, args.seed, args.adapters)
    rows_in = M if op == "w13" else M * k
    x = torch.randn(rows_in, k_in, device=device(), generator=gen, dtype=dtype)
    out = torch.randn(M, k, S * n_out, device=device(), generator=gen, dtype=dtype)
    work = count_workload(topk_ids, token_lora, E, L)
    groups = min(M * k, work.touched_adapter_experts or 1)
    runs = []
    for path, override in _variants(args):
        if path == "small_batch" and M > args.small_batch_max_tokens:
            continue
        real = resolve_path(path, num_pairs=M * k, num_experts=E, num_loras=L, rank=rank, add_inputs=True,
                            token_rows=op == "w13", n_out=n_out)
        cfg = choose_config(real, M * k, groups, n_out, S, x.device, rank=rank).replace(**override)
        blocks = None if not PATHS[real].uses_blocks else block_list(topk_ids, token_lora, E, L, cfg.block_m)
        runs.append((path, real, cfg, lambda real=real, cfg=cfg, blocks=blocks: moe_lora(
            x, topk_ids, topk_w, token_lora, lora_a, lora_b, path=real, mul_routed_weight=op == "w2",
            output=out, add_inputs=True, blocks=blocks, config=cfg)))
    _check(runs, out, moe_lora_reference(x, topk_ids, topk_w, token_lora, lora_a, lora_b,
                                         mul_routed_weight=op == "w2"), f"{shape.name} {op} M={M} r={rank}")
    return runs, work, dict(x=x, topk_ids=topk_ids, token_lora=token_lora, groups=groups)


def save_plots(rows, args) -> list:
    """The kernel plots next to the CSV (none for a ``--tune`` grid, or where matplotlib is missing)."""
    if args.tune:
        return []
    try:
        from ..plots.bench import save_kernel_plots   # imported here: matplotlib is only needed for plots
        return save_kernel_plots(rows, args.out, args.name)
    except ImportError as exc:   # plots are optional on a headless machine without matplotlib
        print(f"plots skipped: {exc}", file=sys.stderr)
        return []
