"""Compile every kernel for an NVIDIA Hopper GPU (sm_90) without one: Triton's own ptxas does it.

Run as a script (``MOELORA_INTERPRET=0`` so the kernels are built for the compiler, not the
interpreter); prints one line per kernel variant and exits non-zero on the first failure.
"""
import inspect
import os
import pathlib
import re
import subprocess
import sys
import tempfile

os.environ["MOELORA_INTERPRET"] = "0"

import triton  # noqa: E402  (after the switch: moelora_lab is imported below, kernels after it)

import moelora_lab  # noqa: E402,F401
from moelora_lab.kernels import (align, base_moe, combine, in_k, one_shot,  # noqa: E402
                                 two_kernel)
from moelora_lab.experiments.kernels import one_shot_builds, small_batch  # noqa: E402
from moelora_lab.experiments.kernels import in_gemm, in_join, in_k_overlap  # noqa: E402
from moelora_lab.op.dispatch import one_shot_build_rule  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
SHARED_PER_BLOCK = 227 * 1024      # the most shared memory one program may have on an H100 or H200


UNIT_STRIDES = ("stride_xk", "stride_ak", "stride_br", "stride_on", "stride_tr", "stride_wk")


def build(kernel, types: dict, constexprs: dict, num_warps=4, num_stages=3):
    """Compile as a launch on contiguous 16-byte-aligned tensors would: unit strides become the
    constant 1 and every other pointer and integer is known divisible by 16 (except top_k)."""
    fn = kernel
    while not isinstance(fn, JITFunction):                   # unwrap @triton.heuristics
        fn = fn.fn
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.default is not inspect.Parameter.empty}
    constexprs = dict(defaults, **constexprs, **{n: 1 for n in UNIT_STRIDES if n in fn.arg_names})
    sig = {name: ("constexpr" if name in constexprs else types.get(name, "i32")) for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if sig[name] != "constexpr" and name != "top_k"}
    src = ASTSource(fn, sig, constexprs, attrs)
    return triton.compile(src, target=TARGET, options=dict(num_warps=num_warps, num_stages=num_stages))


def resources(compiled) -> dict:
    """Registers per thread and spill stack bytes of a compiled kernel, read from its cubin by the
    cuobjdump that ships with Triton (no GPU needed)."""
    cuobjdump = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return dict(regs=int(found.group(1)), stack=int(found.group(2)))


def launched(block_r: int) -> dict:
    """The one-shot kernel's build flags as the launcher passes them for a rank tile ``block_r`` wide."""
    prefetch, stages = one_shot_build_rule(block_r)
    return dict(PREFETCH_OUT=prefetch, EXPAND_STAGES=stages)


def ptrs(*names, dtype="bf16"):
    return {n: f"*{dtype}" for n in names}


def main():
    i32 = "*i32"
    lora = dict(ptrs("x_ptr", "a0_ptr", "a1_ptr", "b0_ptr", "b1_ptr", "out_ptr", "t_ptr"),
                topk_weights_ptr="*fp32", sorted_pairs_ptr=i32, block_lora_ptr=i32, block_expert_ptr=i32,
                lora_ranks_ptr=i32, topk_ids_ptr=i32, token_lora_ptr=i32)
    common = dict(MUL_ROUTED_WEIGHT=True, ADD_INPUTS=False)
    built = dict(common, TOKEN_ROWS=True, DOT_PRECISION="tf32")     # the knobs the product kernel fixes
    gemm = dict(lora, **ptrs("w_ptr", "w_desc"))        # t_ptr from lora
    gemm_c = dict(BLOCK_N=128, BLOCK_K=64, TOKEN_ROWS=True, MUL_ROUTED_WEIGHT=True, EVEN_K=True, DOT_PRECISION="tf32",
                  W_TMA=False)
    tail = dict(ptrs("h_ptr", "a0_ptr", "a1_ptr", "tail_ptr"), sorted_pairs_ptr=i32, block_lora_ptr=i32,
                block_expert_ptr=i32, token_lora_ptr=i32, lora_ranks_ptr=i32)
    tail_c = dict(BLOCK_M=16, BLOCK_K=128, BLOCK_R=64, BLOCK_LR=64, FILL_ROWS=32, DOT_PRECISION="tf32", HAS_RANKS=True)
    cases = []
    for tiles, ranks in ((1, False), (2, True), (4, True)):
        cases.append((f"one_shot rank_tiles={tiles} ranks={ranks}", one_shot.one_shot_kernel, lora,
                      dict(common, N_CHUNKS=2, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, BLOCK_R=128, RANK_TILES=tiles,
                           EVEN_K=True, HAS_RANKS=ranks, **launched(128))))
    for name, kernel, flags in (
            ("both slices", one_shot_builds.one_shot_build_kernel, dict(built, BOTH_SLICES=True)),
            ("output prefetched", one_shot.one_shot_kernel, dict(common, PREFETCH_OUT=True)),
            ("clamped rank offsets, expand unpipelined", one_shot_builds.one_shot_build_kernel,
             dict(built, CLAMP_RANKS=True, EXPAND_STAGES=1))):
        cases.append((f"one_shot {name}", kernel, lora,
                      dict(flags, N_CHUNKS=1, BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, BLOCK_R=64, RANK_TILES=1,
                           EVEN_K=True, HAS_RANKS=False)))
    cases += [
        ("shrink", two_kernel.shrink_kernel, lora, dict(BLOCK_M=16, BLOCK_K=128, BLOCK_R=64, TOKEN_ROWS=True,
                                                        DOT_PRECISION="tf32", HAS_RANKS=True)),
        ("shrink, both slices from one read of x", two_kernel.shrink_kernel, lora,
         dict(BLOCK_M=64, BLOCK_K=64, BLOCK_R=64, TOKEN_ROWS=True, DOT_PRECISION="tf32", HAS_RANKS=True,
              BOTH_SLICES=True)),
        ("expand", two_kernel.expand_kernel, lora, dict(BLOCK_M=16, BLOCK_N=128, BLOCK_R=64, MUL_ROUTED_WEIGHT=True,
                                                        ADD_INPUTS=True, DOT_PRECISION="tf32", HAS_RANKS=True)),
        ("small_batch", small_batch.small_batch_kernel, lora,
         dict(NUM_SLICES=2, N_CHUNKS=4, BLOCK_N=64, BLOCK_K=64, BLOCK_R=128, RANK_TILES=2, TOKEN_ROWS=True,
              MUL_ROUTED_WEIGHT=False, ADD_INPUTS=True, HAS_RANKS=True)),
        ("moe_gemm", base_moe.moe_gemm_kernel, gemm, dict(gemm_c, BLOCK_M=64, GROUP_M=8)),
        ("in_gemm.moe_gemm_lora", in_gemm.moe_gemm_lora_kernel, gemm,
         dict(gemm_c, BLOCK_M=16, GROUP_M=1, BLOCK_LR=64, HAS_RANKS=True, T_IN=False)),
        ("in_gemm.moe_gemm_lora, expand before the K loop (epilogue)", in_gemm.moe_gemm_lora_kernel, gemm,
         dict(gemm_c, BLOCK_M=64, GROUP_M=8, BLOCK_LR=64, HAS_RANKS=True, T_IN=True)),
        ("silu_and_mul", base_moe.silu_and_mul_kernel, dict(ptrs("c1_ptr", "delta_ptr", "h_ptr"), token_lora_ptr=i32),
         dict(BLOCK=1024, HAS_DELTA=True)),
        ("silu_and_mul, the delta loaded early", base_moe.silu_and_mul_kernel,
         dict(ptrs("c1_ptr", "delta_ptr", "h_ptr"), token_lora_ptr=i32), dict(BLOCK=1024, HAS_DELTA=True, DELTA_EARLY=True)),
        ("topk_sum", base_moe.topk_sum_kernel, dict(ptrs("c3_ptr", "delta_ptr", "y_ptr"), token_lora_ptr=i32),
         dict(BLOCK=512, HAS_DELTA=True, BLOCK_J=8, ROWS_AS_TILE=True)),
        ("topk_sum, a loop over the rows", base_moe.topk_sum_kernel,
         dict(ptrs("c3_ptr", "delta_ptr", "y_ptr"), token_lora_ptr=i32),
         dict(BLOCK=1024, HAS_DELTA=True, BLOCK_J=8, ROWS_AS_TILE=False)),
        ("in_join.act_lora", in_join.act_lora_kernel,
         dict(ptrs("c1_ptr", "t1_ptr", "bg_ptr", "bu_ptr", "a2_ptr", "h_ptr"), t2_ptr="*fp32", topk_ids_ptr=i32,
              token_lora_ptr=i32, lora_ranks_ptr=i32), dict(BLOCK=64, BLOCK_R=64, HAS_RANKS=True)),
        ("in_join.sum_lora", in_join.sum_lora_kernel,
         dict(ptrs("c3_ptr", "b2_ptr", "y_ptr"), t2_ptr="*fp32", topk_ids_ptr=i32, weights_ptr="*fp32",
              token_lora_ptr=i32, lora_ranks_ptr=i32),
         dict(TOP_K=8, BLOCK=32, BLOCK_R=16, BLOCK_J=8, BLOCK_T=8, HAS_RANKS=True)),
        ("in_k.shrink_tail", in_k.shrink_tail_kernel, tail, dict(tail_c, TOKEN_ROWS=False)),
        ("in_k.shrink_tail, token rows (w13)", in_k.shrink_tail_kernel, tail, dict(tail_c, TOKEN_ROWS=True)),
        ("in_k.shrink_tail, both w13 slices from one read", in_k.shrink_tail_kernel, tail,
         dict(tail_c, TOKEN_ROWS=True, BOTH_SLICES=True)),
        ("combine.gather_sum", combine.gather_sum_kernel, dict(ptrs("rows_ptr", "y_ptr"), pos_ptr="*i64"),
         dict(BLOCK=1024)),
    ]
    ai = dict(topk_ids_ptr="*i64", token_lora_ptr="*i64", counts_ptr=i32, totals_ptr=i32, ranks_ptr=i32,
              sorted_pairs_ptr=i32, block_lora_ptr=i32, block_expert_ptr=i32)
    cases += [
        ("align.count", align.count_kernel, ai, dict(SUB=128, GP=1024, RANKS=True, PDL=True)),
        ("align.scan", align.scan_kernel, ai, dict(CT=64, GB=64, GP=1024, PDL=True)),
        ("align.place", align.place_kernel, ai, dict(SUB=128, GP=1024, BB=64, BSP=128, RANKS=True, PDL=True)),
        ("align.sort", align.sort_kernel, ai, dict(NP=4096, FILL=1024)),
    ]
    for name, kernel, types, constexprs in cases:
        compiled = build(kernel, types, constexprs)
        assert compiled.asm.get("cubin"), name
        print(f"ok {name}: shared {compiled.metadata.shared} bytes, sm_90 cubin {len(compiled.asm['cubin'])} bytes")
    # the register story of the fused kernel at r = 512, BLOCK_M = 64 (w13: no routing weight), as in
    # data/h200/registers.csv: one 512-wide register tile spills to the stack; four tiles of 128 do not
    base = dict(common, MUL_ROUTED_WEIGHT=False, N_CHUNKS=1, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, EVEN_K=True,
                HAS_RANKS=False)
    tiled = resources(build(one_shot.one_shot_kernel, lora, dict(base, BLOCK_R=128, RANK_TILES=4, **launched(128))))
    whole = resources(build(one_shot.one_shot_kernel, lora, dict(base, BLOCK_R=512, RANK_TILES=1, **launched(512))))
    print(f"one_shot r=512: 4 tiles of 128 -> {tiled}; 1 tile of 512 -> {whole}")
    # triton 3.6 (the compiler of data/h200/registers.csv): no spill at all with rank tiles; triton 3.7's
    # bundled ptxas keeps a small stack (320 bytes), still a fraction of the single tile's
    if triton.__version__.startswith("3.6."):
        assert tiled["stack"] == 0 and whole["stack"] > 0, (tiled, whole)
    else:
        assert tiled["stack"] * 8 <= whole["stack"], (tiled, whole)
    # the in-GEMM LoRA at its widest (128 stacked adapter columns, BLOCK_M 16) must not spill either
    fused = resources(build(in_gemm.moe_gemm_lora_kernel, gemm, dict(gemm_c, BLOCK_M=16, GROUP_M=1, BLOCK_LR=128,
                                                                     HAS_RANKS=False, T_IN=False)))
    print(f"moe_gemm_lora with 128 LoRA columns -> {fused}")
    assert fused["stack"] == 0, fused
    # the shrink that keeps both slices' accumulators (2 x [64, 64] fp32 at 4 warps) must not spill
    both = resources(build(two_kernel.shrink_kernel, lora, dict(BLOCK_M=64, BLOCK_K=64, BLOCK_R=64, TOKEN_ROWS=True,
                                                               DOT_PRECISION="tf32", HAS_RANKS=False,
                                                               BOTH_SLICES=True)))
    print(f"shrink of both slices, BLOCK_R 64 -> {both}")
    assert both["stack"] == 0, both
    # the w13 GEMM whose last K steps read the pair's tail row, at the rule's largest tiles (TMA for W)
    tma = dict(gemm, w_desc="tensordesc<bf16[256, 64]>")
    tail_gemm = resources(build(base_moe.moe_gemm_kernel, tma, dict(gemm_c, BLOCK_M=128, BLOCK_N=256, GROUP_M=8,
                                                                      W_TMA=True, X_TAIL=True),
                                num_warps=8, num_stages=4))
    plain_gemm = resources(build(base_moe.moe_gemm_kernel, tma, dict(gemm_c, BLOCK_M=128, BLOCK_N=256, GROUP_M=8,
                                                                       W_TMA=True), num_warps=8, num_stages=4))
    print(f"moe_gemm 128 x 256, x tail -> {tail_gemm}; without -> {plain_gemm}")
    assert tail_gemm["stack"] == 0, tail_gemm
    # the same with half tiles for blocks whose second half is padding: the two K loops (128 and 64 rows) must
    # share the shared memory (their pipelines are never live at once) and not spill
    for x_tail in (False, True):
        built = build(base_moe.moe_gemm_kernel, tma, dict(gemm_c, BLOCK_M=128, BLOCK_N=256, GROUP_M=8, W_TMA=True,
                                                          X_TAIL=x_tail, HALF_TAIL=True), num_warps=8, num_stages=4)
        res, shared = resources(built), built.metadata.shared
        print(f"moe_gemm 128 x 256 with half tiles, x tail {x_tail} -> {res}, shared {shared} bytes")
        assert res["stack"] == 0 and shared <= SHARED_PER_BLOCK, (res, shared)
    # the shrink and its GEMM in one launch (in_k_overlap), at the GEMM's largest tiles: w13 (token rows, TMA for W,
    # both slices shrunk from one read) and w2 (pair rows, routing weights, W by pointer)
    overlap = dict(ptrs("h_ptr", "a0_ptr", "a1_ptr", "tail_ptr", "x_ptr", "w_ptr", "out_ptr"), counters_ptr=i32,
                   s_sorted_pairs_ptr=i32, s_block_lora_ptr=i32, s_block_expert_ptr=i32, token_lora_ptr=i32,
                   lora_ranks_ptr=i32, topk_weights_ptr="*fp32", sorted_pairs_ptr=i32, block_expert_ptr=i32,
                   w_desc="tensordesc<bf16[256, 64]>")
    overlap_c = dict(S_BLOCK_M=64, S_BLOCK_K=64, BLOCK_R=16, BLOCK_LR=64, FILL_ROWS=32, HAS_RANKS=False,
                     BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, DOT_PRECISION="tf32")
    for name, extra in (("w13", dict(S_TOKEN_ROWS=True, BOTH_SLICES=True, TOKEN_ROWS=True, MUL_ROUTED_WEIGHT=False,
                                      W_TMA=True)),
                        ("w2", dict(S_TOKEN_ROWS=False, BOTH_SLICES=False, TOKEN_ROWS=False, MUL_ROUTED_WEIGHT=True,
                                    W_TMA=False))):
        res = resources(build(in_k_overlap.gemm_after_shrink_kernel, overlap, dict(overlap_c, **extra), num_warps=8,
                              num_stages=4))
        print(f"ok in_k_overlap.gemm_after_shrink {name} -> {res}")
        assert res["stack"] == 0, res


if __name__ == "__main__":
    sys.exit(main())
