"""Launchers of the FP8 base GEMM (w8a8: e4m3 activations and weights, float32 block scales) and of the
activation quantization that feeds it.

Shape legend: M tokens, k top-k, E experts, K in, N out, P = M*k pairs, G the activation group,
(BN, BK) the weight's scale block, SKx = ceil(K / G).

The GEMM runs on the bf16 base GEMM's routing plan (a :class:`~moelora_lab.blocks.BlockList` grouped by
expert) with its tile rule (``base_moe.gemm_tiles``), BLOCK_K fitted to the scales: a K step of the kernel
must lie inside one activation group and one weight block along K, and an FP8 dot steps through at least
MIN_BLOCK_K columns, so BLOCK_K is a power of two >= 32 dividing G and BK (each where it is shorter than K).
The rule's tiles are the bf16 GEMM's (BLOCK_N narrowed where the two fp32 tiles of a K step would spill), not
tuned for FP8.

:func:`base_gemm` is the one dispatch point of the layer's base GEMMs: the FP8 GEMM for an :class:`FP8Weight`
(its activations quantized here, its tiles by this module's rule, not the plan's), the bf16 GEMM otherwise.
"""
from __future__ import annotations

import torch
import triton

from .._backend import INTERPRET, on_device
from ..base_moe import block_tiles, gemm_tiles, launch_tiles, moe_gemm
from ..blocks import BlockList
from ..kernels.base_moe_fp8 import moe_gemm_fp8_kernel, quantize_rows_kernel
from ..validate import FLOAT_DTYPES, check_bool, check_int, check_same_device, check_tensor
from .format import BLOCK_SIZE, FP8_DTYPE, GROUP_SIZE, FP8Weight

MIN_BLOCK_K = 32      # an FP8 tensor-core dot takes K in steps of 32 or more (NVIDIA)
MAX_BLOCK_K = 128     # one scale group of the checkpoints' format per K step
QUANT_TILE = 4096     # elements of x one quantize program holds: up to 16 rows of a 128-column group
# A program holds its fp32 accumulator and one K step's scaled partial product: beyond 64 x 256 elements (8 warps)
# they spill on sm_90 (compiled with ptxas, not timed), so wider rule tiles get a narrower BLOCK_N
MAX_TILE_ELEMENTS = 64 * 256
TILE_KEYS = {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "W_TMA", "HALF_TAIL"}


def quantize_rows(x: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] (fp32/fp16/bf16, any strides) as (xq [M, K] float8_e4m3fn, x_scale [M, ceil(K / G)] fp32),
    one scale per row and group of ``group_size`` columns, by a Triton kernel: bit for bit
    ``quant.quantize_activation`` on finite input."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, legend="[M, K]")
    G = check_int("group_size", group_size, low=1)
    M, K = x.shape
    SK = triton.cdiv(K, G)
    xq = torch.empty(M, K, dtype=FP8_DTYPE, device=x.device)
    x_scale = torch.empty(M, SK, dtype=torch.float32, device=x.device)
    if M == 0 or K == 0:
        return xq, x_scale
    block_g = triton.next_power_of_2(min(G, K))
    rows = max(1, min(16, QUANT_TILE // block_g))
    emulate = not native_fp8(x.device)                 # the interpreter's FP8 cast misrounds: bytes by hand
    q = xq.view(torch.uint8) if emulate else xq
    with on_device(x):
        quantize_rows_kernel[(triton.cdiv(M, rows) * SK,)](
            x, q, x_scale, M, K, G, x.stride(0), x.stride(1), q.stride(0), q.stride(1), x_scale.stride(0),
            x_scale.stride(1), BLOCK_ROWS=rows, BLOCK_G=block_g, EMULATE_FP8=emulate)
    return xq, x_scale


def native_fp8(device: torch.device) -> bool:
    """Whether kernels on ``device`` cast to FP8 and multiply FP8 natively: a GPU of compute capability 8.9 or
    later (Ada, Hopper), not the interpreter."""
    return not INTERPRET and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_block_k(K: int, group_size: int, w_block_k: int, limit: int = MAX_BLOCK_K) -> int:
    """The widest BLOCK_K (a power of two, MIN_BLOCK_K .. ``limit``) whose K steps each lie inside one activation
    group of ``group_size`` and one weight block of ``w_block_k`` columns; a period of K or more is one scale
    along K and constrains nothing. A ValueError names the argument no BLOCK_K fits."""
    bk = max(MIN_BLOCK_K, min(limit, triton.next_power_of_2(max(K, 1))))
    for name, period, what in (("group_size", group_size, "an activation group"),
                               ("w", w_block_k, "a weight scale block (block_size[1])")):
        if period >= K:
            continue
        if period % MIN_BLOCK_K:
            fix = ("quantize x with group_size a multiple of 32 (default 128), or group_size >= K for one scale "
                   "per row" if name == "group_size" else
                   "quantize w with block_size (BN, BK), BK a multiple of 32 such as (128, 128) (BN any), or "
                   "block_size=None for one scale per expert")
            raise ValueError(f"{name}: {what} of {period} columns (< K = {K}) cannot hold whole K steps: the FP8 "
                             f"GEMM steps through K by a power of two >= {MIN_BLOCK_K} columns; {fix}")
        bk = min(bk, period & -period)
    return bk


def fp8_gemm_tiles(num_pairs: int, num_experts: int, K: int, group_size: int = GROUP_SIZE,
                   w_block_k: int = BLOCK_SIZE[1]) -> dict:
    """Tiles of the FP8 grouped GEMM: the bf16 rule (``base_moe.gemm_tiles``: BLOCK_M by pairs per expert) with
    BLOCK_K from :func:`fp8_block_k` and BLOCK_N narrowed to MAX_TILE_ELEMENTS / BLOCK_M where wider."""
    tiles = dict(gemm_tiles(num_pairs, num_experts), BLOCK_K=fp8_block_k(K, group_size, w_block_k))
    tiles["BLOCK_N"] = min(tiles["BLOCK_N"], MAX_TILE_ELEMENTS // tiles["BLOCK_M"])
    return tiles


def moe_gemm_fp8(xq: torch.Tensor, x_scale: torch.Tensor, w: FP8Weight, blocks: BlockList, out: torch.Tensor, *,
                 top_k: int, token_rows: bool = True, topk_weights: torch.Tensor | None = None,
                 mul_routed_weight: bool = False, config: dict | None = None,
                 group_size: int = GROUP_SIZE) -> torch.Tensor:
    """out[p] = (w_p *) Wd[e_p] @ Xd[row(p)] for every pair the ``blocks`` hold, Wd and Xd the values the FP8
    operands stand for; accumulated in fp32, stored in out's dtype. Returns ``out``.

    xq: [M, K] float8_e4m3fn token rows (``token_rows``: pair p reads row p // top_k) or [P, K] pair rows;
    x_scale: [rows, ceil(K / group_size)] fp32 (``quantize_rows``); w: an FP8Weight [E, N, K]; out: [P, N]
    fp32/fp16/bf16, rows of pairs the blocks leave out untouched; topk_weights: [P] or [M, k] fp32, read with
    ``mul_routed_weight`` (and ignored without); ``group_size``: x_scale's G. Any strides. ``config``: tile
    values replacing the rule's (:func:`fp8_gemm_tiles`), as in ``base_moe.moe_gemm``'s ``tiles`` (W_TMA,
    HALF_TAIL included); BLOCK_M must be ``blocks``' block size.
    """
    if not isinstance(w, FP8Weight):
        raise TypeError(f"w: expected an FP8Weight (quant.quantize_weight makes one), got {type(w).__name__}")
    if not isinstance(blocks, BlockList):
        raise TypeError(f"blocks: expected a BlockList (routing.block_list), got {type(blocks).__name__}")
    E, N, K = w.shape
    P, _, G = _check_operands(xq, x_scale, w, blocks, out, top_k, token_rows, mul_routed_weight, group_size)
    weights = _routing_weights(topk_weights, P, xq.device) if mul_routed_weight else None
    tiles = _tiles(config, P, E, K, G, w.block_size[1])
    try:
        tiles, half = block_tiles(tiles, blocks)
        tiles, warps, stages, w_tma, w_desc = launch_tiles(tiles, w.data)
    except ValueError as err:           # the bf16 GEMM's checks call its argument "tiles"; here it is "config"
        msg = str(err)
        raise ValueError("config" + msg[len("tiles"):] if msg.startswith("tiles:") else msg) from None
    if P == 0 or N == 0:
        return out
    grid = (blocks.num_blocks * triton.cdiv(N, tiles["BLOCK_N"]),)
    with on_device(xq):
        moe_gemm_fp8_kernel[grid](
            xq, x_scale, w.data, w_desc, w.scale, out, weights if weights is not None else out,
            blocks.sorted_pairs, blocks.block_expert, P, top_k, K, N, blocks.num_blocks, G, *w.block_size,
            xq.stride(0), xq.stride(1), x_scale.stride(0), x_scale.stride(1), *w.data.stride(), *w.scale.stride(),
            out.stride(0), out.stride(1), TOKEN_ROWS=token_rows, MUL_ROUTED_WEIGHT=mul_routed_weight,
            W_TMA=w_tma, HALF_TAIL=half, num_warps=warps, num_stages=stages, **tiles)
    return out


def _check_operands(xq, x_scale, w: FP8Weight, blocks: BlockList, out, top_k, token_rows, mul_routed_weight,
                    group_size) -> tuple[int, int, int]:
    """(P, the rows of xq, G) after checking every tensor's dtype, shape and device against w and each other."""
    E, N, K = w.shape
    k = check_int("top_k", top_k, low=1)
    check_bool("token_rows", token_rows)
    check_bool("mul_routed_weight", mul_routed_weight)
    G = check_int("group_size", group_size, low=1)
    check_tensor("out", out, ndim=2, dtypes=FLOAT_DTYPES, shape=(None, N), legend="[P, N] (one row per pair)")
    P = out.shape[0]
    if token_rows and P % k:
        raise ValueError(f"out: {P} rows is not a whole number of tokens of top_k = {k} pairs; with token_rows "
                         "out has one row per (token, slot) pair")
    rows = P // k if token_rows else P
    legend = "[M, K] token rows (token_rows=True)" if token_rows else "[P, K] pair rows (token_rows=False)"
    check_tensor("xq", xq, ndim=2, dtypes=(FP8_DTYPE,), shape=(rows, K), legend=legend)
    check_tensor("x_scale", x_scale, ndim=2, dtypes=(torch.float32,), shape=(rows, triton.cdiv(K, G)),
                 legend=f"[rows of xq, ceil(K / {G})] (quantize_rows(x, group_size={G}))")
    check_same_device(xq=xq, x_scale=x_scale, w=w.data, out=out, blocks=blocks.sorted_pairs)
    if not INTERPRET and not native_fp8(xq.device):
        raise ValueError(f"xq: the FP8 GEMM multiplies on FP8 tensor cores, which {xq.device} lacks: it needs a GPU "
                         "of compute capability 8.9 or later (Ada, Hopper), or the Triton interpreter on the CPU")
    stamp = blocks.routing
    if (stamp.num_tokens * stamp.top_k, stamp.top_k, stamp.num_experts) != (P, k, E):
        raise ValueError(f"blocks: built for {stamp.num_tokens} tokens x top-{stamp.top_k} over "
                         f"{stamp.num_experts} experts, but out has {P} pair rows, top_k = {k} and w has {E} "
                         "experts; build them from this call's routing")
    return P, rows, G


def _routing_weights(topk_weights, P: int, device) -> torch.Tensor:
    """topk_weights as [P] fp32 contiguous (the kernel reads pair p's weight at topk_weights_ptr + p)."""
    if topk_weights is None:
        raise ValueError("topk_weights: mul_routed_weight=True needs the routing weights ([M, k] or [P] fp32)")
    check_tensor("topk_weights", topk_weights, ndim=(1, 2), dtypes=(torch.float32,), legend="[M, k] or [P]")
    if topk_weights.numel() != P:
        raise ValueError(f"topk_weights: expected {P} weights (one per pair row of out), got shape "
                         f"{tuple(topk_weights.shape)}")
    check_tensor("topk_weights", topk_weights, device=device)
    return topk_weights.reshape(-1).contiguous()


def _tiles(config, P: int, E: int, K: int, G: int, w_block_k: int) -> dict:
    """The rule's tiles with ``config``'s values in their place, BLOCK_K checked against the scales."""
    tiles = fp8_gemm_tiles(P, E, K, G, w_block_k)
    if config is None:
        return tiles
    fits = tiles["BLOCK_K"]
    if not isinstance(config, dict) or not set(config) <= TILE_KEYS:
        extra = sorted(set(config) - TILE_KEYS) if isinstance(config, dict) else type(config).__name__
        raise ValueError(f"config: expected a dict of tile values among {sorted(TILE_KEYS)}, got {extra}")
    tiles.update(config)
    bk = tiles["BLOCK_K"]
    periods = [p for p in (G, w_block_k) if p < K]
    if (isinstance(bk, bool) or not isinstance(bk, int) or bk < MIN_BLOCK_K or bk & (bk - 1)
            or any(p % bk for p in periods)):
        raise ValueError(f"config: BLOCK_K = {bk!r} must be a power of two >= {MIN_BLOCK_K} dividing the activation "
                         f"group ({G}) and the weight's scale block along K ({w_block_k}) wherever they are shorter "
                         f"than K = {K}; {fits} fits")
    return tiles


def base_gemm(x: torch.Tensor, w, blocks: BlockList, out: torch.Tensor, *, top_k: int,
              topk_weights: torch.Tensor | None = None, tiles: dict | None = None,
              group_size: int = GROUP_SIZE) -> torch.Tensor:
    """The layer's base grouped GEMM on either base: out[p] = (w_p *) W[e_p] @ x_row(p). Returns ``out``.

    ``w`` a tensor [E, N, K]: ``base_moe.moe_gemm`` as it is (``tiles`` its tiles). ``w`` an :class:`FP8Weight`:
    x's rows quantized per group of ``group_size`` columns (:func:`quantize_rows`, token rows [M, K] or pair rows
    [P, K] as given), then :func:`moe_gemm_fp8` with its own tile rule (:func:`fp8_gemm_tiles`); ``tiles``, the
    bf16 GEMM's, do not apply to it and are ignored except their BLOCK_M, which must be ``blocks``' block size
    anyway. ``topk_weights`` [P] fp32 or None (None: no routing weight), as for ``moe_gemm``."""
    if not isinstance(w, FP8Weight):
        return moe_gemm(x, w, blocks, out, top_k=top_k, topk_weights=topk_weights, tiles=tiles)
    E, _, K = w.shape
    P = out.shape[0]
    xq, x_scale = quantize_rows(x, group_size)
    rule = fp8_gemm_tiles(P, E, K, group_size, w.block_size[1])
    config = None
    if rule["BLOCK_M"] != blocks.block_size:      # blocks planned for other tiles: keep the FP8 rule's narrowing
        bm = blocks.block_size
        config = dict(BLOCK_M=bm, BLOCK_N=max(16, min(rule["BLOCK_N"], MAX_TILE_ELEMENTS // bm)))
    return moe_gemm_fp8(xq, x_scale, w, blocks, out, top_k=top_k, token_rows=x.shape[0] != P or top_k == 1,
                        topk_weights=topk_weights, mul_routed_weight=topk_weights is not None, config=config,
                        group_size=group_size)
