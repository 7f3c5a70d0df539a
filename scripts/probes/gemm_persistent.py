"""Probe: the base grouped GEMM as a persistent kernel, at the sizes where it is compute-bound.

Shape legend: M tokens, k top-k, E experts, K in, N out, P = M*k pairs, BM = BLOCK_M pairs per block, B blocks.

The rule's grouped GEMM (``moe_gemm``) launches one program per (block, N tile): each program loads its first K
steps, multiplies, stores its tile and exits, and the next program on that SM starts its loads only then. A
persistent kernel launches one program per SM, and each walks the tiles ``pid, pid + SMs, ...`` in the rule's
order; with ``flatten`` Triton's software pipeliner treats the tile loop and the K loop as one loop, so a program
loads the first K steps of its next tile while it finishes the last of the current one. The probe times, on the
sweep's routing (bf16, M 2048 and 8192, the rule's tiles, W by TMA):

  <op>_rule                       ``moe_gemm`` as the rule runs it (half tiles for blocks that are mostly padding)
  <op>_whole                      ``moe_gemm`` with whole tiles only
  <op>_persistent                 the persistent kernel below (whole tiles), tile and K loops flattened
  <op>_persistent_nested          the same without flattening (a persistent grid, the loops pipelined apart)
  <op>_grouped_mm                 ``torch._grouped_mm`` on pre-grouped rows

every variant checked against ``torch._grouped_mm`` first, then timed in interleaved rounds (CUDA graphs replayed by
``triton.testing.do_bench``, L2 flushed). On a GPU, from the repository root:

    PYTHONPATH=. OUT=/tmp/probe python scripts/probes/gemm_persistent.py [--tokens 2048 8192] [--presets ...]

writes ``$OUT/gemm_persistent.csv``; its ``command`` starts with ``probe:`` (see data/history/README.md).
"""
import os
import sys

import torch

from moelora_lab.kernels.common import gemm_tile, rows_at      # before triton: the package picks the backend

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def persistent_gemm_kernel(
    x_ptr,             # [M, K] (TOKEN_ROWS) or [P, K], bf16/fp16/fp32
    w_ptr,             # [E, N, K] expert weights, x's dtype (read if not W_TMA)
    w_desc,            # TMA descriptor of W viewed [E*N, K], box [BLOCK_N, BLOCK_K] (read if W_TMA)
    out_ptr,           # [P, N] x's dtype
    topk_weights_ptr,  # [P] fp32 (read if MUL_ROUTED_WEIGHT)
    sorted_pairs_ptr,  # [B*BM] int32 pairs grouped by expert, sentinel P
    block_expert_ptr,  # [B] int32 expert of each block, -1 = unused (used blocks come first)
    used_ptr,          # [1] int32 blocks in use
    num_pairs, top_k, K, N, stride_xm, stride_we, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, TOKEN_ROWS: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
    W_TMA: tl.constexpr, FLATTEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program p: tiles p, p + NUM_PROGRAMS, ... of the used blocks' (block, N tile) grid, numbered as
    ``moe_gemm_kernel`` numbers its programs; K a multiple of BLOCK_K. The store recomputes its tile's rows from
    its own counter, so nothing the first K steps load has to live until the last (the pipeliner's need)."""
    used = tl.load(used_ptr)
    tiles = used * tl.cdiv(N, BLOCK_N)
    k_steps = K // BLOCK_K
    offs_k = tl.arange(0, BLOCK_K)
    done = tl.program_id(0) - NUM_PROGRAMS
    for tile in tl.range(tl.program_id(0), tiles, NUM_PROGRAMS, flatten=FLATTEN):
        block, _, n0 = gemm_tile(tile, N, N, used, BLOCK_N, GROUP_M)
        expert = tl.load(block_expert_ptr + block)
        pairs, valid, x_rows = rows_at(sorted_pairs_ptr, block * BLOCK_M, num_pairs, top_k, BLOCK_M, TOKEN_ROWS)
        x_base = x_ptr + x_rows.to(tl.int64)[:, None] * stride_xm
        offs_n = n0 + tl.arange(0, BLOCK_N)
        w_base = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(k_steps):
            ks = kk * BLOCK_K + offs_k
            xk = tl.load(x_base + ks[None, :], mask=valid[:, None], other=0.0)
            if W_TMA:
                wk = w_desc.load([expert * N + n0, kk * BLOCK_K]).T
            else:
                wk = tl.load(w_base + ks[:, None], mask=(offs_n < N)[None, :], other=0.0)
            acc = tl.dot(xk, wk, acc, input_precision=DOT_PRECISION)
        done += NUM_PROGRAMS
        block_c, _, n0_c = gemm_tile(done, N, N, used, BLOCK_N, GROUP_M)
        pairs_c, valid_c, _ = rows_at(sorted_pairs_ptr, block_c * BLOCK_M, num_pairs, top_k, BLOCK_M, TOKEN_ROWS)
        if MUL_ROUTED_WEIGHT:
            acc = acc * tl.load(topk_weights_ptr + pairs_c, mask=valid_c, other=0.0)[:, None]
        offs_c = n0_c + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + pairs_c.to(tl.int64)[:, None] * stride_om + offs_c[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=valid_c[:, None] & (offs_c < N)[None, :])


def used_blocks(blocks) -> torch.Tensor:
    """[1] int32 on the device: how many of ``blocks`` are in use (part of the plan, not of the GEMM)."""
    return (blocks.block_expert >= 0).sum().to(torch.int32).reshape(1)


def persistent_gemm(x, w, blocks, out, *, top_k: int, topk_weights=None, tiles: dict, used: torch.Tensor,
                    flatten: bool = True, programs: int | None = None):
    """out[p] = (w_p *) W[e_p] @ x_row(p) over ``blocks`` (whole tiles, ``used``: :func:`used_blocks`), one
    program per SM (or ``programs``)."""
    from moelora_lab.base_moe import launch_tiles

    E, N, K = w.shape
    P = out.shape[0]
    tiles = {k: v for k, v in tiles.items() if k != "HALF_TAIL"}
    tiles, warps, stages, w_tma, w_desc = launch_tiles(tiles, w)
    if K % tiles["BLOCK_K"] or x.stride(1) != 1 or w.stride(2) != 1 or out.stride(1) != 1:
        raise ValueError("the probe's kernel takes K a multiple of BLOCK_K and unit column strides")
    if programs is None:
        programs = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    mul = topk_weights is not None
    persistent_gemm_kernel[(programs,)](
        x, w, w_desc, out, topk_weights if mul else out, blocks.sorted_pairs, blocks.block_expert, used,
        P, top_k, K, N, x.stride(0), w.stride(0), w.stride(1), out.stride(0),
        BLOCK_M=tiles["BLOCK_M"], BLOCK_N=tiles["BLOCK_N"], BLOCK_K=tiles["BLOCK_K"], GROUP_M=tiles["GROUP_M"],
        NUM_PROGRAMS=programs, TOKEN_ROWS=x.shape[0] != P or top_k == 1, MUL_ROUTED_WEIGHT=mul, W_TMA=w_tma,
        FLATTEN=flatten, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps,
        num_stages=stages)
    return out


def main(out: str, tokens: list[int], presets: list[str], command: str) -> None:
    from plan_knobs import timed_rows       # the same interleaved timing and rows as the plan's probe

    from moelora_lab.routing.device import make_blocks
    from moelora_lab.bench.common import base_weights, close, device, grouped_mm_fns, seeded_generator, sweep_routing
    from moelora_lab.config import MoEShape
    from moelora_lab.base_moe import gemm_tiles, moe_gemm
    from moelora_lab.profile import timing
    from moelora_lab.results import write_csv

    prov = timing.provenance(command)
    dev = torch.device(device())
    rows = []
    for preset in presets:
        shape = MoEShape.from_name(preset)
        E, H, I, k = shape.num_experts, shape.hidden, shape.intermediate, shape.top_k
        gen = seeded_generator(0)
        w13, w2 = base_weights(shape, gen, torch.bfloat16)
        for M in tokens:
            P = M * k
            ids, tw, _ = sweep_routing(shape, 4, M, 0)
            x = torch.randn(M, H, device=dev, generator=gen, dtype=torch.bfloat16)
            h = torch.randn(P, I, device=dev, generator=gen, dtype=torch.bfloat16)
            wflat = tw.reshape(-1).float().contiguous()
            tiles = gemm_tiles(P, E)
            blocks = make_blocks(ids, None, E, 1, tiles["BLOCK_M"])
            used = used_blocks(blocks)
            fns = {}
            for op, (inp, w, weights) in (("w13", (x, w13, None)), ("w2", (h, w2, wflat))):
                o = torch.empty(P, w.shape[1], device=dev, dtype=torch.bfloat16)
                run = dict(top_k=k, topk_weights=weights)
                fns[f"{op}_rule"] = lambda inp=inp, w=w, o=o, run=run: moe_gemm(inp, w, blocks, o, tiles=tiles, **run)
                fns[f"{op}_whole"] = lambda inp=inp, w=w, o=o, run=run: moe_gemm(
                    inp, w, blocks, o, tiles=dict(tiles, HALF_TAIL=False), **run)
                for name, flat in (("persistent", True), ("persistent_nested", False)):
                    fns[f"{op}_{name}"] = lambda inp=inp, w=w, o=o, run=run, flat=flat: persistent_gemm(
                        inp, w, blocks, o, tiles=tiles, used=used, flatten=flat, **run)
            ref13, ref2 = grouped_mm_fns(x, h, ids, w13, w2)
            order = torch.sort(ids.reshape(-1).long(), stable=True).indices
            want = {"w13": ref13().float(), "w2": ref2().float() * wflat[order][:, None]}
            for name, fn in fns.items():
                if not close(fn()[order].float(), want[name.split("_")[0]]):
                    raise RuntimeError(f"{preset} M={M}: {name} differs from torch._grouped_mm")
            fns["w13_grouped_mm"], fns["w2_grouped_mm"] = ref13, ref2
            rows += timed_rows(fns, f"{preset} M={M}", prov, preset=preset, M=M, pairs=P, block_m=tiles["BLOCK_M"])
    write_csv(rows, os.path.join(out, "gemm_persistent.csv"))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gemm_rows import run_cli           # the same command line as the rows probe

    run_cli(__doc__, "gemm_persistent.py", main)
