"""The LoRA op's tile rule (``gpu_config``) and its ``path="auto"`` rules (``choose_path``, and
``choose_side_path`` beside the base GEMMs). Their measured constants live in ``rules``.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, K in, N out, S slices.
"""
from __future__ import annotations

import torch

from .. import rules
from .._backend import INTERPRET
from ..tiles import KernelConfig, next_pow2  # noqa: F401  (their home before tiles.py)


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


def one_shot_build_rule(block_r: int) -> tuple[bool, int | None]:
    """(prefetch the output tile, the expand loop's stages: None = the tile's num_stages) for a rank tile
    ``block_r`` wide: prefetch from a tile wider than ``NARROW_RANK``, no expand pipeline past ``MID_RANK``."""
    if block_r > rules.MID_RANK:
        return False, 1
    return block_r > rules.NARROW_RANK, None


def choose_path(num_pairs: int, num_experts: int, num_loras: int, rank: int, n_out: int | None = None) -> str:
    """The ``auto`` rule: one-shot, except two kernels
    * at one rank tile (``ONE_SHOT_MAX_RANK`` < r <= ``ONE_TILE_MAX_RANK``) from ``TWO_KERNEL_MIN_PAIRS`` to
      ``ONE_TILE_TWO_KERNEL_MAX_PAIRS`` pairs, and for an output of at least ``VERY_WIDE_COLUMNS`` per slice
      (``n_out``, N; None: unknown) from ``ONE_TILE_WIDE_MIN_PAIRS`` to ``TWO_KERNEL_MAX_PAIRS`` too;
    * with more rank tiles up to ``TWO_KERNEL_MAX_PAIRS`` pairs, and up to ``WIDE_MAX_PAIRS`` for a wide output.
    (The small-batch kernel never won: ``auto`` never picks it.)"""
    if rank <= rules.ONE_SHOT_MAX_RANK:
        return "one_shot"
    wide = n_out is not None and n_out >= rules.VERY_WIDE_COLUMNS
    if rank <= rules.ONE_TILE_MAX_RANK:
        few = rules.TWO_KERNEL_MIN_PAIRS <= num_pairs <= rules.ONE_TILE_TWO_KERNEL_MAX_PAIRS
        wide_mid = wide and rules.ONE_TILE_WIDE_MIN_PAIRS <= num_pairs <= rules.TWO_KERNEL_MAX_PAIRS
        return "two_kernel" if few or wide_mid else "one_shot"
    return "two_kernel" if num_pairs <= (rules.WIDE_MAX_PAIRS if wide else rules.TWO_KERNEL_MAX_PAIRS) else "one_shot"


def choose_side_path(num_pairs: int, num_experts: int, num_loras: int, rank: int, n_out: int | None = None) -> str:
    """The ``auto`` rule for the LoRA on the side stream of the two-stream layer, where its programs queue
    for the SMs beside the base GEMMs: :func:`choose_path`, except two kernels from
    ``SIDE_TWO_KERNEL_MIN_PAIRS`` to ``SIDE_TWO_KERNEL_MAX_PAIRS`` pairs below ``SIDE_WIDE_RANK`` and from
    ``SIDE_WIDE_RANK_MIN_PAIRS`` to ``SIDE_WIDE_RANK_MAX_PAIRS`` pairs from it."""
    if rank >= rules.SIDE_WIDE_RANK:
        if rules.SIDE_WIDE_RANK_MIN_PAIRS <= num_pairs <= rules.SIDE_WIDE_RANK_MAX_PAIRS:
            return "two_kernel"
    elif rank > 0 and rules.SIDE_TWO_KERNEL_MIN_PAIRS <= num_pairs <= rules.SIDE_TWO_KERNEL_MAX_PAIRS:
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
        return rules.CONFIGS["interpreter"]
    return gpu_config(path, num_pairs, num_groups, n_out, num_slices, num_sms(device), rank=rank,
                      side_stream=side_stream)


def gpu_config(path: str, num_pairs: int, num_groups: int, n_out: int, num_slices: int, sms: int, *,
               rank: int | None = None, side_stream: bool = False) -> KernelConfig:
    """The GPU rule of :func:`choose_config` for a device with ``sms`` SMs (testable without one)."""
    per_group = num_pairs / max(num_groups, 1)
    base = rules.CONFIGS["decode"] if per_group <= 24 else rules.CONFIGS["prefill"]
    tile = None if rank is None else base.rank_tiling(rank)[0]
    narrow = tile is not None and tile <= rules.NARROW_RANK
    block_m = 16 if per_group <= 24 else (32 if per_group <= 48 or (narrow and path == "one_shot") else 64)
    blocks = max(1, num_pairs // block_m + min(num_groups, num_pairs))
    wide_shrink = path == "one_shot" and tile is not None and tile > rules.NARROW_RANK   # each chunk re-reads A
    target = (rules.WIDE_RANK_PROGRAMS_PER_SM if wide_shrink else rules.PROGRAMS_PER_SM) * sms
    if side_stream and path == "one_shot" and num_pairs <= rules.SIDE_FEW_PAIRS:
        target = rules.SIDE_PROGRAMS                         # beside the base GEMMs: fewer, longer programs
    block_n, n_chunks = 128, 1
    want = -(-target // (blocks * num_slices))
    if path in ("one_shot", "small_batch"):
        if want > 1:
            tiles128 = -(-n_out // 128)
            if want > tiles128:                              # more chunks than 128-wide tiles: go narrower
                block_n = 64
            n_chunks = min(want, -(-n_out // block_n))
        if block_m == 16 and not wide_shrink:
            n_chunks = max(n_chunks, -(-n_out // rules.MAX_EXPAND_COLUMNS))
    cfg = base.replace(block_m=block_m, block_n=block_n, n_chunks=n_chunks)
    if narrow and path == "one_shot":
        cfg = cfg.replace(num_warps=4 if per_group > 48 else 2, block_k=128)
    if narrow and path in ("one_shot", "two_kernel") and num_pairs <= rules.DECODE_PAIRS:
        cfg = cfg.replace(block_k=rules.DECODE_BLOCK_K)
    if per_group > 24 and tile is not None and rules.NARROW_RANK < tile <= rules.MID_RANK:
        if path == "one_shot":
            cfg = cfg.replace(block_k=128)
        elif path == "two_kernel":
            cfg = cfg.replace(block_k=128, num_stages=2)
    if (path == "two_kernel" and rank is not None and block_m <= rules.TWO_KERNEL_NARROW_BLOCK_M
            and cfg.rank_tiling(rank)[0] <= rules.TWO_KERNEL_NARROW_RANK):
        cfg = cfg.replace(num_warps=2)
    return cfg
