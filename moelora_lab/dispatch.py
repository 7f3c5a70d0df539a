"""Tile configs and the ``path="auto"`` rule.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, K in, N out, S slices.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ._backend import INTERPRET
from .validate import check_int

def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class KernelConfig:
    """Tiles of one launch. ``block_r=None`` picks the rank tile from r and ``max_block_r``."""

    block_m: int = 16           # pairs per block (the alignment block size); >= 16 for tl.dot
    block_n: int = 64
    block_k: int = 64
    block_r: int | None = None
    max_block_r: int = 128      # widest fp32 [block_m, block_r] tile kept in registers
    n_chunks: int = 1           # programs sharing one slice's N columns (one-shot, small-batch)
    num_warps: int = 4
    num_stages: int = 3
    programs: int | None = None  # small-batch persistent grid size (None: 2 per SM)

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "max_block_r"):
            v = check_int(f"KernelConfig.{name}", getattr(self, name), low=16)
            if v & (v - 1):
                raise ValueError(f"KernelConfig.{name}: must be a power of two >= 16, got {v}")
        if self.block_r is not None:
            check_int("KernelConfig.block_r", self.block_r, low=16)
            if self.block_r & (self.block_r - 1):
                raise ValueError(f"KernelConfig.block_r: must be a power of two >= 16, got {self.block_r}")
        check_int("KernelConfig.n_chunks", self.n_chunks, low=1)
        check_int("KernelConfig.num_warps", self.num_warps, low=1)
        check_int("KernelConfig.num_stages", self.num_stages, low=1)
        if self.programs is not None:
            check_int("KernelConfig.programs", self.programs, low=1)

    def rank_tiling(self, rank: int) -> tuple[int, int]:
        """(BLOCK_R, RANK_TILES): the fewest register tiles that cover r, each a power of two >= 16
        (rank 0: one empty tile)."""
        rank = max(rank, 1)
        if self.block_r is not None:
            return self.block_r, -(-rank // self.block_r)
        tiles = -(-rank // self.max_block_r)
        block_r = max(16, next_pow2(-(-rank // tiles)))
        return block_r, -(-rank // block_r)

    def replace(self, **changes) -> "KernelConfig":
        return replace(self, **changes)


CONFIGS: dict[str, KernelConfig] = {
    # GPU tiles for decode-sized and prefill-sized work
    "decode": KernelConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3),
    "prefill": KernelConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3),
    # the Triton interpreter costs ~4 ms per program and loop step, whatever the tile: go big
    "interpreter": KernelConfig(block_m=32, block_n=256, block_k=256, max_block_r=512, num_warps=1, num_stages=1),
}


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


# Derived from one H200 sweep (bf16, 4 adapters, qwen3-30b-a3b and deepseek-v2-lite shapes, w13 and
# w2, M = 1 .. 8192, r = 16 .. 256: the path sweep `bench kernels` and its tile grid `bench kernels --tune`):
# * one-shot is fastest, or within ~10%, for r < 64 at every M, for every r at M = 1, and for every
#   r once M*k > 4096 (there the two-kernel path pays for T and for re-reading B per N tile);
# * for r >= 64 with a few to a few thousand pairs, the two-kernel path wins by up to 1.8x: its
#   shrink spreads the rank over programs (rank tiles in the grid), while the fused kernel walks
#   its rank tiles one after another inside one program and recomputes the shrink per N chunk;
# * the small-batch GEMV kernel never won (1.2-2.5x slower than one-shot even at M = 1: 1/16-full
#   tensor-core tiles still beat CUDA-core reductions), so ``auto`` never picks it;
# * the fused kernel needs enough programs: with few blocks, split N into chunks until there are
#   ~4 programs per SM (each chunk recomputes its shrink, cheap next to the expand at small M).
# Refined by a greedy tile walk (``python -m moelora_lab.bench tune``; the current walk is data/h200/lora_tune.csv):
# * one-shot with a 16-wide rank tile (r <= 16) runs best on 2 warps (4 warps split a 16 x 16 dot
#   four ways and mostly wait): 5-20% faster at M = 1 .. 2048, rank 16;
# * a one-shot program of 16 pairs should expand at most ``MAX_EXPAND_COLUMNS`` columns: walking 16
#   B tiles one after another cost w2 (N = 2048) 20% at M = 512, where recomputing the short shrink
#   in a second chunk is cheap;
# * 32-pair blocks stream K in 128-wide steps at rank 16 (64 was 20% slower on w2 at M = 2048).
# A second walk at r 16 started from this rule found at most 1.13x around it.
# Refined by a path probe at r 16, 64 and 256 (one-shot at 1..8 chunks, two-kernel at 2 and 4 warps), for the
# one-shot kernel before its expand change. Its path windows (outputs wider than ``MAX_EXPAND_COLUMNS`` per slice
# to two kernels at r < 128 from 128 to 16384 pairs, narrower ones at r 64 up to 2048) are superseded by the
# re-derivation at the end; of it stays:
# * the two-kernel path runs 2 warps when its blocks are at most 32 pairs and its rank tile at most 64
#   wide (up to 9% faster at r 16; level at r 64); 4 warps for 64-pair blocks or wider rank tiles.
# Refined at M = 2048 and 8192 (both presets, both ops, r 16 and 64, candidate tiles timed against the rule in
# interleaved rounds on the H200; the rule before it never walked that far):
# * with more than 24 pairs per group, a rank tile of 64 (and of 32, assumed alike) streams K in 128-wide
#   steps: one-shot 1.00-1.12x faster in all eight cells, two kernels (with 2 stages) 1.03-1.13x in seven of eight (0.95x on qwen's
#   gate/up at M = 2048, where auto runs one-shot);
# * one-shot at r 16 with more than 48 pairs per group keeps 32-pair blocks on 4 warps instead of 64-pair
#   blocks on 2: 1.03-1.15x in all four cells. With those tiles one-shot beat two kernels on wide outputs at
#   r 16 from 12288 pairs (1.03-1.12x), so two kernels stopped at 8192 pairs below r 64 (superseded below).
# Re-derived after the one-shot kernel's expand was made contiguous and pipelined (``one_shot_build_rule``),
# from the path sweep at that code (data/history/kernels_8e7be5f134.csv) and a probe of the one-shot kernel's N
# chunks (data/history/one_shot_chunks_337726be8a.csv) at r 64 and 128 (M 1..2048, both presets, both ops, every variant of a case
# in interleaved rounds, two kernels beside them):
# * one rank tile of at most 64 (r <= 64): one-shot won every cell of both sweeps by 3-37% once its chunks
#   followed ``WIDE_RANK_PROGRAMS_PER_SM``, but one (deepseek's w2, r 64, 12288 pairs: two kernels 1.10x), so
#   two kernels no longer run up to ``ONE_SHOT_MAX_RANK``;
# * one rank tile of 128 (r 65..128): two kernels won at 48-256 pairs in seven of eight cells (1.03-1.5x; qwen's
#   gate/up at 64 pairs ran one-shot 1.04x faster), while at 6-8 pairs one-shot was level or 1.10x faster, at
#   768-1024 pairs one-shot won (1.02-1.06x) and at 3072-4096 pairs they were level (0.94-1.03x): two kernels
#   from ``TWO_KERNEL_MIN_PAIRS`` to ``ONE_TILE_TWO_KERNEL_MAX_PAIRS``;
# * the chunks: a one-shot program recomputes its shrink, reading a whole [r, K] slice of A, in every N chunk, so
#   a rank tile wider than ``NARROW_RANK`` splits N only until there are ``WIDE_RANK_PROGRAMS_PER_SM`` programs
#   per SM (not ``PROGRAMS_PER_SM``) and 16-pair blocks keep every column (no ``MAX_EXPAND_COLUMNS`` cap): of
#   the 48 cells at r 64 and 128, 24 whose chunks changed were timed with the new count, 0.71-0.98x the time
#   of the old one in 23 and 1.03x in one (qwen's w2, r 128, 256 pairs); 6 changed cells (M = 8: 3, 4 or 6
#   chunks) were not timed with the new count, and the tried counts on both sides of it beat the old one.
# * two or more rank tiles (r > 128): two kernels from one pair to ``TWO_KERNEL_MAX_PAIRS`` (1.05-2x), and for
#   outputs of at least ``VERY_WIDE_COLUMNS`` per slice up to ``WIDE_MAX_PAIRS`` (deepseek's w2 at 12288 pairs:
#   1.15x; qwen's w2 at 16384: one-shot 1.10x).
# Then, from that sweep, the chunk probe and the path sweep after it (data/history/kernels_4affdc9bf8.csv),
# three runs that agreed:
# * one rank tile of 128 on outputs of at least ``VERY_WIDE_COLUMNS`` per slice (both presets' w2): two kernels
#   won at 3072-4096 pairs in all three (1.04-1.08x), while one-shot won at 768-1024 pairs (1.03x): two kernels
#   from ``ONE_TILE_WIDE_MIN_PAIRS`` to ``TWO_KERNEL_MAX_PAIRS`` there too;
# * a 16-wide rank tile with at most ``DECODE_PAIRS`` pairs (one or two tokens) streams K in
#   ``DECODE_BLOCK_K`` steps: each program holds a pair or two, and with few programs the shrink's loop trips
#   wait on memory one after another (the walk at M = 1: one-shot 1.16x on w13, 1.02x on w2; two kernels 1.24x
#   and 1.02x; at 128 pairs one-shot kept 128).
ONE_SHOT_MAX_RANK = 64            # one-shot at every size up to this rank
ONE_TILE_MAX_RANK = 128           # one rank tile up to this rank (the GPU configs' widest tile, max_block_r)
TWO_KERNEL_MIN_PAIRS = 9
ONE_TILE_TWO_KERNEL_MAX_PAIRS = 512
TWO_KERNEL_MAX_PAIRS = 4096
WIDE_MAX_PAIRS = 12288
VERY_WIDE_COLUMNS = 2048
ONE_TILE_WIDE_MIN_PAIRS = 2048
DECODE_PAIRS = 16
DECODE_BLOCK_K = 512
PROGRAMS_PER_SM = 4
WIDE_RANK_PROGRAMS_PER_SM = 2   # one-shot with a rank tile wider than NARROW_RANK
NARROW_RANK = 16            # rank tiles up to this wide: 2 warps, BLOCK_K 128 (measured at r 16 only)
MID_RANK = 64               # wider rank tiles up to this wide, many pairs per group: BLOCK_K 128 (two kernels:
                            # and 2 stages); measured at r 64 only
MAX_EXPAND_COLUMNS = 1024
TWO_KERNEL_NARROW_BLOCK_M = 32  # two-kernel blocks of at most this many pairs ...
TWO_KERNEL_NARROW_RANK = 64     # ... and rank tiles at most this wide: 2 warps


# How the one-shot kernel's expand is built (``paths.OneShotBuild``), from one H200 sweep (`bench expand`,
# data/h200/one_shot_build.csv: qwen3-30b-a3b, w13 and w2, r 16 and 64, M 64..8192, every build of a case in
# interleaved rounds). Contiguous rank offsets alone (B vectorised and pipelined) took 1.03-1.52x less time
# than before with B as given and changed nothing with B packed. Loading the next output tile one step ahead
# bought up to 1.19x more at r 64 and never lost there, but at r 16 it lost up to 1.24x (M = 2048: more
# registers, fewer programs per SM), so it runs where the rank tile is 32..64 wide. Rank tiles wider than 64
# (r >= 128) load B without the expand pipeline: with it, r 512 in four tiles of 128 spilled registers.
def one_shot_build_rule(block_r: int) -> tuple[bool, int | None]:
    """(prefetch the output tile, the expand loop's stages: None = the tile's num_stages) for a rank tile
    ``block_r`` wide (see the measurements above)."""
    if block_r > MID_RANK:
        return False, 1
    return block_r > NARROW_RANK, None


def choose_path(num_pairs: int, num_experts: int, num_loras: int, rank: int, n_out: int | None = None) -> str:
    """The ``auto`` rule (see the measurements above): one-shot, except two kernels
    * at one rank tile (``ONE_SHOT_MAX_RANK`` < r <= ``ONE_TILE_MAX_RANK``) from ``TWO_KERNEL_MIN_PAIRS`` to
      ``ONE_TILE_TWO_KERNEL_MAX_PAIRS`` pairs, and for an output of at least ``VERY_WIDE_COLUMNS`` per slice
      (``n_out``, N; None: unknown) from ``ONE_TILE_WIDE_MIN_PAIRS`` to ``TWO_KERNEL_MAX_PAIRS`` too;
    * with more rank tiles up to ``TWO_KERNEL_MAX_PAIRS`` pairs, and up to ``WIDE_MAX_PAIRS`` for a wide output."""
    if rank <= ONE_SHOT_MAX_RANK:
        return "one_shot"
    wide = n_out is not None and n_out >= VERY_WIDE_COLUMNS
    if rank <= ONE_TILE_MAX_RANK:
        few = TWO_KERNEL_MIN_PAIRS <= num_pairs <= ONE_TILE_TWO_KERNEL_MAX_PAIRS
        wide_mid = wide and ONE_TILE_WIDE_MIN_PAIRS <= num_pairs <= TWO_KERNEL_MAX_PAIRS
        return "two_kernel" if few or wide_mid else "one_shot"
    return "two_kernel" if num_pairs <= (WIDE_MAX_PAIRS if wide else TWO_KERNEL_MAX_PAIRS) else "one_shot"


# Refined for the two-stream layer, where the LoRA runs on a side stream beside the base GEMMs (H200, bf16,
# 4 adapters, qwen3-30b-a3b and deepseek-v2-lite, both paths timed inside the layer in interleaved rounds):
# the op alone prefers one-shot at few pairs, but beside the base GEMMs two kernels won
# * at r 16 from 18 pairs (18 on deepseek: 1.07 of the layer without LoRA against 1.22; 24 on qwen: 1.10
#   against 1.18; 32: 1.06 against 1.22) up to 192 (128 pairs: 1.07 against 1.09), level from 256;
#   one-shot stayed ahead at 6-16 pairs (1.08-1.12 against 1.10-1.17);
# * at r 64 from 12 pairs (12 on deepseek: 1.21 against 1.49; 16 on qwen: 1.24 against 1.31; 24: 1.18
#   against 1.44); one-shot stayed ahead at 6-8 pairs (1.13-1.15 against 1.24-1.28).
# A one-shot program at these sizes recomputes its shrink in every N chunk and the chunks are many (they
# fill the SMs when the op runs alone); beside the base GEMMs those programs queue for the same SMs.
# Then one-shot got its own chunks on the side stream (``SIDE_PROGRAMS`` per op up to ``SIDE_FEW_PAIRS`` pairs,
# not the op's two to four per SM), from a probe of the layer at M = 1..16 (qwen3-30b-a3b, r 16 and 64, both
# paths and one-shot at 1..6 w13 and 2..16 w2 chunks in interleaved rounds; data/history/side_paths_e7e5c71e57.csv):
# with about 64 programs per op, one-shot beat two kernels beside the base GEMMs at 16-32 pairs at r 64 (1.16
# against 1.23 of the layer without LoRA at 16 pairs, 1.13 against 1.17 at 24, 1.16 against 1.18 at 32) and was
# level with them at r 16 (1.05-1.10 against 1.05-1.10); with the op's chunks it was the worst of all there
# (1.21-1.37). From 48 pairs two kernels were level or ahead, at 8 pairs every chunk count within 1%.
# The same probe on both presets from 12 to 48 pairs (data/history/side_border_869129c18e.csv) moved the
# border back to 17 pairs: past 16 two kernels won on deepseek-v2-lite at every rank (18 pairs at r 64:
# 1.15 against 1.24; 24 at r 16: 1.08 against 1.11), and lost on qwen3-30b-a3b at r 64 by at most 3%
# (24 pairs: 1.18 against 1.14); one-shot kept 12-16 pairs at r 64 (1.14 against 1.22 on deepseek).
SIDE_TWO_KERNEL_MIN_PAIRS = 17      # below r 64 (measured at r 16)
SIDE_TWO_KERNEL_MAX_PAIRS = 192
SIDE_WIDE_RANK = 64                 # from this rank (measured at r 64) ...
SIDE_WIDE_RANK_MIN_PAIRS = 17       # ... two kernels from 17 pairs
SIDE_WIDE_RANK_MAX_PAIRS = 512      # ... up to the largest case measured beside the base GEMMs (64 tokens)
SIDE_FEW_PAIRS = 32                 # one-shot on the side stream up to this many pairs (when asked for) ...
SIDE_PROGRAMS = 64                  # ... splits N until each op has this many programs


def choose_side_path(num_pairs: int, num_experts: int, num_loras: int, rank: int, n_out: int | None = None) -> str:
    """The ``auto`` rule for the LoRA on the side stream of the two-stream layer: :func:`choose_path`,
    except two kernels from ``SIDE_TWO_KERNEL_MIN_PAIRS`` to ``SIDE_TWO_KERNEL_MAX_PAIRS`` pairs below
    r 64 and from ``SIDE_WIDE_RANK_MIN_PAIRS`` to ``SIDE_WIDE_RANK_MAX_PAIRS`` pairs from r 64 (see the
    measurements above)."""
    if rank >= SIDE_WIDE_RANK:
        if SIDE_WIDE_RANK_MIN_PAIRS <= num_pairs <= SIDE_WIDE_RANK_MAX_PAIRS:
            return "two_kernel"
    elif rank > 0 and SIDE_TWO_KERNEL_MIN_PAIRS <= num_pairs <= SIDE_TWO_KERNEL_MAX_PAIRS:
        return "two_kernel"
    return choose_path(num_pairs, num_experts, num_loras, rank, n_out)


def choice_rank(rank: int, lora_ranks: torch.Tensor | None) -> int:
    """The rank ``auto`` picks a path by: the largest real rank of ``lora_ranks`` ([L] per-slot ranks,
    at most ``rank``) when it can be read without a device synchronisation (a CPU tensor); otherwise
    the weights' rank r."""
    if lora_ranks is None or lora_ranks.numel() == 0 or lora_ranks.device.type != "cpu":
        return rank
    return max(0, min(rank, int(lora_ranks.max())))


def choose_config(path: str, num_pairs: int, num_groups: int, n_out: int, num_slices: int,
                  device: torch.device, *, rank: int | None = None, side_stream: bool = False) -> KernelConfig:
    """Tiles for ``path`` given the pairs, the number of (adapter, expert) groups they touch and
    the rank (``None``: unknown, the tiles that suit every rank); ``side_stream``: for a launch beside
    the base GEMMs on the two-stream layer's side stream."""
    if INTERPRET:
        return CONFIGS["interpreter"]
    return gpu_config(path, num_pairs, num_groups, n_out, num_slices, num_sms(device), rank=rank,
                      side_stream=side_stream)


def gpu_config(path: str, num_pairs: int, num_groups: int, n_out: int, num_slices: int, sms: int, *,
               rank: int | None = None, side_stream: bool = False) -> KernelConfig:
    """The GPU rule of :func:`choose_config` for a device with ``sms`` SMs (testable without one)."""
    per_group = num_pairs / max(num_groups, 1)
    base = CONFIGS["decode"] if per_group <= 24 else CONFIGS["prefill"]
    tile = None if rank is None else base.rank_tiling(rank)[0]
    narrow = tile is not None and tile <= NARROW_RANK
    block_m = 16 if per_group <= 24 else (32 if per_group <= 48 or (narrow and path == "one_shot") else 64)
    blocks = max(1, num_pairs // block_m + min(num_groups, num_pairs))
    wide_shrink = path == "one_shot" and tile is not None and tile > NARROW_RANK   # each chunk re-reads A
    target = (WIDE_RANK_PROGRAMS_PER_SM if wide_shrink else PROGRAMS_PER_SM) * sms
    if side_stream and path == "one_shot" and num_pairs <= SIDE_FEW_PAIRS:
        target = SIDE_PROGRAMS                               # beside the base GEMMs: fewer, longer programs
    block_n, n_chunks = 128, 1
    want = -(-target // (blocks * num_slices))
    if path in ("one_shot", "small_batch"):
        if want > 1:
            tiles128 = -(-n_out // 128)
            if want > tiles128:                              # more chunks than 128-wide tiles: go narrower
                block_n = 64
            n_chunks = min(want, -(-n_out // block_n))
        if block_m == 16 and not wide_shrink:
            n_chunks = max(n_chunks, -(-n_out // MAX_EXPAND_COLUMNS))
    cfg = base.replace(block_m=block_m, block_n=block_n, n_chunks=n_chunks)
    if narrow and path == "one_shot":
        cfg = cfg.replace(num_warps=4 if per_group > 48 else 2, block_k=128)
    if narrow and path in ("one_shot", "two_kernel") and num_pairs <= DECODE_PAIRS:
        cfg = cfg.replace(block_k=DECODE_BLOCK_K)
    if per_group > 24 and tile is not None and NARROW_RANK < tile <= MID_RANK:
        if path == "one_shot":
            cfg = cfg.replace(block_k=128)
        elif path == "two_kernel":
            cfg = cfg.replace(block_k=128, num_stages=2)
    if (path == "two_kernel" and rank is not None and block_m <= TWO_KERNEL_NARROW_BLOCK_M
            and cfg.rank_tiling(rank)[0] <= TWO_KERNEL_NARROW_RANK):
        cfg = cfg.replace(num_warps=2)
    return cfg
