"""The measured rules: every tile and dispatch constant the product's choices are tuned by, in one place.

Each constant carries one line above it: what was measured and its effect, and the committed data file
that holds the measurement (under ``moelora_lab/data/h200/`` or ``moelora_lab/data/history/``). How
each rule came to be, run by run, is told in ``moelora_lab/data/h200/README.md`` ("How the rules came
to be"). The functions that apply the rules stay with the code they steer (``dispatch.choose_path``,
``dispatch.gpu_config``, ``moe.gpu_gemm_tiles``, ``align``'s construction, ...) and read ``rules.X`` at
call time, so a changed rule takes effect at once. No other module keeps a copy: code that reads or
sets a rule (a probe, a test's monkeypatch, ``align.construction``) names it ``rules.X``.

A change of a rule that ``results.config_fingerprint`` covers makes every committed data file stale.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, K in, N out, P = M*k pairs.
"""
from __future__ import annotations

from .tiles import KernelConfig

# --- the LoRA op: tiles (dispatch.gpu_config) ---------------------------------------------------------------

# Tiles by work size (decode: <= 24 pairs per group); a walk from them found <= 1.13x: data/h200/lora_tune.csv
CONFIGS: dict[str, KernelConfig] = {
    "decode": KernelConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3),
    "prefill": KernelConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3),
    # the Triton interpreter costs ~4 ms per program and loop step, whatever the tile: go big
    "interpreter": KernelConfig(block_m=32, block_n=256, block_k=256, max_block_r=512, num_warps=1, num_stages=1),
}
# One-shot splits N until this many programs per SM (few blocks leave SMs idle): data/h200/lora_tune.csv
PROGRAMS_PER_SM = 4
# ... past NARROW_RANK (each chunk re-reads A): 0.71-0.98x in 23 of 24: data/history/one_shot_chunks_337726be8a.csv
WIDE_RANK_PROGRAMS_PER_SM = 2
# Rank tiles this narrow: one-shot on 2 warps (5-20% faster at r 16), K steps of 128: data/h200/lora_tune.csv
NARROW_RANK = 16
# Up to this tile: K steps of 128 at > 24 pairs/group; prefetch, no pipeline beyond: data/h200/one_shot_build.csv
MID_RANK = 64
# Columns a 16-pair one-shot program expands (more cost w2 20% at M 512): data/h200/lora_tune.csv
MAX_EXPAND_COLUMNS = 1024
# Up to these pairs at rank tile 16 the K loop waits on memory: DECODE_BLOCK_K steps: data/h200/lora_tune.csv
DECODE_PAIRS = 16
# K step at decode sizes (M 1: one-shot 1.16x on w13, two kernels 1.24x): data/h200/lora_tune.csv
DECODE_BLOCK_K = 512
# Two-kernel blocks of <= this many pairs ... run 2 warps (up to 9% at r 16): data/h200/lora_tune.csv
TWO_KERNEL_NARROW_BLOCK_M = 32
# ... with rank tiles <= this wide (level at r 64; wider: 4 warps): data/h200/lora_tune.csv
TWO_KERNEL_NARROW_RANK = 64

# --- the LoRA op: one-shot or two kernels (dispatch.choose_path) --------------------------------------------

# One-shot up to this rank at every size: won all cells but one by 3-37%: data/history/kernels_8e7be5f134.csv
ONE_SHOT_MAX_RANK = 64
# Widest rank tile (max_block_r): tiles of 128 never spill, one of 512 does: data/h200/registers.csv
ONE_TILE_MAX_RANK = 128
# One tile of 65..128: one-shot level at 6-8 pairs, lost from 48: data/history/one_shot_chunks_337726be8a.csv
TWO_KERNEL_MIN_PAIRS = 9
# ... two kernels to here; one-shot won at 768-1024 pairs: data/history/one_shot_chunks_337726be8a.csv
ONE_TILE_TWO_KERNEL_MAX_PAIRS = 512
# r > 128 (several rank tiles): two kernels 1.05-2x up to here: data/history/kernels_8e7be5f134.csv
TWO_KERNEL_MAX_PAIRS = 4096
# ... for wide outputs to here (12288: two kernels 1.15x; 16384: one-shot 1.10x): data/history/kernels_8e7be5f134.csv
WIDE_MAX_PAIRS = 12288
# Outputs this wide per slice (w2 of both presets) keep two kernels longer: data/history/kernels_4affdc9bf8.csv
VERY_WIDE_COLUMNS = 2048
# One tile of 128, wide outputs: two kernels from here (border 1536..2048): data/history/one_shot_block_m_a07c9c9d38.csv
ONE_TILE_WIDE_MIN_PAIRS = 2048

# --- the LoRA on the two-stream layer's side stream (dispatch.choose_side_path, gpu_config) -----------------

# Below r 64 two kernels from here beside the base GEMMs (won past 16 pairs): data/history/side_border_869129c18e.csv
SIDE_TWO_KERNEL_MIN_PAIRS = 17
# ... to here (r 16, 128 pairs: 1.07 against 1.09; level from 256): data/h200/layer_side_path.csv
SIDE_TWO_KERNEL_MAX_PAIRS = 192
# From this rank the side stream's wide-rank window (measured at r 64): data/history/side_border_869129c18e.csv
SIDE_WIDE_RANK = 64
# ... starts here (18 pairs: 1.15 against 1.24 of no LoRA): data/history/side_border_869129c18e.csv
SIDE_WIDE_RANK_MIN_PAIRS = 17
# ... to the largest case timed beside the base GEMMs (64 tokens): data/h200/layer_side_path.csv
SIDE_WIDE_RANK_MAX_PAIRS = 512
# One-shot on the side stream takes its own chunks up to here: data/history/side_paths_e7e5c71e57.csv
SIDE_FEW_PAIRS = 32
# ... N split to this many programs per op (r 64: 1.13-1.16 against 1.21-1.37): data/history/side_paths_e7e5c71e57.csv
SIDE_PROGRAMS = 64

# --- the base grouped GEMM (moe.gpu_gemm_tiles, moe.half_tail) ----------------------------------------------

# Up to this many pairs per expert, 128 x 128 (N x K) tiles, within 6% of the best: data/h200/gemm_tune.csv
GEMM_SMALL_MAX_PER_EXPERT = 16
# Tiles up to GEMM_SMALL_MAX_PER_EXPERT (128 x 64 lost up to 28% at M 1): data/h200/gemm_tune.csv
GEMM_SMALL_TILES = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)
# The in-GEMM LoRA keeps BLOCK_K 128 while blocks hold one or two pairs: data/h200/gemm_tune.csv
GEMM_LORA_WIDE_K_MAX_PER_EXPERT = 2
# ... and takes this once blocks mix adapters (within 7% of the best): data/h200/gemm_tune.csv
GEMM_LORA_BLOCK_K = 64
# Up to this many pairs per expert, 32-pair blocks: data/h200/gemm_tune.csv
GEMM_MID_MAX_PER_EXPERT = 32
# Tiles up to GEMM_MID_MAX_PER_EXPERT: data/h200/gemm_tune.csv
GEMM_MID_TILES = dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=3)
# Beyond: 256-wide N, 4 stages, GROUP_M 8 win by 3-8% at M 2048 and 8192: data/h200/gemm_tune.csv
GEMM_LARGE_TILES = dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)
# GEMM_LARGE_TILES' 64-pair blocks up to this many pairs per expert: data/h200/gemm_tune.csv
GEMM_LARGE_MAX_PER_EXPERT = 96
# ... blocks of this many pairs beyond: data/h200/gemm_tune.csv
GEMM_XL_BLOCK_M = 128
# W tiles by TMA where GPU and weight allow: faster in 27 of 28 cases, up to 9%: data/h200/gemm_tma.csv
GEMM_W_TMA = "auto"
# Half tiles for mostly-padding blocks from this BLOCK_M: 2-10% off every GEMM: data/history/gemm_rows_6ad55b8597.csv
HALF_TAIL_MIN_BLOCK = 128
# Widest stacked shrink (L*r, padded) the in-GEMM LoRA keeps in registers (timed at 64): data/h200/layer.csv
MAX_FUSED_COLUMNS = 128
# The in-K tail's weights start at a multiple of this (every BLOCK_K of the rules divides it): data/h200/layer_in_k.csv
TAIL_ALIGN = 128

# --- the layer's joins (moe.topk_sum, moe.rows_as_tile) -----------------------------------------------------

# Top-k sum's [k, BLOCK] tile per program (M 1..16: 11.4-12.6 -> 6.3-6.9 µs): data/history/join_tiles_313694704f.csv
SUM_TILE_ELEMENTS = 4096
# Joins' few-pairs form up to here (the plain sum's tile loses from 1536): data/history/join_border_730992bb30.csv
SUM_TILE_MAX_PAIRS = 1024

# --- the routing plan's construction (align) ----------------------------------------------------------------

# One sorting program per list up to here (128 pairs: 7.62 µs against 8.06 recounted): data/h200/align.csv
SORT_MAX_PAIRS = 256
# Then one recounting launch up to here (512 pairs: 7.97 µs against 8.86 in three launches): data/h200/align.csv
RECOUNT_MAX_PAIRS = 512
# Pairs per chunk program of the recount (not varied alone; timed with it): data/h200/align.csv
RECOUNT_SUB = 32
# Pairs per histogram step of the recount (1024 took 1.4 µs more at 512 pairs): data/h200/align.csv
HIST_PAIRS = 512
# Warps of the recount (not varied alone; timed with them): data/h200/align.csv
RECOUNT_WARPS = 4
# Widest chunk of the three launches ([SUB, SUB] compare), beyond 16384 pairs: data/h200/align.csv
SUB = 128
# Elements of one scan step ([chunks, groups] tile; not varied alone): data/history/plan_knobs_44bad395c5.csv
SCAN_TILE = 4096
# Groups per scan program (11% less than 64 at 65536 pairs; 8, 32 within 2.2%): data/history/plan_knobs_44bad395c5.csv
SCAN_GROUPS = 16
# Chain the three launches by programmatic dependent launch (1024 pairs: 9.09 µs, not 9.95): data/h200/align.csv
PDL = True
# Blocks per table program, found by binary search (32 or 128 within 2.2%): data/history/plan_knobs_44bad395c5.csv
TABLE_BLOCKS = 64

# --- the LoRA in K (in_k_launch's tail shrink) ---------------------------------------------------------------

# Pairs per zero-filling program of the tail shrink (not varied alone; timed with it): data/h200/layer_in_k.csv
FILL_ROWS = 32
