"""Benchmark CLI: ``python -m moelora_lab.bench kernels``.

Sweeps paths x presets x {w13, w2} x M x rank on a CUDA GPU, timing each op the way
``profile.timing`` describes (CUDA graph, L2 flushed, median and 20/80 percentiles), and writes a
CSV with provenance plus plots drawn from that CSV. Achieved bandwidth is the byte model's
minimum bytes for the path over the time, next to a copy ceiling measured in the same run.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, K in, N out, S slices.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

from .paths import KERNEL_CHOICES, PATHS, resolve_path
from .results import DATA_DIR as DEFAULT_OUT, read_csv, write_csv  # noqa: F401  (read_csv: re-exported)

DEVICE = "cuda"   # the benchmarks run on CUDA; tests point this at the CPU to run the pipeline end to end


def device() -> str:
    return DEVICE
KERNEL_PATHS = KERNEL_CHOICES                # from the table of paths (paths.PATHS)


def sweep_routing(shape, num_loras: int, M: int, seed: int):
    """(topk_ids, topk_weights, token_lora) of the benchmarks' M tokens: min(M, 8) sequences, seed + M."""
    from .config import make_routing
    r = make_routing(shape, num_loras, M, seed=seed + M, num_sequences=min(M, 8))
    return tuple(r[n].to(device()) for n in ("topk_ids", "topk_weights", "token_lora"))


def _lora_weights(shape, op, num_loras, rank, dtype, gen):
    """Random A [L, E, r, K] and B [L, E, N, r] for the w13 (2 slices) or w2 (1 slice) op, on the GPU."""
    H, I, E = shape.hidden, shape.intermediate, shape.num_experts
    k_in, n_out, slices = (H, I, 2) if op == "w13" else (I, H, 1)
    a = [torch.randn(num_loras, E, rank, k_in, device=device(), generator=gen, dtype=dtype) / k_in ** 0.5
         for _ in range(slices)]
    b = [torch.randn(num_loras, E, n_out, rank, device=device(), generator=gen, dtype=dtype) / rank ** 0.5
         for _ in range(slices)]
    return a, b


def _variants(args):
    """(path, config override) pairs to time: the default configs, or a tuning grid with ``--tune``."""
    if not getattr(args, "tune", False):
        return [(path, {}) for path in args.paths]
    grid = [("one_shot", dict(n_chunks=c, block_n=bn)) for bn in (64, 128) for c in (1, 2, 4, 8, 16, 32)]
    return grid + [("two_kernel", dict(block_n=bn)) for bn in (64, 128)]


def _kernel_cases(args):
    from .config import MoEShape
    for preset in args.presets:
        shape = MoEShape.from_name(preset)
        for rank in args.ranks:
            for op in args.ops:
                yield shape, rank, op


def run_kernels(args) -> list[dict]:
    from tqdm.auto import tqdm

    from .dispatch import choose_config
    from .ops import moe_lora
    from .profile.timing import copy_bandwidth, matmul_rate, provenance, time_cuda
    from .profile.traffic import count_workload, lora_op_traffic
    from .align import make_blocks
    from .routing import block_list

    dtype = getattr(torch, args.dtype)
    prov = provenance(args.command)
    copy_bps, flops_per_s = copy_bandwidth(), matmul_rate(dtype)
    ceilings = dict(copy_tbps=round(copy_bps / 1e12, 4), matmul_tflops=round(flops_per_s / 1e12, 1))
    print(f"{prov['gpu']}: copy ceiling {ceilings['copy_tbps']:.3f} TB/s, {args.dtype} matmul "
          f"{ceilings['matmul_tflops']} TFLOP/s", file=sys.stderr)
    gen = torch.Generator(device=device()).manual_seed(args.seed)
    rows = []
    cases = list(_kernel_cases(args))
    bar = tqdm(total=len(cases) * len(args.tokens), desc="kernels", unit="case")
    for shape, rank, op in cases:
        L, E, k = args.loras, shape.num_experts, shape.top_k
        lora_a, lora_b = _lora_weights(shape, op, L, rank, dtype, gen)
        k_in, n_out, S = lora_a[0].shape[3], lora_b[0].shape[2], len(lora_a)
        for M in args.tokens:
            bar.update()
            topk_ids, topk_w, token_lora = sweep_routing(shape, L, M, args.seed)
            rows_in = M if op == "w13" else M * k
            x = torch.randn(rows_in, k_in, device=device(), generator=gen, dtype=dtype)
            out = torch.randn(M, k, S * n_out, device=device(), generator=gen, dtype=dtype)
            work = count_workload(topk_ids, token_lora, E, L)
            mul = op == "w2"
            for path, override in _variants(args):
                if path == "small_batch" and M > args.small_batch_max_tokens:
                    continue
                real = resolve_path(path, num_pairs=M * k, num_experts=E, num_loras=L, rank=rank, add_inputs=True,
                                    token_rows=op == "w13")
                cfg = choose_config(real, M * k, min(M * k, work.touched_adapter_experts or 1), n_out, S,
                                    x.device, rank=rank).replace(**override)
                blocks = None if not PATHS[real].uses_blocks else block_list(topk_ids, token_lora, E, L, cfg.block_m)

                def fn():
                    moe_lora(x, topk_ids, topk_w, token_lora, lora_a, lora_b, path=real, mul_routed_weight=mul,
                             output=out, add_inputs=True, blocks=blocks, config=cfg)

                t = time_cuda(fn)
                traffic = lora_op_traffic(real, work, in_features=k_in, out_features=n_out, num_slices=S,
                                          rank=rank, x_rows="token" if op == "w13" else "pair",
                                          dtype_bytes=x.element_size(), add_inputs=True)
                rows.append(dict(
                    preset=shape.name, op=op, path=path, ran=real, M=M, rank=rank, loras=L, dtype=args.dtype,
                    block_m=cfg.block_m, block_n=cfg.block_n, n_chunks=cfg.n_chunks,
                    us_median=round(t.median_us, 2),
                    us_p20=round(t.p20_us, 2), us_p80=round(t.p80_us, 2), bytes=traffic.bytes,
                    flops=traffic.flops, floor_us=round(traffic.floor_us(copy_bps), 2),
                    achieved_tbps=round(traffic.bytes / (t.median_us * 1e-6) / 1e12, 4), **ceilings, **prov))
            if args.time_alignment:
                cfg = choose_config("one_shot", M * k, min(M * k, work.touched_adapter_experts or 1), n_out, S,
                                    x.device)
                t = time_cuda(lambda: make_blocks(topk_ids, token_lora, E, L, cfg.block_m))
                rows.append(dict(preset=shape.name, op=op, path="align", ran="align", M=M, rank=rank, loras=L,
                                 dtype=args.dtype, block_m=cfg.block_m, block_n=0, n_chunks=1,
                                 us_median=round(t.median_us, 2), us_p20=round(t.p20_us, 2),
                                 us_p80=round(t.p80_us, 2), bytes=0, flops=0, floor_us=0, achieved_tbps=0,
                                 **ceilings, **prov))
        del lora_a, lora_b
        torch.cuda.empty_cache()
    bar.close()
    return rows


def run_registers(args) -> list[dict]:
    """Compile the one-shot kernel across ranks, with and without rank tiling, and read its resources."""
    from tqdm.auto import tqdm

    from .profile.report import one_shot_report
    from .profile.timing import provenance

    prov = provenance(args.command)
    rows = []
    cases = [(r, bm, mbr) for r in args.ranks for bm in args.block_m for mbr in args.max_block_r]
    for rank, block_m, max_block_r in tqdm(cases, desc="compile", unit="kernel"):
        try:
            rep = one_shot_report(rank, block_m=block_m, max_block_r=max_block_r).as_dict()
            error = ""
        except Exception as exc:  # an out-of-resources compile is a result here, not a crash
            rep, error = {}, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        rows.append(dict(rank=rank, block_m=block_m, max_block_r=max_block_r, n_regs=rep.get("n_regs", ""),
                         n_spills=rep.get("n_spills", ""), shared_bytes=rep.get("shared_bytes", ""),
                         num_warps=rep.get("num_warps", ""), blocks_per_sm=rep.get("blocks_per_sm", ""),
                         occupancy=rep.get("occupancy", ""), error=error, **prov))
    return rows


def run_align(args) -> list[dict]:
    """Routing metadata: the PyTorch spec (``block_list``) against the device kernels."""
    from .align import block_list_device
    from .config import MoEShape
    from .profile.timing import provenance, time_cuda
    from .routing import block_list

    prov = provenance(args.command)
    rows = []
    for preset in args.presets:
        shape = MoEShape.from_name(preset)
        for M in args.tokens:
            ids, _, lora = sweep_routing(shape, args.loras, M, args.seed)
            E, L, bs = shape.num_experts, args.loras, args.block_size
            fns = {"torch_ops": lambda: block_list(ids, lora, E, L, bs),
                   "triton_kernels": lambda: block_list_device(ids, lora, E, L, bs, validate=False)}
            assert all(torch.equal(a, b) for a, b in zip(fns["torch_ops"]().tensors, fns["triton_kernels"]().tensors))
            for method, fn in fns.items():
                t = time_cuda(fn)
                rows.append(dict(preset=preset, M=M, loras=L, block_size=bs, method=method,
                                 us_median=round(t.median_us, 2), us_p20=round(t.p20_us, 2),
                                 us_p80=round(t.p80_us, 2), **prov))
    return rows


def sweep_parser(sub, what: str, help: str, *, name: str, tokens, presets=("qwen3-30b-a3b",), ranks=None,
                 dtype: bool = True, max_seconds: bool = False):
    """A subcommand with the arguments every sweep shares (ranks, dtype, time budget optional)."""
    p = sub.add_parser(what, help=help)
    p.add_argument("--presets", nargs="+", default=list(presets))
    p.add_argument("--tokens", nargs="+", type=int, default=list(tokens))
    if ranks is not None:
        p.add_argument("--ranks", nargs="+", type=int, default=list(ranks))
    p.add_argument("--loras", type=int, default=4)
    if dtype:
        p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    if max_seconds:
        p.add_argument("--max-seconds", type=float, default=1e9, help="stop starting new cases after this long")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--name", default=name, help="file stem of the CSV and plots")
    return p


def parse_args(argv):
    from . import bench_eager, bench_gemm, bench_tune
    from .layer import SIDE_PRIORITIES

    p = argparse.ArgumentParser(prog="python -m moelora_lab.bench", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    k = sweep_parser(sub, "kernels", "LoRA op paths x presets x M x rank", name="kernels",
                     presets=("qwen3-30b-a3b", "deepseek-v2-lite"), tokens=(1, 8, 32, 128, 512, 2048, 8192),
                     ranks=(16, 64, 128, 256))
    k.add_argument("--ops", nargs="+", choices=["w13", "w2"], default=["w13", "w2"])
    k.add_argument("--paths", nargs="+", choices=KERNEL_PATHS, default=list(KERNEL_PATHS))
    k.add_argument("--small-batch-max-tokens", type=int, default=512,
                   help="skip the per-pair kernel above this M (it re-reads weights per pair)")
    k.add_argument("--time-alignment", action="store_true", help="also time block_list() per case")
    k.add_argument("--tune", action="store_true", help="time a grid of one-shot / two-kernel tiles per case")
    g = sub.add_parser("registers", help="registers / spills / occupancy of the one-shot kernel vs rank")
    g.add_argument("--ranks", nargs="+", type=int, default=[16, 32, 64, 128, 192, 256, 512])
    g.add_argument("--block-m", nargs="+", type=int, default=[16, 64])
    g.add_argument("--max-block-r", nargs="+", type=int, default=[128, 512],
                   help="widest rank tile; 512 means one tile up to r = 512 (no rank tiling)")
    g.add_argument("--out", type=Path, default=DEFAULT_OUT)
    g.add_argument("--name", default="registers")
    y = sweep_parser(sub, "layer", "the MoE layer: no LoRA, sequential, dual stream, join variants; timelines",
                     name="layer", tokens=(1, 16, 64, 128, 512, 2048, 8192), ranks=(16, 64), max_seconds=True)
    y.add_argument("--variants", nargs="+", default=None, help="subset of bench_layer.VARIANTS")
    y.add_argument("--trace-tokens", nargs="+", type=int, default=[1, 16, 128, 512, 2048, 8192])
    y.add_argument("--trace-ranks", nargs="+", type=int, default=[16, 64])
    y.add_argument("--side-priority", choices=SIDE_PRIORITIES, default=SIDE_PRIORITIES[0])
    a = sweep_parser(sub, "align", "routing metadata: PyTorch ops vs device kernels", name="align",
                     presets=("qwen3-30b-a3b", "deepseek-v2-lite"), tokens=(1, 16, 128, 512, 2048, 8192), dtype=False)
    a.add_argument("--block-size", type=int, default=16)
    bench_gemm.add_parser(sub)
    bench_eager.add_parser(sub)
    bench_tune.add_parser(sub)
    bench_tune.add_layout_parser(sub)
    args = p.parse_args(argv)
    if args.what == "layer":
        from .bench_layer import VARIANTS
        args.variants = args.variants or list(VARIANTS)
    args.argv = list(argv)
    args.command = command_line(argv)
    return args


def command_line(argv) -> str:
    """The command that reproduces a run, as recorded in its data (``--out`` is where it was written,
    not how it was measured, and is left out)."""
    kept, argv = [], list(argv)
    while argv:
        a = argv.pop(0)
        if a == "--out":
            argv.pop(0)
        elif not a.startswith("--out="):
            kept.append(a)
    return "python -m moelora_lab.bench " + " ".join(shlex.quote(a) for a in kept)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not torch.cuda.is_available() and DEVICE == "cuda":
        print("the benchmark times CUDA kernels and needs a GPU; on the CPU, read the committed CSVs under "
              f"{DEFAULT_OUT} (the notebooks plot them)", file=sys.stderr)
        return 2
    if args.what == "layer":
        from .bench_layer import run_layer
        from .profile.timeline import save_traces
        rows, traces = run_layer(args)
        args.out.mkdir(parents=True, exist_ok=True)
        if traces:
            save_traces(traces, args.out / f"{args.name}_traces.json")
    elif args.what == "align":
        rows = run_align(args)
    elif args.what == "gemm":
        from .bench_gemm import run_gemm
        rows = run_gemm(args)
    elif args.what == "eager":
        from .bench_eager import run_eager
        rows = run_eager(args)
    elif args.what in ("tune", "layout"):
        from .bench_tune import run_layout, run_tune
        rows = (run_tune if args.what == "tune" else run_layout)(args)
    else:
        rows = run_kernels(args) if args.what == "kernels" else run_registers(args)
    csv_path = args.out / f"{args.name}.csv"
    write_csv(rows, csv_path)
    print(f"wrote {csv_path} ({len(rows)} rows)", file=sys.stderr)
    if args.what == "layer":
        from .plots.layer import save_layer_plots
        for png in save_layer_plots(rows, args.out, args.name):
            print(f"wrote {png}", file=sys.stderr)
        return 0
    if args.what != "kernels" or args.tune:   # gemm, tune, align, registers, eager: CSV only
        return 0
    try:
        from .plots.bench import save_kernel_plots
        for png in save_kernel_plots(rows, args.out, args.name):
            print(f"wrote {png}", file=sys.stderr)
    except ImportError as exc:   # plots are optional on a headless machine without matplotlib
        print(f"plots skipped: {exc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
