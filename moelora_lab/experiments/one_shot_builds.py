"""The one-shot path with its kernel built each way, to time what each build choice buys
(``python -m moelora_lab.bench expand``, data/h200/one_shot_build.csv).

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, K in, N out, S slices, P = M*k pairs.

The product's one-shot launcher (``op.paths.launch_one_shot``) builds its kernel one way: one slice per
program, contiguous rank offsets, and the output prefetch and expand pipeline of the measured rule
(``op.dispatch.one_shot_build_rule``). :func:`launch` is that launcher on the kernel that keeps every
knob (``experiments/kernels/one_shot_builds.py``), built as an :class:`OneShotBuild` says; the default
build is the product's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .._backend import INTERPRET
from ..op.dispatch import KernelConfig, one_shot_build_rule
from ..op.paths import LoRACall, _block_config, _precision, _slice_pairs, _slices
from ..validate import check_int
from .kernels.one_shot_builds import one_shot_build_kernel


@dataclass(frozen=True)
class OneShotBuild:
    """How the one-shot kernel is built (the same for every tile): ``both_slices`` gives w13's two slices
    to one program, which reads its x rows once; ``prefetch_out`` loads each expand step's output tile
    one step ahead; ``expand_stages`` is the expand loop's pipeline depth (0: the tile's num_stages);
    ``clamp_ranks`` builds the rank offsets as this code once did (scattered to the compiler, see
    ``kernels.common.rank_tile``). None takes ``dispatch.one_shot_build_rule``'s choice for the tile's
    rank tile."""

    both_slices: bool = False
    prefetch_out: bool | None = None
    expand_stages: int | None = None
    clamp_ranks: bool = False

    def __post_init__(self):
        for name, none_ok in (("both_slices", False), ("prefetch_out", True), ("clamp_ranks", False)):
            value = getattr(self, name)
            if not (isinstance(value, bool) or (none_ok and value is None)):
                rule = " or None (the rule)" if none_ok else ""
                raise TypeError(f"OneShotBuild: {name} must be True or False{rule}, got {value!r}")
        if self.expand_stages is not None:
            check_int("OneShotBuild: expand_stages", self.expand_stages, low=0)


def launch(call: LoRACall, cfg: KernelConfig | None = None, build: OneShotBuild = OneShotBuild()):
    """``op.paths.launch_one_shot`` on the kernel built as ``build`` (a validated call; no device
    synchronisation). Returns the compiled kernel on a GPU."""
    x, blocks, out2d, weights = call.x, call.blocks, call.out2d, call.weights()
    M, k, L, E, R, K, N, S = call.dims
    cfg = _block_config(call, cfg, "one_shot")
    block_r, rank_tiles = cfg.rank_tiling(R)
    n_chunks = min(cfg.n_chunks, triton.cdiv(N, cfg.block_n))    # never more chunks than N tiles
    prefetch, stages = one_shot_build_rule(block_r)
    prefetch = prefetch if build.prefetch_out is None else build.prefetch_out
    stages = stages if build.expand_stages is None else (build.expand_stages or None)
    compiled = None
    for s0, ns in _slice_pairs(S):
        both = build.both_slices and ns == 2
        compiled = one_shot_build_kernel[(blocks.num_blocks, (1 if both else ns) * n_chunks)](
            x, *_slices(call.lora_a, s0), *_slices(call.lora_b, s0), out2d, weights, *blocks.tensors,
            call.ranks_or(blocks.block_lora), M * k, k, K, N, R, s0 * N,
            x.stride(0), x.stride(1), *call.lora_a[0].stride(), *call.lora_b[0].stride(), *out2d.stride(),
            N_CHUNKS=n_chunks, BLOCK_M=blocks.block_size, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            BLOCK_R=block_r, RANK_TILES=rank_tiles, TOKEN_ROWS=call.token_rows,
            MUL_ROUTED_WEIGHT=call.mul_routed_weight, ADD_INPUTS=call.add_inputs, DOT_PRECISION=_precision(x),
            HAS_RANKS=call.lora_ranks is not None, BOTH_SLICES=both, PREFETCH_OUT=prefetch, EXPAND_STAGES=stages,
            CLAMP_RANKS=build.clamp_ranks, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return compiled


def moe_lora_built(build: OneShotBuild, x, topk_ids, topk_weights, token_lora, lora_a, lora_b, output, blocks,
                   config: KernelConfig, *, mul_routed_weight: bool = False, add_inputs: bool = True,
                   lora_ranks: torch.Tensor | None = None) -> torch.Tensor:
    """``moe_lora(..., path="one_shot", output=output, blocks=blocks, config=config)`` with the kernel built as
    ``build``, on inputs ``moe_lora`` would accept (they are not checked again): x [M, K] or [M*k, K];
    topk_ids [M, k]; topk_weights [M, k] (read with ``mul_routed_weight``); token_lora [M]; lora_a S x
    [L, E, r, K] and lora_b S x [L, E, N, r] in x's dtype; output [M, k, S*N] in x's dtype; blocks the
    :class:`BlockList` of these ids at ``config.block_m``; lora_ranks [L] int32 on x's device or None.
    Returns ``output``."""
    if INTERPRET and x.dtype == torch.bfloat16:       # the interpreter mis-computes bf16: run in fp32
        out32 = output.float()
        moe_lora_built(build, x.float(), topk_ids, topk_weights, token_lora, [w.float() for w in lora_a],
                       [w.float() for w in lora_b], out32, blocks, config, mul_routed_weight=mul_routed_weight,
                       add_inputs=add_inputs, lora_ranks=lora_ranks)
        return output.copy_(out32)
    call = LoRACall(x, topk_ids, topk_weights, token_lora, list(lora_a), list(lora_b), output, blocks, lora_ranks,
                    mul_routed_weight, add_inputs)
    launch(call, config, build)
    return output
