"""The public LoRA-on-MoE op: validation, routing metadata, launchers and dispatch.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, K in, N out, S slices,
P = M*k pairs, B blocks.

    out[t, j, s*N:(s+1)*N] (+)= (w_tj if mul_routed_weight) * B_s[l, e] @ (A_s[l, e] @ x_row)

for every pair (t, j) whose token has an adapter l = token_lora[t] >= 0 (and an enabled slot),
with e = topk_ids[t, j]; x_row = x[t] (x is [M, K]) or x[t*k + j] (x is [M*k, K]).
add_inputs=True adds into ``output``; False overwrites the rows of pairs with an adapter and leaves
the others untouched. Without ``output`` a zero-filled one is allocated.
"""
from __future__ import annotations

import torch
import triton

from ._backend import INTERPRET
from ._checks import INDEX_DTYPES, check_choice, check_range, check_tensor
from .dispatch import PATHS, KernelConfig, choose_config, choose_path, num_sms
from .align import make_blocks
from .kernels.one_shot import one_shot_kernel
from .kernels.small_batch import small_batch_kernel
from .kernels.two_kernel import expand_kernel, shrink_kernel
from .reference import _check_op_inputs, moe_lora_reference
from .routing import BlockList


def pack_lora_b(lora_b):
    """LoRA B [L, E, N, r] (a tensor or a list of slices) with N fastest in memory: same shape, same values.

    The expand multiplies the rank tile by a [r, BLOCK_N] tile of B. In the usual layout (r fastest)
    that tile is BLOCK_N runs of r elements (32 bytes at r = 16, bf16); with N fastest it is r runs of
    BLOCK_N elements, which HBM serves much better (H200, rank 16, bf16: the one-shot op 5-24% faster
    at M = 16 .. 512). Every path and the layer accept either layout (the kernels take strides);
    pack once, when the adapter is loaded.
    """
    if isinstance(lora_b, (list, tuple)):
        return type(lora_b)(pack_lora_b(b) for b in lora_b)
    check_tensor("lora_b", lora_b, ndim=4, legend="[L, E, N, r]")
    return lora_b.transpose(2, 3).contiguous().transpose(2, 3)


def naive_block_list(topk_ids, token_lora, block_m: int) -> BlockList:
    """One block per pair (the naive assignment): row 0 holds the pair, the others are padding."""
    M, k = topk_ids.shape
    n, dev = M * k, topk_ids.device
    pairs = torch.full((n, block_m), n, dtype=torch.int32, device=dev)
    pairs[:, 0] = torch.arange(n, dtype=torch.int32, device=dev)
    lora = token_lora.to(torch.int32).repeat_interleave(k)
    expert = torch.where(lora >= 0, topk_ids.reshape(-1).to(torch.int32), torch.full_like(lora, -1))
    return BlockList(pairs.view(-1), lora, expert)


def _slices(ws, s0):
    """Pointers for a launch covering slices s0 and s0+1 (slice s0 twice when only one is left)."""
    return ws[s0], ws[min(s0 + 1, len(ws) - 1)]


def _launch_one_shot(x, lora_a, lora_b, out2d, weights, blocks, cfg, *, top_k, token_rows, mul, add, ranks=None):
    L, E, R, K = lora_a[0].shape
    N = lora_b[0].shape[2]
    block_r, rank_tiles = cfg.rank_tiling(R)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    a, b = lora_a[0], lora_b[0]
    n_chunks = min(cfg.n_chunks, triton.cdiv(N, cfg.block_n))    # never more chunks than N tiles
    compiled = None
    for s0 in range(0, len(lora_a), 2):
        ns = min(2, len(lora_a) - s0)
        grid = (blocks.num_blocks, ns * n_chunks)
        compiled = one_shot_kernel[grid](
            x, *_slices(lora_a, s0), *_slices(lora_b, s0), out2d, weights,
            blocks.sorted_pairs, blocks.block_lora, blocks.block_expert,
            blocks.block_lora if ranks is None else ranks,
            out2d.shape[0], top_k, K, N, R, s0 * N,
            x.stride(0), x.stride(1), *a.stride(), *b.stride(), out2d.stride(0), out2d.stride(1),
            N_CHUNKS=n_chunks, BLOCK_M=blocks.block_size, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            BLOCK_R=block_r, RANK_TILES=rank_tiles, TOKEN_ROWS=token_rows, MUL_ROUTED_WEIGHT=mul,
            ADD_INPUTS=add, DOT_PRECISION=precision, HAS_RANKS=ranks is not None,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return compiled   # the compiled kernel on a GPU (registers, spills), for profile.report


def _launch_two_kernel(x, lora_a, lora_b, out2d, weights, blocks, cfg, *, top_k, token_rows, mul, add, ranks=None):
    L, E, R, K = lora_a[0].shape
    N = lora_b[0].shape[2]
    S = len(lora_a)
    block_r, rank_tiles = cfg.rank_tiling(R)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    a, b = lora_a[0], lora_b[0]
    inter = torch.zeros(S, out2d.shape[0], R, dtype=x.dtype, device=x.device)   # [S, M*k, r] in HBM
    for s0 in range(0, S, 2):
        ns = min(2, S - s0)
        t = inter[s0:s0 + ns]
        shrink_kernel[(blocks.num_blocks, ns, rank_tiles)](
            x, *_slices(lora_a, s0), t, blocks.sorted_pairs, blocks.block_lora, blocks.block_expert,
            blocks.block_lora if ranks is None else ranks, out2d.shape[0], top_k, K, R,
            x.stride(0), x.stride(1), *a.stride(), *t.stride(),
            BLOCK_M=blocks.block_size, BLOCK_K=cfg.block_k, BLOCK_R=block_r, TOKEN_ROWS=token_rows,
            DOT_PRECISION=precision, HAS_RANKS=ranks is not None, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
        expand_kernel[(blocks.num_blocks, ns, triton.cdiv(N, cfg.block_n))](
            t, *_slices(lora_b, s0), out2d, weights, blocks.sorted_pairs, blocks.block_lora, blocks.block_expert,
            blocks.block_lora if ranks is None else ranks, out2d.shape[0], N, R, s0 * N,
            *t.stride(), *b.stride(), out2d.stride(0), out2d.stride(1),
            BLOCK_M=blocks.block_size, BLOCK_N=cfg.block_n, BLOCK_R=block_r, MUL_ROUTED_WEIGHT=mul,
            ADD_INPUTS=add, DOT_PRECISION=precision, HAS_RANKS=ranks is not None, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)


def _launch_small_batch(x, lora_a, lora_b, out2d, weights, topk_ids, token_lora, cfg, *, top_k, token_rows,
                        mul, add, ranks=None):
    L, E, R, K = lora_a[0].shape
    N = lora_b[0].shape[2]
    block_r, rank_tiles = cfg.rank_tiling(R)
    block_k = max(16, min(cfg.block_k, 8192 // block_r))       # keep the [BR, BK] partial sum small
    a, b = lora_a[0], lora_b[0]
    n_chunks = min(cfg.n_chunks, triton.cdiv(N, cfg.block_n))
    for s0 in range(0, len(lora_a), 2):
        ns = min(2, len(lora_a) - s0)
        work = out2d.shape[0] * ns * n_chunks
        programs = min(work, cfg.programs or 2 * num_sms(x.device))
        small_batch_kernel[(programs,)](
            x, *_slices(lora_a, s0), *_slices(lora_b, s0), out2d, weights, topk_ids, token_lora,
            token_lora if ranks is None else ranks, out2d.shape[0], top_k, K, N, R, s0 * N, work,
            x.stride(0), x.stride(1), *a.stride(), *b.stride(), out2d.stride(0), out2d.stride(1),
            NUM_SLICES=ns, N_CHUNKS=n_chunks, BLOCK_N=cfg.block_n, BLOCK_K=block_k, BLOCK_R=block_r,
            RANK_TILES=rank_tiles, TOKEN_ROWS=token_rows, MUL_ROUTED_WEIGHT=mul, ADD_INPUTS=add,
            HAS_RANKS=ranks is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _check_output(output, M, k, SN, x):
    check_tensor("output", output, dtypes=(x.dtype,), shape=(M, k, SN), legend="[M, k, S*N] in x's dtype")
    if output.device != x.device:
        raise ValueError(f"output: is on {output.device} but x is on {x.device}")
    if output.stride(2) != 1 or output.stride(0) != k * output.stride(1):
        raise ValueError("output: must have contiguous (token, slot) rows and columns "
                         f"(strides {tuple(output.stride())}); pass output.contiguous() or a fresh buffer")


def _check_blocks(alignment, num_pairs, device):
    if not isinstance(alignment, BlockList):
        raise TypeError(f"alignment: expected a BlockList from moelora_lab.block_list(...), "
                        f"got {type(alignment).__name__}")
    bs = alignment.block_size
    if alignment.sorted_pairs.numel() != alignment.num_blocks * bs or alignment.sorted_pairs.device != device:
        raise ValueError("alignment: malformed BlockList or on another device than x; rebuild it with block_list()")
    if bs < 16 or bs & (bs - 1):
        raise ValueError(f"alignment: block size {bs} is not a power of two >= 16 (tl.dot needs 16 rows)")
    return bs


def moe_lora(x, topk_ids, topk_weights, token_lora, lora_a, lora_b, *, path: str = "auto",
             mul_routed_weight: bool = False, output: torch.Tensor | None = None, add_inputs: bool = True,
             alignment: BlockList | None = None, config: KernelConfig | None = None,
             enabled: torch.Tensor | None = None, lora_ranks: torch.Tensor | None = None) -> torch.Tensor:
    """LoRA delta of every routed pair, added into (or written to) ``output`` [M, k, S*N].

    path: 'naive' (PyTorch reference), 'two_kernel', 'one_shot', 'small_batch' or 'auto'.
    alignment: a :class:`BlockList` to reuse (e.g. computed once for w13 and w2 of a layer).
    config: a :class:`KernelConfig`; by default one is chosen from the shapes and the device.
    enabled: optional bool [L]: slots marked False are treated as "no adapter".
    lora_ranks: optional int [L], the actual rank of each slot (<= r): the Triton paths read only
        that many rows of A and columns of B, so a rank-8 adapter in a rank-64 slot does not pay
        for 64. Weights past a slot's rank are never read (they need not even be zero).
    """
    check_choice("path", path, PATHS)
    M, k, L, E, R, K, N, S = _check_op_inputs(x, topk_ids, topk_weights, token_lora, lora_a, lora_b)
    if lora_a[0].dtype != x.dtype:
        raise TypeError(f"lora_a[0]: dtype {lora_a[0].dtype} must equal x's dtype {x.dtype}; cast the weights once")
    if config is not None and not isinstance(config, KernelConfig):
        raise TypeError(f"config: expected a KernelConfig, got {type(config).__name__}")
    if enabled is not None:
        check_tensor("enabled", enabled, dtypes=(torch.bool,), shape=(L,), legend="[L] bool, one flag per slot")
        token_lora = torch.where(token_lora >= 0, token_lora, 0)
        token_lora = torch.where(enabled.to(x.device)[token_lora.long()] & (token_lora >= 0), token_lora, -1)
    if lora_ranks is not None:
        check_tensor("lora_ranks", lora_ranks, dtypes=INDEX_DTYPES, shape=(L,), legend="[L] actual rank per slot")
        check_range("lora_ranks", lora_ranks, 0, R + 1, f"ranks of a rank-{R} slot")
        lora_ranks = lora_ranks.to(device=x.device, dtype=torch.int32).contiguous()
    num_pairs = M * k
    if alignment is not None:
        block_m = _check_blocks(alignment, num_pairs, x.device)
        if config is not None and config.block_m != block_m:
            raise ValueError(f"config.block_m={config.block_m} differs from the alignment's block size {block_m}")
    if output is None:
        output = torch.zeros(M, k, S * N, dtype=x.dtype, device=x.device)
    else:
        _check_output(output, M, k, S * N, x)
    if M == 0:
        return output
    if path == "auto":
        path = choose_path(num_pairs, E, L, R)
    if path == "naive":
        if lora_ranks is not None:                       # the spec on weights cut to each slot's rank
            keep = torch.arange(R, device=x.device)[None, :] < lora_ranks[:, None]       # [L, r]
            lora_a = [torch.where(keep[:, None, :, None], w, torch.zeros_like(w)) for w in lora_a]
            lora_b = [torch.where(keep[:, None, None, :], w, torch.zeros_like(w)) for w in lora_b]
        delta = moe_lora_reference(x, topk_ids, topk_weights, token_lora, lora_a, lora_b,
                                   mul_routed_weight=mul_routed_weight)
        owned = (token_lora >= 0).view(M, 1, 1)
        new = delta + output.float() if add_inputs else delta
        output.copy_(torch.where(owned, new.to(x.dtype), output))
        return output
    if x.device.type != "cuda" and not INTERPRET:
        raise ValueError(f"x: the Triton paths need CUDA tensors (got {x.device}); set MOELORA_INTERPRET=1 "
                         "before importing moelora_lab to run them on the CPU, or use path='naive'")
    if INTERPRET and x.dtype == torch.bfloat16:                    # the interpreter mis-computes bf16
        out32 = output.float()
        moe_lora(x.float(), topk_ids, topk_weights, token_lora, [w.float() for w in lora_a],
                 [w.float() for w in lora_b], path=path, mul_routed_weight=mul_routed_weight, output=out32,
                 add_inputs=add_inputs, alignment=alignment, config=config, lora_ranks=lora_ranks)
        return output.copy_(out32)

    if alignment is None and path != "small_batch":
        cfg = config or choose_config(path, num_pairs, min(num_pairs, L * E), N, S, x.device, rank=R)
        alignment = make_blocks(topk_ids, token_lora, E, L, cfg.block_m)
    run_lora(x, topk_ids, topk_weights, token_lora, lora_a, lora_b, output, alignment, path, config,
             mul_routed_weight=mul_routed_weight, add_inputs=add_inputs, lora_ranks=lora_ranks)
    return output


def run_lora(x, topk_ids, topk_weights, token_lora, lora_a, lora_b, output, blocks, path, config=None, *,
             mul_routed_weight=False, add_inputs=True, lora_ranks=None):
    """Launch one Triton path on inputs that were already validated (no host synchronisation).

    ``blocks`` is the :class:`BlockList` for 'one_shot' / 'two_kernel' (ignored by 'small_batch');
    ``config=None`` picks tiles from the shapes. Used by :func:`moe_lora` and by the layer, which
    validates once and shares one BlockList between w13 and w2.
    """
    M, k = topk_ids.shape
    L, E, R, K = lora_a[0].shape
    N, S = lora_b[0].shape[2], len(lora_a)
    num_pairs = M * k
    token_rows = not (x.shape[0] == num_pairs and k > 1)
    weights = topk_weights.reshape(-1).float().contiguous()
    out2d = output.view(num_pairs, S * N)
    kw = dict(top_k=k, token_rows=token_rows, mul=mul_routed_weight, add=add_inputs, ranks=lora_ranks)
    if path == "small_batch":
        cfg = config or choose_config(path, num_pairs, num_pairs, N, S, x.device, rank=R)
        _launch_small_batch(x, lora_a, lora_b, out2d, weights, topk_ids.reshape(-1).to(torch.int32).contiguous(),
                            token_lora.to(torch.int32).contiguous(), cfg, **kw)
        return
    cfg = config or choose_config(path, num_pairs, min(num_pairs, L * E), N, S, x.device, rank=R)
    cfg = cfg.replace(block_m=blocks.block_size)
    launch = _launch_one_shot if path == "one_shot" else _launch_two_kernel
    launch(x, lora_a, lora_b, out2d, weights, blocks, cfg, **kw)
