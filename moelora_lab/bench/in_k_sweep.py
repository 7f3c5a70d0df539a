"""``python -m moelora_lab.bench in_k``: the LoRA in the GEMMs' K (``layer.in_k``) against the two-stream layer.

The subcommand is named after the row of ``layer.SCHEDULES`` that needs the weights packed (``IN_K``), and
its variants after that row and the two-stream row of the op's LoRA kernels (``TWO``).
Per (preset, rank, M), timed together in interleaved rounds (CUDA-graph replays, L2 flushed):

  no_lora        the layer without LoRA
  dual_stream    the layer with LoRA, both LoRA ops on the side stream (the default on a GPU)
  w2_in_k        w13's LoRA on the side stream, w2's in the w2 GEMM's K (``experiments.in_k.w2_in_k_layer``)
  in_k           both LoRA ops in their GEMMs' K, one stream (``layer.in_k.in_k_layer``)
  in_k_overlap   the same with each shrink and its GEMM as one launch, the GEMM tiles waiting for the
                 shrink only before their tail K steps (``experiments.in_k.in_k_overlap_layer``)
  w13_gemm       the plain w13 GEMM over x [M, H]
  w13_gemm_in_k  the same GEMM with its last K steps from T1 [2, P, L*r] and w13_ext: what the wider K costs
  w2_gemm        the plain w2 GEMM over h [P, I]
  w2_gemm_in_k   the same GEMM over h_ext [P, I + L*r] and w2_ext: what the wider K costs
  w13_shrink     ``in_k``'s w13 shrink alone: T1 [2, P, L*r] from x (what the w13 GEMM's tail waits for)
  w2_shrink      ``in_k``'s w2 shrink alone: T2 into h_ext's tail from h

``w2_in_k``, ``in_k`` and ``in_k_overlap`` must agree with ``dual_stream`` before anything is timed. Routing
plans are
built once, outside the timed region, as in ``bench layer``.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, H hidden, I expert intermediate.
"""
from __future__ import annotations

import torch

from ..config import MoEShape, layer_lora_weights
from ..layer import moe_lora_layer, plan_layer
from ..layer.in_k_launch import shrink_tail
from ..experiments.in_k import in_k_overlap_layer, w2_in_k_layer
from ..layer.in_k import W13_ONE_READ, in_k_layer
from ..layer.in_k_pack import pack_w13_in_k, pack_w2_in_k
from ..layer.table import SCHEDULES
from ..base_moe import gemm_tiles, moe_gemm
from ..profile import timing
from ..profile.gpu_state import GpuMonitor
from ..summary import KERNEL_ROWS
from .common import base_weights, close, device, progress, seeded_generator, sweep_parser, sweep_routing

IN_K = next(name for name, row in SCHEDULES.items() if row.needs_pack)   # the row this benchmark measures
TWO = KERNEL_ROWS[2]                                                     # against the op's kernels on two streams
NAME = IN_K
ROUNDS = 3
VARIANTS = ("no_lora", TWO, "w2_in_k", IN_K, "in_k_overlap", "w13_gemm", "w13_gemm_in_k", "w2_gemm",
            "w2_gemm_in_k", "w13_shrink", "w2_shrink")
CHECKED = ("w2_in_k", IN_K, "in_k_overlap")                              # must agree with TWO before timing


def add_parser(sub):
    sweep_parser(sub, NAME, "the layer with the LoRA in the GEMMs' K against two streams",
                 name="layer_in_k", tokens=(1, 16, 128, 512, 2048, 8192), ranks=(16, 64))


def run(args) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    prov = timing.provenance(args.command)
    gen = seeded_generator(args.seed)
    rows = []
    for preset in args.presets:
        shape = MoEShape.from_name(preset)
        E, H, I, k, L = shape.num_experts, shape.hidden, shape.intermediate, shape.top_k, args.loras
        w13, w2 = base_weights(shape, gen, dtype)
        for rank, M in progress([(r, m) for r in args.ranks for m in args.tokens], desc=NAME, unit="case"):
            lora = layer_lora_weights(shape, L, rank, gen, dtype)
            w2_ext = pack_w2_in_k(w2, lora["w2_lora_b"])
            w13_ext = pack_w13_in_k(w13, lora["w13_lora_b"])
            ids, tw, tl = sweep_routing(shape, L, M, args.seed, args.adapters)
            x = torch.randn(M, H, device=device(), generator=gen, dtype=dtype)
            plan = plan_layer(ids, tl, E, L, rank, intermediate=I, schedule=KERNEL_ROWS[1])
            plain = plan_layer(ids, tl, E, None, None)
            base = (x, ids, tw, tl, w13, w2)
            in_k = dict(w13_lora_a=lora["w13_lora_a"], w13_lora_b=lora["w13_lora_b"], w2_lora_a=lora["w2_lora_a"])
            both = dict(w13_lora_a=lora["w13_lora_a"], w2_lora_a=lora["w2_lora_a"])
            P = M * k
            h = torch.randn(P, I, device=device(), generator=gen, dtype=dtype)
            h_ext = torch.randn(P, I + L * rank, device=device(), generator=gen, dtype=dtype)
            c3 = torch.empty(P, H, device=device(), dtype=dtype)
            c1 = torch.empty(P, 2 * I, device=device(), dtype=dtype)
            t13 = torch.randn(2, P, L * rank, device=device(), generator=gen, dtype=dtype)
            tiles, wflat = gemm_tiles(P, E), tw.reshape(-1).float().contiguous()
            tl32, a2 = tl.to(torch.int32).contiguous(), lora["w2_lora_a"][0]
            fns = {
                "no_lora": lambda: moe_lora_layer(*base, plan=plain),
                TWO: lambda: moe_lora_layer(*base, **lora, schedule=TWO, plan=plan),
                "w2_in_k": lambda: w2_in_k_layer(x, ids, tw, tl, w13, w2_ext, **in_k, plan=plan),
                IN_K: lambda: in_k_layer(x, ids, tw, tl, w13_ext, w2_ext, **both, plan=plan),
                "in_k_overlap": lambda: in_k_overlap_layer(x, ids, tw, tl, w13_ext, w2_ext, **both, plan=plan),
                "w13_gemm": lambda: moe_gemm(x, w13, plain.base_blocks, c1, top_k=k, tiles=tiles),
                "w13_gemm_in_k": lambda: moe_gemm(x, w13_ext, plain.base_blocks, c1, top_k=k, tiles=tiles, x_tail=t13),
                "w2_gemm": lambda: moe_gemm(h, w2, plain.base_blocks, c3, top_k=k, topk_weights=wflat, tiles=tiles),
                "w2_gemm_in_k": lambda: moe_gemm(h_ext, w2_ext, plain.base_blocks, c3, top_k=k, topk_weights=wflat,
                                                 tiles=tiles),
                "w13_shrink": lambda: shrink_tail(x, lora["w13_lora_a"], plan, tl32, k, t13, I, rank, None,
                                                  token_rows=True, one_read=W13_ONE_READ),
                "w2_shrink": lambda: shrink_tail(h_ext, [a2], plan, tl32, k, h_ext[:, I:].unsqueeze(0), H, rank, None),
            }
            want = fns[TWO]().float()
            tol = 2e-2 if dtype != torch.float32 else 1e-4
            for name in CHECKED:
                got = fns[name]().float()
                if not close(got, want, tol):
                    raise RuntimeError(f"{preset} M={M} r={rank}: {name} differs from {TWO} "
                                       f"(largest difference {float((got - want).abs().max()):.3g})")
            with GpuMonitor() as state:
                timed = timing.time_cuda_interleaved(fns, rounds=ROUNDS)
            for name in VARIANTS:
                t = timed[name]
                if not isinstance(t, timing.Timing):
                    raise RuntimeError(f"{preset} M={M} r={rank} {name}: {t}")
                rows.append(dict(preset=preset, M=M, rank=rank, loras=L, variant=name, us_median=round(t.median_us, 2),
                                 us_p20=round(t.p20_us, 2), us_p80=round(t.p80_us, 2), **state.summary(), **prov))
            del lora, w2_ext, w13_ext
            torch.cuda.empty_cache()
    return rows
