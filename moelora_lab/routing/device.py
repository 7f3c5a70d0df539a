"""Launcher of the device-side routing metadata (``kernels/align.py``).

``block_list_device`` returns exactly what :func:`moelora_lab.routing.block_list` returns (the
PyTorch version, kept as the readable spec); ``make_block_lists`` builds several lists from one
routing (a layer's base and LoRA lists) in the same launches: one launch while the pairs are few
(``SORT_MAX_PAIRS``) or while every program can count all of them itself (``RECOUNT_MAX_PAIRS``), three
beyond, chained on the GPU so that each kernel's programs are in place when the one before it ends;
never a fill or a cast.

Shape legend: M tokens, k top-k, E experts, L adapters, n = M*k pairs, G groups of a list.
"""
from __future__ import annotations

import contextlib

import torch
import triton

from .. import rules
from .._backend import INTERPRET, on_device
from ..blocks import BlockList, RoutingStamp
from ..kernels.align import count_kernel, place_kernel, recount_kernel, scan_kernel, sort_kernel
from .host import block_tensors, max_blocks
from ..validate import check_int, check_routing


def block_list_device(topk_ids: torch.Tensor, token_lora: torch.Tensor, num_experts: int, num_loras: int,
                      block_size: int, *, validate: bool = True) -> BlockList:
    """Group pairs by (adapter, expert), pad each group to ``block_size``, list the blocks (on device).

    ``validate=False`` skips the id-range checks (one device synchronisation) for checked ids.
    """
    check_int("block_size", block_size, low=1)
    check_routing(topk_ids, token_lora, num_experts, num_loras, values=validate)
    [tensors] = _block_tensors_device(topk_ids, token_lora, num_experts, [(num_loras, block_size)])
    return BlockList(*tensors, RoutingStamp.of(topk_ids, token_lora, num_experts, num_loras, block_size,
                                               values_checked=validate))


def _block_tensors_device(topk_ids, token_lora, num_experts: int, lists) -> list[tuple]:
    """(sorted_pairs, block_lora, block_expert) of each list, for checked shapes. ``lists`` holds
    (L, block size) per list, L = None for a list grouped by expert only."""
    if len(lists) > 2:
        raise ValueError(f"lists: at most two block lists per call, got {len(lists)}")
    M, k = topk_ids.shape
    n, E, dev = M * k, num_experts, topk_ids.device
    rows, pairs_at, blocks_at = [], 0, 0
    for L, bs in lists:
        G = E * (L or 1)
        B = max_blocks(n, E, L or 1, bs)
        rows.append((G, bs, B, pairs_at, blocks_at, int(L is not None)))
        pairs_at, blocks_at = pairs_at + B * bs, blocks_at + B
    scalars = [v for row in (rows + rows)[:2] for v in row]    # the kernels' G0 .. BY1 (one list fills both)
    NL = len(rows)
    pairs = torch.empty(pairs_at, dtype=torch.int32, device=dev)
    block_lora = torch.empty(blocks_at, dtype=torch.int32, device=dev)
    block_expert = torch.empty(blocks_at, dtype=torch.int32, device=dev)
    ids = topk_ids.reshape(-1).contiguous()                     # the kernels read pair p's id at ids + p
    lora = token_lora.contiguous() if token_lora is not None else ids      # never read for lists by expert
    out = (pairs, block_lora, block_expert)
    with on_device(topk_ids):
        if n <= rules.SORT_MAX_PAIRS:
            NP = triton.next_power_of_2(max(n, 1))
            sort_kernel[(NL,)](ids, lora, *out, n, k, E, *scalars, NP=NP, FILL=1024, num_warps=sort_warps(NP))
        elif n <= rules.RECOUNT_MAX_PAIRS:
            GP, BSP, NT = _table_sizes(rows)
            NC = triton.cdiv(n, rules.RECOUNT_SUB)
            recount_kernel[(NC + NT, NL)](ids, lora, *out, n, k, E, NC, *scalars, SUB=rules.RECOUNT_SUB,
                                          HB=rules.HIST_PAIRS, GP=GP, BB=rules.TABLE_BLOCKS, BSP=BSP,
                                          num_warps=rules.RECOUNT_WARPS)
        else:
            GP, BSP, NT = _table_sizes(rows)
            sub = chunk_pairs(n)
            NC, GB = triton.cdiv(n, sub), min(GP, rules.SCAN_GROUPS)
            counts = torch.empty(NL, NC, GP, dtype=torch.int32, device=dev)
            totals = torch.empty(NL, GP, dtype=torch.int32, device=dev)
            keep = sub >= 64               # count's in-chunk places kept for place: one compare, not two
            ranks = torch.empty(NL, n if keep else 1, dtype=torch.int32, device=dev)
            chain = chained_launches(dev)
            count_kernel[(NC, NL)](ids, lora, counts, ranks, n, k, E, NC, *scalars, SUB=sub, GP=GP, RANKS=keep,
                                   PDL=chain, num_warps=count_warps(n))
            scan_kernel[(GP // GB, NL)](counts, totals, NC, GB=GB, GP=GP, PDL=chain, launch_pdl=chain,
                                        CT=max(1, min(triton.next_power_of_2(NC), rules.SCAN_TILE // GB)))
            place_kernel[(NC + NT, NL)](ids, lora, counts, totals, ranks, *out, n, k, E, NC, *scalars, SUB=sub,
                                        GP=GP, BB=rules.TABLE_BLOCKS, BSP=BSP, RANKS=keep, PDL=chain, launch_pdl=chain)
    return [(pairs[p: p + B * bs], block_lora[b: b + B], block_expert[b: b + B]) for _, bs, B, p, b, _ in rows]


def _table_sizes(rows) -> tuple[int, int, int]:
    """GP (groups, padded; pairs left out, group G, are never counted), BSP (block size, padded) and the
    table programs per list, for the lists' (G, BS, B, ...) rows."""
    return (triton.next_power_of_2(max(r[0] for r in rows)), triton.next_power_of_2(max(r[1] for r in rows)),
            max(triton.cdiv(r[2], rules.TABLE_BLOCKS) for r in rows))


def chained_launches(device: torch.device) -> bool:
    """Whether the three launches chain by programmatic dependent launch: each kernel lets the next one's
    programs be placed early and they wait on the GPU for its results, instead of the next launch
    starting only after it ends (Hopper and later; ``PDL`` switches it off)."""
    return rules.PDL and not INTERPRET and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@contextlib.contextmanager
def construction(*, sort_max_pairs: int | None = None, recount_max_pairs: int | None = None,
                 chained: bool | None = None):
    """Inside the block, build block lists another way (to measure what each rule buys): sort in one
    program up to ``sort_max_pairs`` pairs instead of ``SORT_MAX_PAIRS``; recount in one launch up to
    ``recount_max_pairs`` instead of ``RECOUNT_MAX_PAIRS``; chain the three launches or not (``chained``,
    where the GPU can). None keeps the rule."""
    for name, value in (("sort_max_pairs", sort_max_pairs), ("recount_max_pairs", recount_max_pairs)):
        if value is not None:
            check_int(name, value, low=0)
    saved = rules.SORT_MAX_PAIRS, rules.RECOUNT_MAX_PAIRS, rules.PDL
    rules.SORT_MAX_PAIRS = saved[0] if sort_max_pairs is None else sort_max_pairs
    rules.RECOUNT_MAX_PAIRS = saved[1] if recount_max_pairs is None else recount_max_pairs
    rules.PDL = saved[2] if chained is None else bool(chained)
    try:
        yield
    finally:
        rules.SORT_MAX_PAIRS, rules.RECOUNT_MAX_PAIRS, rules.PDL = saved


def sort_warps(padded_pairs: int) -> int:
    """Warps of the one-program sort: 8 from 512 pairs (on the H200 1024 pairs took 18% less than with 4)."""
    return 4 if padded_pairs <= 256 else 8


def count_warps(num_pairs: int) -> int:
    """Warps of the three launches' count kernel: fewer as the chunks widen (on the H200 the layer's plan
    of 8192 pairs took 10% less with 2 than with 4; of 65536 pairs 30% less with 1)."""
    return 4 if num_pairs <= 4096 else 2 if num_pairs <= 8192 else 1


def chunk_pairs(num_pairs: int) -> int:
    """Pairs per chunk of the three-launch construction: 32 up to 4096 pairs, 64 up to 16384, SUB beyond
    (on the H200 the plan of 2048 and 4096 pairs took 28% and 22% less than with 128-pair chunks, the
    layer's plan of 16384 pairs 3% less with 64 than with 128)."""
    return 32 if num_pairs <= 4096 else 64 if num_pairs <= 16384 else rules.SUB


def make_block_lists(topk_ids: torch.Tensor, token_lora: torch.Tensor | None, num_experts: int, lists, *,
                     values_checked: bool = False) -> list[BlockList]:
    """BlockLists of one routing whose shapes were checked, one per (L, block size) in ``lists``
    (L = None: grouped by expert only, the base GEMM's blocks): device kernels on a GPU, all lists in
    the same launches; PyTorch ops elsewhere (under the interpreter the few tensor ops are cheaper
    than interpreted kernels). ``values_checked`` says whether the caller has range-checked the ids
    (recorded in the stamps, not done here).
    """
    lists = [(L, check_int("block_size", bs, low=1)) for L, bs in lists]
    if topk_ids.is_cuda and not INTERPRET:
        if any(L is not None for L, _ in lists) and token_lora is None:
            raise TypeError("token_lora: needed for a list grouped by adapter")
        all_tensors = _block_tensors_device(topk_ids, token_lora, num_experts, lists)
    else:
        zeros = torch.zeros_like(topk_ids[:, 0])
        all_tensors = [block_tensors(topk_ids, zeros if L is None else token_lora, num_experts, L or 1, bs,
                                     validate=False) for L, bs in lists]
    return [BlockList(*tensors, RoutingStamp.of(topk_ids, None if L is None else token_lora, num_experts, L or 1, bs,
                                                values_checked=values_checked))
            for (L, bs), tensors in zip(lists, all_tensors)]


def make_blocks(topk_ids: torch.Tensor, token_lora: torch.Tensor | None, num_experts: int, num_loras: int,
                block_size: int, *, values_checked: bool = False) -> BlockList:
    """The BlockList of one routing whose shapes were checked (see :func:`make_block_lists`);
    ``token_lora=None`` groups the pairs by expert only (the base GEMM's blocks)."""
    [blocks] = make_block_lists(topk_ids, token_lora, num_experts,
                                [(None if token_lora is None else num_loras, block_size)],
                                values_checked=values_checked)
    return blocks
