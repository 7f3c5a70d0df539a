"""``python -m moelora_lab.bench gemm``: the tile grid of the base grouped GEMM (with and without
the in-GEMM LoRA), the evidence behind ``moe.gemm_tiles``.

For each (preset, w13/w2, M) every tile in ``TILE_GRID`` (and BLOCK_M 64 / 128 once experts get
32 pairs or more, each with GROUP_M 1 and 8; ``--rule-only``: the rule's tiles alone; ``--w-tma``:
each also with its W tiles by TMA bulk copies, column ``w_tma``) is checked against the rule's tiles' output and
timed as a CUDA-graph replay with L2 flushed; ``torch._grouped_mm`` on rows already grouped by
expert is timed next to it, per GEMM and for the w13 + w2 pair. The CSV is rewritten after every
M, so a cut-short run keeps its rows.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, H hidden, I expert intermediate.
"""
from __future__ import annotations

import sys
import time

import torch

from ..routing.device import make_blocks
from ..config import MoEShape, layer_lora_weights
from ..base_moe import gemm_tiles, moe_gemm
from ..experiments.in_gemm import GemmLoRA, moe_gemm_lora
from ..profile import timing
from ..profile.gpu_state import GpuMonitor
from ..results import write_csv
from .common import (base_weights, close, device, grouped_mm_fns, progress, seeded_generator, sweep_parser,
                     sweep_routing)

NAME = "gemm"
# (BLOCK_N, BLOCK_K, num_stages, num_warps): a curated grid, GROUP_M 1 and 8 on top
TILE_GRID = ((32, 128, 4, 4), (32, 256, 3, 4), (64, 128, 4, 4), (64, 256, 3, 4), (64, 64, 5, 4),
             (128, 64, 3, 4), (128, 64, 4, 4), (128, 128, 3, 4), (128, 128, 3, 8), (256, 64, 3, 8),
             (256, 64, 4, 8), (256, 128, 3, 8))


def add_parser(sub):
    g = sweep_parser(sub, NAME, "tile grid of the base grouped GEMM, with and without the in-GEMM LoRA",
                     name="gemm_tune", tokens=(1, 16, 64, 128, 512, 2048, 8192), max_seconds=True)
    g.add_argument("--lora-rank", type=int, default=16, help="rank of the in-GEMM LoRA rows (0: none)")
    g.add_argument("--lora-max-tokens", type=int, default=128, help="time the in-GEMM LoRA up to this M")
    g.add_argument("--rule-only", action="store_true", help="only the rule's tiles, not the grid")
    g.add_argument("--w-tma", action="store_true",
                   help="also time every tile with W tiles by TMA bulk copies (W_TMA=True; compute capability >= 9.0)")


def _tiles_for(per_expert: float, default: dict) -> list[dict]:
    # BLOCK_M 64 / 128 from 32 pairs per expert: vLLM's tuned H200 table takes 64 there (qwen3-30b-a3b, M = 512)
    block_ms = [default["BLOCK_M"]] + [m for m in (64, 128) if per_expert >= 32 and m != default["BLOCK_M"]]
    out = [{k: v for k, v in default.items() if k != "W_TMA"}]          # the W loads are chosen apart
    for bm in block_ms:
        for bn, bk, stages, warps in TILE_GRID:
            for group in ((1, 8) if bm >= 64 else (1,)):
                t = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, num_warps=warps, num_stages=stages)
                if t not in out:
                    out.append(t)
    return out


def run(args) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    prov = timing.provenance(args.command)
    gen = seeded_generator(args.seed)
    rows, start = [], time.monotonic()
    for preset in args.presets:
        shape = MoEShape.from_name(preset)
        E, H, I, k, L = shape.num_experts, shape.hidden, shape.intermediate, shape.top_k, args.loras
        w13, w2 = base_weights(shape, gen, dtype)
        lora = layer_lora_weights(shape, L, max(args.lora_rank, 1), gen, dtype)
        for M in progress(args.tokens, desc=f"gemm {preset}", unit="M"):
            if time.monotonic() - start > args.max_seconds:
                print(f"time budget of {args.max_seconds} s spent: skipping M={M} and up", file=sys.stderr)
                break
            ids, tw, tl = sweep_routing(shape, L, M, args.seed, args.adapters)
            P, tl32, wflat = M * k, tl.to(torch.int32), tw.reshape(-1).float().contiguous()
            x = torch.randn(M, H, device=device(), generator=gen, dtype=dtype)
            h = torch.randn(P, I, device=device(), generator=gen, dtype=dtype)
            ops = {"w13": (x, w13, None, GemmLoRA(tl32, lora["w13_lora_a"], lora["w13_lora_b"])),
                   "w2": (h, w2, wflat, GemmLoRA(tl32, lora["w2_lora_a"], lora["w2_lora_b"]))}
            ref13, ref2 = grouped_mm_fns(x, h, ids, w13, w2)
            grouped = {"w13": timing.time_cuda(ref13).median_us, "w2": timing.time_cuda(ref2).median_us,
                       "pair": timing.time_cuda(lambda: (ref13(), ref2())).median_us}
            blocks = {}
            loras = [None] + ([args.lora_rank] if args.lora_rank and M <= args.lora_max_tokens else [])
            for op, (inp, w, weights, glora) in ops.items():
                for rank in loras:
                    extra = glora if rank else None
                    default = gemm_tiles(P, E, lora=bool(rank))
                    out = torch.empty(P, w.shape[1], device=device(), dtype=dtype)
                    want = None
                    grid = [default] if args.rule_only else _tiles_for(P / E, default)
                    modes = (False, True) if args.w_tma else (default.get("W_TMA", False),)    # else as the rule does
                    for tiles in [dict(t, W_TMA=tma) for t in grid for tma in modes]:
                        bm = tiles["BLOCK_M"]
                        if bm not in blocks:
                            blocks[bm] = make_blocks(ids, None, E, 1, bm)
                        if extra is None:
                            fn = lambda: moe_gemm(inp, w, blocks[bm], out, top_k=k, topk_weights=weights, tiles=tiles)
                        else:
                            fn = lambda: moe_gemm_lora(inp, w, blocks[bm], out, extra, top_k=k, topk_weights=weights,
                                                       tiles=tiles)
                        error, med, p20, p80 = "", "", "", ""
                        state = GpuMonitor(reader=None)
                        try:
                            got = fn().float().clone()
                            if want is None:
                                want = got
                            ok = close(got, want)
                            if not ok:
                                error = "output differs from the default tiles"
                            else:
                                with GpuMonitor() as state:
                                    t = timing.time_cuda(fn)
                                med, p20, p80 = round(t.median_us, 2), round(t.p20_us, 2), round(t.p80_us, 2)
                        except Exception as exc:    # e.g. out of shared memory for this tile: record, go on
                            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                        rows.append(dict(preset=preset, op=op, M=M, lora_rank=rank or 0, loras=L if rank else 0,
                                         rule_at_run={**tiles, "W_TMA": False} == {**default, "W_TMA": False},
                                         **{k_.lower(): v for k_, v in tiles.items()},
                                         us_median=med, us_p20=p20, us_p80=p80,
                                         grouped_mm_us=round(grouped[op], 2),
                                         grouped_mm_pair_us=round(grouped["pair"], 2), error=error,
                                         **state.summary(), **prov))
            torch.cuda.empty_cache()
            args.out.mkdir(parents=True, exist_ok=True)
            write_csv(rows, args.out / f"{args.name}.csv")
    return rows
