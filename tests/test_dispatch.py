"""Every tile the GPU rule (``dispatch.gpu_config``) can return computes the reference.

The rule is asked over a grid of pairs, groups, output widths and ranks like the one its fingerprint
hashes; each distinct tile it returns (path, BLOCK_M, BLOCK_N, BLOCK_K, rank tiling; with ``--gpu`` also
warps and stages) runs once on a small problem whose sizes are not multiples of the tiles, its output
poisoned first. On CPU the interpreter ignores warps and stages; ``--gpu`` runs the tiles as compiled.
"""
import pytest
import torch

import moelora_lab as ml
from moelora_lab import rules
from moelora_lab.op.dispatch import gpu_config
from moelora_lab.op.face import moe_lora
from utils import assert_close, lora_case, poisoned

PAIRS = (1, 16, 128, 1024, 4096, 16384, 65536)
GROUPS = (1, 8, 64, 512)
OUTPUTS = ((768, 2), (2048, 1), (1408, 2))      # (N per slice, slices) of the presets' w13 and w2
RANKS = {16: 16, 32: 32, 64: 64, 128: 100, 256: 192}   # widest rank tile ... a rank not a power of two
HIDDEN, INTER = 200, 150                        # K and N per slice: multiples of no tile


def rule_tiles(device):
    """{(path, tile key): (config, rank)}: one case per distinct tile the rule returns."""
    out = {}
    for path in ("one_shot", "two_kernel", "small_batch"):
        for pairs in PAIRS:
            for groups in GROUPS:
                for n_out, slices in OUTPUTS:
                    for rank in RANKS.values():
                        cfg = gpu_config(path, pairs, min(groups, pairs), n_out, slices, 132, rank=rank)
                        key = (cfg.block_m if path != "small_batch" else None,    # a per-pair GEMV: no blocks
                               cfg.block_n, cfg.block_k, cfg.rank_tiling(rank))
                        if device == "cuda":
                            key += (cfg.num_warps, cfg.num_stages)
                        out.setdefault((path, key), (cfg, rank))
    return out


def test_the_rule_returns_the_tiles_it_is_known_for():
    """The grid reaches every BLOCK_M and BLOCK_K the rule has, so the test below runs them all."""
    tiles = rule_tiles("cuda")
    assert {k[1][0] for k in tiles if k[0] != "small_batch"} == {16, 32, 64}
    assert {k[1][2] for k in tiles} == {64, 128, 512}                                    # 512: decode, r <= 16
    assert {(k[0], k[1][5]) for k in tiles} >= {("two_kernel", 2), ("two_kernel", 3)}   # stages
    assert {(k[0], k[1][4]) for k in tiles} >= {("one_shot", 2), ("one_shot", 4)}       # warps


def test_decode_streams_k_in_long_steps_at_narrow_ranks_only():
    """At most ``DECODE_PAIRS`` pairs and a 16-wide rank tile: ``DECODE_BLOCK_K`` for one-shot and two kernels;
    one pair more, a wider rank tile or the small-batch kernel keep the tiles they had."""
    pairs, block_k = rules.DECODE_PAIRS, rules.DECODE_BLOCK_K
    for n_out, slices in OUTPUTS:
        for path in ("one_shot", "two_kernel"):
            assert gpu_config(path, pairs, pairs, n_out, slices, 132, rank=16).block_k == block_k
            assert gpu_config(path, 1, 1, n_out, slices, 132, rank=8).block_k == block_k
            assert gpu_config(path, pairs + 1, pairs + 1, n_out, slices, 132, rank=16).block_k == 128
            assert gpu_config(path, 8, 8, n_out, slices, 132, rank=32).block_k == 128
        assert gpu_config("small_batch", 8, 8, n_out, slices, 132, rank=16).block_k == 128


@pytest.mark.slow
@pytest.mark.parametrize("path", ["one_shot", "two_kernel", "small_batch"])
def test_every_rule_tile_against_the_reference(device, path):
    cases = {key: v for (p, key), v in rule_tiles(device).items() if p == path}
    assert len(cases) >= 6
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    for i, (key, (cfg, rank)) in enumerate(sorted(cases.items(), key=str)):
        p = lora_case(12 if path == "small_batch" else 40, hidden=HIDDEN, inter=INTER, experts=4, top_k=2, loras=3,
                      rank=rank, dtype=dtype, device=device, seed=i, no_adapter_fraction=0.25)
        cfg = cfg.replace(n_chunks=min(cfg.n_chunks, -(-INTER // cfg.block_n)))   # the rule never exceeds N's tiles
        if device == "cpu" and path == "small_batch":
            cfg = cfg.replace(programs=3)      # a persistent grid smaller than the work: each program loops
        args = tuple(p.w13_lora_inputs().values())
        ref = ml.moe_lora_reference(*args)
        out = moe_lora(*args, path=path, config=cfg, add_inputs=False, output=poisoned(ref.shape, dtype, device))
        rows = (p.token_lora >= 0).view(-1, 1, 1).expand_as(out)
        try:
            assert_close(out.float()[rows], ref[rows], dtype)
        except AssertionError as err:
            raise AssertionError(f"{path}, tile {key}, rank {rank}: {err}") from None
        assert torch.isnan(out[~rows].float()).all(), (path, key)


def test_the_side_stream_rule_takes_two_kernels_where_the_layer_measured_them_faster():
    """``choose_side_path``: two kernels at 17..192 pairs below r 64 and 17..512 from r 64 (the measured
    boundaries), else exactly ``choose_path``."""
    from moelora_lab.op.dispatch import choose_path, choose_side_path

    side = {r: [p for p in range(1, 4097) if choose_side_path(p, 128, 4, r, 768) == "two_kernel"] for r in (8, 16, 64)}
    assert side[16] == side[8] == list(range(17, 193))
    assert side[64] == list(range(17, 513))              # the op's rule runs one-shot at r 64
    for pairs in (1, 8, 16, 17, 32, 193, 1024, 65536):
        for rank in (0, 16, 64, 128, 256):
            for n_out in (None, 768, 1408, 2048):
                if not (17 <= pairs <= 192 and 0 < rank < 64 or 17 <= pairs <= 512 and rank >= 64):
                    assert choose_side_path(pairs, 64, 4, rank, n_out) == choose_path(pairs, 64, 4, rank, n_out)


def test_one_shot_beside_the_base_gemms_keeps_few_programs():
    """On the side stream one-shot splits N only until an op has ``SIDE_PROGRAMS`` programs, up to
    ``SIDE_FEW_PAIRS`` pairs; past them, and for every other path, the side stream gets the op's tiles."""
    def programs(cfg, pairs, slices):
        return (pairs // cfg.block_m + pairs) * slices * cfg.n_chunks      # the rule's count of blocks

    for rank in (16, 64):
        for n_out, slices in OUTPUTS:
            for pairs in (1, 8, 16, 24, rules.SIDE_FEW_PAIRS):
                alone = gpu_config("one_shot", pairs, pairs, n_out, slices, 132, rank=rank)
                side = gpu_config("one_shot", pairs, pairs, n_out, slices, 132, rank=rank, side_stream=True)
                assert side.replace(n_chunks=1, block_n=128) == alone.replace(n_chunks=1, block_n=128)
                assert side.n_chunks <= alone.n_chunks
                # enough programs (or a chunk per column tile), and one chunk fewer would not be enough
                assert (programs(side, pairs, slices) >= rules.SIDE_PROGRAMS
                        or side.n_chunks == -(-n_out // side.block_n))
                one_fewer = programs(side, pairs, slices) // side.n_chunks * (side.n_chunks - 1)
                assert (side.n_chunks == 1 or one_fewer < rules.SIDE_PROGRAMS
                        or side.n_chunks == -(-n_out // rules.MAX_EXPAND_COLUMNS))      # the expand's column cap
            for pairs, path in ((rules.SIDE_FEW_PAIRS + 1, "one_shot"), (16, "two_kernel"), (16, "small_batch")):
                assert gpu_config(path, pairs, pairs, n_out, slices, 132, rank=rank, side_stream=True) == gpu_config(
                    path, pairs, pairs, n_out, slices, 132, rank=rank)
    # the probe's cases (qwen3-30b-a3b's w13 and w2 at r 64): 16 pairs 2 and 4 chunks, 32 pairs 1 and 2
    assert [gpu_config("one_shot", p, p, n, s, 132, rank=64, side_stream=True).n_chunks
            for p in (16, 32) for n, s in ((768, 2), (2048, 1))] == [2, 4, 1, 2]
