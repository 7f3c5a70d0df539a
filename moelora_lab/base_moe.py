"""Launchers of the base MoE kernels (grouped GEMM, activation, top-k sum).

Shape legend: M tokens, k top-k, E experts, K in, N out, H hidden, I expert intermediate, P = M*k pairs.
"""
from __future__ import annotations

import torch
import triton

from . import rules
from ._backend import INTERPRET, on_device
from .kernels.base_moe import moe_gemm_kernel, silu_and_mul_kernel, topk_sum_kernel
from .blocks import BlockList


def gemm_tiles(num_pairs: int, num_experts: int, *, lora: bool = False) -> dict:
    """Tiles of the grouped GEMM: BLOCK_M from the pairs each expert gets on average."""
    if INTERPRET:
        return dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=1, num_stages=1)
    return gpu_gemm_tiles(num_pairs / num_experts, lora=lora)


def gpu_gemm_tiles(per_expert: float, *, lora: bool = False) -> dict:
    """The GPU tile rule by pairs per expert (also usable on the CPU, to read the data): small, mid and large
    tiles (``rules.GEMM_*``), W tiles by TMA where it fits (``rules.GEMM_W_TMA``)."""
    if per_expert <= rules.GEMM_SMALL_MAX_PER_EXPERT:
        tiles = dict(rules.GEMM_SMALL_TILES)
        if lora and per_expert > rules.GEMM_LORA_WIDE_K_MAX_PER_EXPERT:      # the blocks mix adapters
            tiles["BLOCK_K"] = rules.GEMM_LORA_BLOCK_K
    elif per_expert <= rules.GEMM_MID_MAX_PER_EXPERT:
        tiles = dict(rules.GEMM_MID_TILES)
    else:
        tiles = dict(rules.GEMM_LARGE_TILES)
        if per_expert > rules.GEMM_LARGE_MAX_PER_EXPERT:
            tiles["BLOCK_M"] = rules.GEMM_XL_BLOCK_M
    return dict(tiles, W_TMA=rules.GEMM_W_TMA)


def half_tail(block_m: int) -> bool:
    """Whether the grouped GEMM runs an expert's last block as a tile of BLOCK_M / 2 rows when its pairs end in
    the first half (``HALF_TAIL``): from ``HALF_TAIL_MIN_BLOCK`` rows, as Hopper's warp-group MMA takes 64 rows
    at a time (a smaller half tile would compute as many rows as the whole one)."""
    return block_m >= rules.HALF_TAIL_MIN_BLOCK


def rows_computed(per_expert: torch.Tensor, block_m: int, half: bool) -> int:
    """Rows the grouped GEMM multiplies for experts of ``per_expert`` [E] pairs: whole blocks of ``block_m``, the
    last one as a half tile when ``half`` (``HALF_TAIL``) and its pairs end in its first half."""
    full, left = per_expert // block_m, per_expert % block_m
    last = torch.where(left == 0, 0, torch.where((left <= block_m // 2) & half, block_m // 2, block_m))
    return int((full * block_m + last).sum())


def fused_columns(num_loras: int, rank: int) -> int:
    """BLOCK_LR of the in-GEMM LoRA: the L*r stacked shrink columns, a power of two >= 16."""
    return max(16, triton.next_power_of_2(num_loras * rank))


def moe_gemm(x: torch.Tensor, w: torch.Tensor, blocks: BlockList, out: torch.Tensor, *, top_k: int,
             topk_weights: torch.Tensor | None = None, tiles: dict | None = None,
             x_tail: torch.Tensor | None = None) -> torch.Tensor:
    """out[p] = (w_p *) W[e_p] @ x_row(p) for every pair, over expert-sorted ``blocks``. Inputs are trusted
    (the layer validates them).

    x: [M, K] token rows or [P, K] pair rows; w: [E, N, K]; out: [P, N]; topk_weights: [P] fp32 or None.
    ``tiles`` may add ``HALF_TAIL`` (default :func:`half_tail`: run a block whose second half is padding as a
    tile of half the rows) and ``W_TMA``: True loads W tiles by TMA bulk copies (a GPU of compute capability 9.0
    or later, or the interpreter; w's rows contiguous, evenly spaced, 16-byte aligned; a ValueError otherwise), "auto"
    (the GPU rule's value) wherever that holds and by pointer elsewhere, False by pointer.

    ``x_tail`` [S, P, C] (contiguous, x's dtype) widens every pair's x row by its own row of the tail
    of its slice (LoRA in K, ``layer_in_k``): w is then [E, N, tail_at + C] with the tail's weights
    from column tail_at = ``tail_start(x.shape[1])`` on, and slice s owns output columns s*N/S ...
    """
    E, N, K = w.shape
    P = out.shape[0]
    tiles = dict(tiles or gemm_tiles(P, E))
    tail_at = _check_tail(x, w, x_tail, P, tiles["BLOCK_K"]) if x_tail is not None else K
    tiles, half = block_tiles(tiles, blocks)
    tiles, warps, stages, w_tma, w_desc = launch_tiles(tiles, w)
    mul = topk_weights is not None
    if mul:
        topk_weights = topk_weights.contiguous()    # [P], read at topk_weights_ptr + pair
    n_slice = N if x_tail is None else N // x_tail.shape[0]
    grid = (blocks.num_blocks * (N // n_slice) * triton.cdiv(n_slice, tiles["BLOCK_N"]),)
    tail_off = (x_tail.data_ptr() - x.data_ptr()) // x.element_size() if x_tail is not None else 0
    with on_device(x):
        moe_gemm_kernel[grid](
            x, w, w_desc, out, topk_weights if mul else out, blocks.sorted_pairs, blocks.block_expert,
            P, top_k, K, N, blocks.num_blocks, n_slice, x.shape[1], tail_at, tail_off,
            x.stride(0), x.stride(1), *w.stride(), out.stride(0), out.stride(1),
            *(x_tail.stride()[:2] if x_tail is not None else (0, 0)),
            TOKEN_ROWS=x.shape[0] != P or top_k == 1, MUL_ROUTED_WEIGHT=mul, W_TMA=w_tma, X_TAIL=x_tail is not None,
            HALF_TAIL=half, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps,
            num_stages=stages, **tiles)
    return out


def block_tiles(tiles: dict, blocks: BlockList) -> tuple[dict, bool]:
    """A grouped GEMM's tile dict checked against its ``blocks`` and split: (the tiles without HALF_TAIL,
    whether blocks whose second half is padding run half tiles: ``tiles["HALF_TAIL"]``, else :func:`half_tail`)."""
    tiles = dict(tiles)
    if tiles["BLOCK_M"] != blocks.block_size:
        raise ValueError(f"blocks: block size {blocks.block_size} != BLOCK_M {tiles['BLOCK_M']}; build them with "
                         "block_list(..., block_size=gemm_tiles(...)['BLOCK_M'])")
    half = tiles.pop("HALF_TAIL", half_tail(tiles["BLOCK_M"]))
    if half not in (True, False) or (half and tiles["BLOCK_M"] % 2):
        raise ValueError(f"tiles: HALF_TAIL must be True or False (True with an even BLOCK_M), got {half!r} with "
                         f"BLOCK_M {tiles['BLOCK_M']}")
    return tiles, bool(half)


def launch_tiles(tiles: dict, w: torch.Tensor):
    """A grouped GEMM's tile dict split for a launch: (the kernel's tile constexprs, warps, stages,
    whether W tiles come by TMA, the W operand: its descriptor with TMA, else w itself)."""
    tiles = dict(tiles)
    warps, stages = tiles.pop("num_warps"), tiles.pop("num_stages")
    tiles.setdefault("GROUP_M", 1)
    w_tma = tiles.pop("W_TMA", False)
    if w_tma not in (True, False, "auto"):
        raise ValueError(f"tiles: W_TMA must be True, False or 'auto', got {w_tma!r}")
    if w_tma == "auto":
        w_tma = _tma_fits(w)
    return tiles, warps, stages, w_tma, _w_descriptor(w, tiles["BLOCK_N"], tiles["BLOCK_K"]) if w_tma else w


def tail_start(x_cols: int) -> int:
    """The column of a widened weight where the tail's weights start: x's columns rounded up to TAIL_ALIGN
    (the columns between are zeros), so no K step mixes x and the tail."""
    return triton.cdiv(x_cols, rules.TAIL_ALIGN) * rules.TAIL_ALIGN


def _check_tail(x, w, x_tail, P: int, block_k: int) -> int:
    """tail_at of a GEMM with an x tail, after checking that the tail fits x and w."""
    E, N, K = w.shape
    if not isinstance(x_tail, torch.Tensor) or x_tail.dim() != 3 or x_tail.shape[1] != P:
        raise ValueError(f"x_tail: expected a tensor [S, {P}, C] (one row per pair), got "
                         f"{getattr(x_tail, 'shape', type(x_tail).__name__)}")
    S, _, C = x_tail.shape
    tail_at = tail_start(x.shape[1])
    if K != tail_at + C or N % S:
        raise ValueError(f"w: expected [E, N, {tail_at} + {C}] with N divisible by the tail's {S} slices for x of "
                         f"{x.shape[1]} columns and a tail of {C}, got {tuple(w.shape)}; pack it with "
                         "layer_in_k.pack_w13_in_k")
    if x_tail.dtype != x.dtype or x_tail.device != x.device or not x_tail.is_contiguous() or x.stride(1) != 1:
        raise ValueError("x_tail: expected a contiguous tensor of x's dtype and device, and x with unit column "
                         "stride (call .contiguous())")
    if tail_at % block_k or (x_tail.data_ptr() - x.data_ptr()) % x.element_size():
        raise ValueError(f"tiles: BLOCK_K {block_k} must divide the tail's start {tail_at}, and x_tail be "
                         "element-aligned with x")
    return tail_at


def _tma_refusal(w: torch.Tensor) -> str | None:
    """Why W tiles cannot come by TMA bulk copies (None: they can): the GPU needs a tensor memory
    accelerator (compute capability 9.0 or later; the interpreter emulates one), and w's rows must be
    contiguous, evenly spaced (a contiguous tensor or a column slice of one, as ``layer_in_k.pack_in_k``
    makes) and 16-byte aligned."""
    if not INTERPRET and (w.device.type != "cuda" or torch.cuda.get_device_capability(w.device)[0] < 9):
        return ("tiles: W_TMA=True needs a GPU with a tensor memory accelerator (compute capability 9.0 "
                "or later); leave W_TMA out elsewhere")
    E, N, K = w.shape
    row = w.stride(1)
    if (w.stride(2) != 1 or w.stride(0) != N * row or row < K or (row * w.element_size()) % 16
            or w.data_ptr() % 16):
        return (f"w: W_TMA=True needs rows of unit column stride, evenly spaced and 16-byte aligned (K = {K} "
                f"of {w.dtype}, strides {tuple(w.stride())}); call w.contiguous() or leave W_TMA out")
    return None


def _tma_fits(w: torch.Tensor) -> bool:
    """Whether the rule loads W tiles by TMA: on a GPU (not the interpreter) that allows it, for a 16-bit
    w (fp32 tiles of the rule's size overflow shared memory with the bulk copies' buffers; they were
    never measured faster)."""
    return not INTERPRET and w.element_size() == 2 and _tma_refusal(w) is None


def _w_descriptor(w: torch.Tensor, block_n: int, block_k: int):
    """A host TMA descriptor of w viewed [E*N, K] (its row stride kept) with a [BLOCK_N, BLOCK_K] box."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    refusal = _tma_refusal(w)
    if refusal is not None:
        raise ValueError(refusal)
    E, N, K = w.shape
    return TensorDescriptor.from_tensor(w.view(E * N, K), [block_n, block_k])


def _block(n: int) -> int:
    return min(1024 if not INTERPRET else 4096, triton.next_power_of_2(n))


def _rowwise(kernel, src, dst, rows: int, cols: int, top_k: int, delta, token_lora, block: int | None = None,
             **meta):
    """Launch one (row, column tile) epilogue kernel, with or without the LoRA delta."""
    block = block or _block(cols)
    has = delta is not None
    if has:
        token_lora = token_lora.contiguous()        # the kernels read token t's adapter at token_lora_ptr + t
    with on_device(src):
        kernel[(rows, triton.cdiv(cols, block))](
            src, delta if has else src, token_lora if has else src, dst, top_k, cols, src.stride(0),
            delta.stride(0) if has else 0, dst.stride(0), BLOCK=block, HAS_DELTA=has, **meta)
    return dst


def silu_and_mul(c1: torch.Tensor, h: torch.Tensor, *, top_k: int, delta: torch.Tensor | None = None,
                 token_lora: torch.Tensor | None = None) -> torch.Tensor:
    """h = silu(gate) * up of c1 [P, 2I] (plus the LoRA delta of pairs with an adapter) into h [P, I]."""
    return _rowwise(silu_and_mul_kernel, c1, h, h.shape[0], h.shape[1], top_k, delta, token_lora,
                    DELTA_EARLY=rows_as_tile(h.shape[0]))


def topk_sum(c3: torch.Tensor, y: torch.Tensor, *, top_k: int, delta: torch.Tensor | None = None,
             token_lora: torch.Tensor | None = None) -> torch.Tensor:
    """y[t] = sum_j c3[t*k + j] (plus the LoRA delta of tokens with an adapter) into y [M, H]."""
    block_j = triton.next_power_of_2(top_k)
    tile = rows_as_tile(c3.shape[0])
    block = max(16, min(_block(y.shape[1]), rules.SUM_TILE_ELEMENTS // block_j)) if tile else None
    return _rowwise(topk_sum_kernel, c3, y, y.shape[0], y.shape[1], top_k, delta, token_lora, block,
                    BLOCK_J=block_j, ROWS_AS_TILE=tile)


def rows_as_tile(num_pairs: int) -> bool:
    """Whether the joins run their few-pairs form: the top-k sum takes a token's k rows as one tile (else it
    loops over them) and both joins load a delta row before they know its adapter (else the load waits)."""
    return num_pairs <= rules.SUM_TILE_MAX_PAIRS
