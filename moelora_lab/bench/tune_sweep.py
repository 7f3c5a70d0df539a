"""``python -m moelora_lab.bench tune``: a greedy tile search for the LoRA op, the evidence behind
``dispatch.choose_config``.

For each (preset, op, rank, M) case and path it starts from the tiles the rule picks, then walks
``AXES`` one at a time: every value of that axis is tried with the others held, the fastest is kept,
and the walk moves on (``--passes`` times over all axes). Each candidate's output is checked against
the rule's output before it is timed (a CUDA-graph replay with L2 flushed, as in the other
benchmarks), so a tile that computes something else is recorded as an error and never wins. A grid
of every combination would be ~10^4 compiles per case; the walk needs ~25.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, K in, N out, S slices.
"""
from __future__ import annotations

import sys
import time

import torch

from ..config import MoEShape, random_lora_weights
from ..op.dispatch import choose_config
from ..op.face import moe_lora
from ..op.paths import PATHS, TRITON_PATHS
from ..profile import timing
from ..profile.traffic import count_workload, lora_op_traffic
from ..results import write_csv
from ..routing.host import block_list
from .common import close, device, progress, seeded_generator, sweep_parser, sweep_routing

NAME = "tune"
# KernelConfig fields and the values the walk tries (n_chunks only matters to the one-shot kernel)
AXES = {
    "block_k": (32, 64, 128, 256, 512),
    "num_stages": (1, 2, 3, 4, 5),
    "num_warps": (2, 4, 8),
    "n_chunks": (1, 2, 4, 8, 16),
    "block_n": (32, 64, 128, 256),
    "block_m": (16, 32, 64),
}
TILE_FIELDS = ("block_m", "block_n", "block_k", "n_chunks", "num_warps", "num_stages")


def add_parser(sub):
    t = sweep_parser(sub, NAME, "greedy tile search of the LoRA op (one-shot and two-kernel)", name="lora_tune",
                     tokens=(16, 64, 512, 128, 1, 2048), ranks=(16, 64), max_seconds=True)
    t.add_argument("--ops", nargs="+", choices=["w13", "w2"], default=["w13", "w2"],
                   help="projections: w13 (gate and up), w2 (down) (default: both)")
    block_paths = [name for name in TRITON_PATHS if PATHS[name].uses_blocks]
    t.add_argument("--paths", nargs="+", choices=block_paths, default=block_paths,
                   help="LoRA paths whose tiles are searched (default: %(default)s)")
    t.add_argument("--passes", type=int, default=1, help="walks over all axes per case")


def _key(cfg) -> tuple:
    return tuple(getattr(cfg, f) for f in TILE_FIELDS)


def _walk(start, path, passes, measure):
    """Coordinate descent from ``start``: returns the best config; ``measure(cfg)`` -> µs or None."""
    best, best_us = start, measure(start)
    for _ in range(passes):
        for axis, values in AXES.items():
            if axis == "n_chunks" and path != "one_shot":
                continue
            for v in values:
                cand = best.replace(**{axis: v})
                us = measure(cand)
                if us is not None and (best_us is None or us < best_us):
                    best, best_us = cand, us
    return best, best_us


def run(args) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    prov = timing.provenance(args.command)
    copy_bps = timing.copy_bandwidth()
    gen = seeded_generator(args.seed)
    rows, start = [], time.monotonic()
    cases = [(p, r, op, M) for p in args.presets for r in args.ranks for M in args.tokens for op in args.ops]
    weights = {}
    for preset, rank, op, M in progress(cases, desc="tune", unit="case"):
        if time.monotonic() - start > args.max_seconds:
            print(f"time budget of {args.max_seconds} s spent: skipping the remaining cases", file=sys.stderr)
            break
        shape = MoEShape.from_name(preset)
        L, E, k = args.loras, shape.num_experts, shape.top_k
        if (preset, rank) not in weights:          # both ops' weights for one (preset, rank), made once
            weights.clear()
            torch.cuda.empty_cache()
            weights[preset, rank] = {o: random_lora_weights(shape, o, L, rank, gen, dtype) for o in args.ops}
        lora_a, lora_b = weights[preset, rank][op]
        k_in, n_out, S = lora_a[0].shape[3], lora_b[0].shape[2], len(lora_a)
        ids, tw, tl = sweep_routing(shape, L, M, args.seed, args.adapters)
        x = torch.randn(M if op == "w13" else M * k, k_in, device=device(), generator=gen, dtype=dtype)
        base = torch.randn(M, k, S * n_out, device=device(), generator=gen, dtype=dtype)
        work = count_workload(ids, tl, E, L)
        groups = min(M * k, work.touched_adapter_experts or 1)
        traffic = {}
        blocks = {}
        for path in args.paths:
            rule = choose_config(path, M * k, groups, n_out, S, x.device, rank=rank)
            out, want, seen = torch.empty_like(base), None, {}

            def measure(cfg, path=path, rule=rule, out=out):
                nonlocal want
                if _key(cfg) in seen:
                    return seen[_key(cfg)]
                if cfg.block_m not in blocks:
                    blocks[cfg.block_m] = block_list(ids, tl, E, L, cfg.block_m)
                fn = lambda: moe_lora(x, ids, tw, tl, lora_a, lora_b, path=path, mul_routed_weight=op == "w2",
                                      output=out, add_inputs=True, blocks=blocks[cfg.block_m], config=cfg)
                error, us, p20, p80 = "", None, "", ""
                try:
                    out.copy_(base)
                    got = fn().float() - base.float()
                    if want is None:
                        want = got
                    if not close(got, want):
                        error = "output differs from the rule's tiles"
                    else:
                        t = timing.time_cuda(fn, warmup_ms=10, rep_ms=40)
                        us, p20, p80 = round(t.median_us, 2), round(t.p20_us, 2), round(t.p80_us, 2)
                except Exception as exc:    # e.g. out of shared memory for this tile: record, go on
                    error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                if path not in traffic:
                    traffic[path] = lora_op_traffic(path, work, in_features=k_in, out_features=n_out, num_slices=S,
                                                    rank=rank, x_rows="token" if op == "w13" else "pair",
                                                    dtype_bytes=x.element_size(), add_inputs=True)
                floor = traffic[path].floor_us(copy_bps)
                rows.append(dict(preset=preset, op=op, path=path, M=M, rank=rank, loras=L, dtype=args.dtype,
                                 **{f: getattr(cfg, f) for f in TILE_FIELDS}, rule=_key(cfg) == _key(rule),
                                 best=False, us_median=us if us is not None else "", us_p20=p20, us_p80=p80,
                                 floor_us=round(floor, 2), error=error, **prov))
                seen[_key(cfg)] = us
                return us

            first = len(rows)
            best, best_us = _walk(rule, path, args.passes, measure)
            for r in rows[first:]:
                r["best"] = best_us is not None and tuple(r[f] for f in TILE_FIELDS) == _key(best)
            rule_us = seen.get(_key(rule))
            if rule_us and best_us:
                print(f"{preset} {op} r{rank} M={M} {path}: rule {rule_us:.1f} us, best {best_us:.1f} us "
                      f"({rule_us / best_us:.2f}x) {dict(zip(TILE_FIELDS, _key(best)))}", file=sys.stderr)
        args.out.mkdir(parents=True, exist_ok=True)
        write_csv(rows, args.out / f"{args.name}.csv")
    return rows
