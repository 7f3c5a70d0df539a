"""The tiles of one LoRA launch (:class:`KernelConfig`): the type the tile rules of ``rules`` and
``dispatch`` are written in, in a module of its own so that ``rules`` names tiles without importing
the dispatcher (which imports ``rules``).

Shape legend: r rank.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

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
