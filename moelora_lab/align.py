"""Launcher of the device-side routing metadata (``kernels/align.py``).

``block_list_device`` returns exactly what :func:`moelora_lab.routing.block_list` returns (the
PyTorch version, kept as the readable spec) in four small kernel launches instead of ~20 tensor ops.

Shape legend: M tokens, k top-k, E experts, L adapters, n = M*k pairs, G = L*E groups.
"""
from __future__ import annotations

import torch
import triton

from ._backend import INTERPRET, on_device
from .blocks import BlockList, RoutingStamp
from .kernels.align import count_kernel, scan_kernel, scatter_kernel, table_kernel
from .routing import block_tensors, max_blocks
from .validate import check_int, check_routing

SUB = 64           # pairs placed per step of the scatter (a [SUB, SUB] comparison finds ranks)
MAX_CHUNKS = 32    # chunks of pairs counted and scattered in parallel


def block_list_device(topk_ids: torch.Tensor, token_lora: torch.Tensor, num_experts: int, num_loras: int,
                      block_size: int, *, validate: bool = True) -> BlockList:
    """Group pairs by (adapter, expert), pad each group to ``block_size``, list the blocks (on device).

    ``validate=False`` skips the id-range checks (one device synchronisation) for checked ids.
    """
    check_int("block_size", block_size, low=1)
    check_routing(topk_ids, token_lora, num_experts, num_loras, values=validate)
    tensors = _block_tensors_device(topk_ids, token_lora, num_experts, num_loras, block_size)
    return BlockList(*tensors, RoutingStamp.of(topk_ids, token_lora, num_experts, num_loras, block_size,
                                               values_checked=validate))


def _block_tensors_device(topk_ids, token_lora, num_experts, num_loras, block_size):
    """(sorted_pairs, block_lora, block_expert) by the four kernels, for checked shapes."""
    M, k = topk_ids.shape
    n, E, L, bs, dev = M * k, num_experts, num_loras, block_size, topk_ids.device
    G = L * E
    GP = triton.next_power_of_2(G + 1)
    B = max_blocks(n, E, L, bs)
    C = max(SUB, triton.next_power_of_2(triton.cdiv(max(n, 1), MAX_CHUNKS)))
    NC = max(1, triton.cdiv(n, C))
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    lora = token_lora.to(torch.int32).contiguous()
    counts = torch.empty(NC, GP, dtype=torch.int32, device=dev)
    first = torch.empty(GP + 1, dtype=torch.int32, device=dev)
    pairs = torch.full((B * bs,), n, dtype=torch.int32, device=dev)
    block_lora = torch.empty(B, dtype=torch.int32, device=dev)
    block_expert = torch.empty(B, dtype=torch.int32, device=dev)
    bb = max(1, 4096 // GP)
    with on_device(topk_ids):
        count_kernel[(NC,)](ids, lora, counts, n, k, E, G, C=C, GP=GP)
        scan_kernel[(1,)](counts, first, NC, G, BS=bs, GP=GP)
        scatter_kernel[(NC,)](ids, lora, counts, first, pairs, n, k, E, G, C=C, SUB=SUB, GP=GP, BS=bs)
        table_kernel[(triton.cdiv(B, bb),)](first, block_lora, block_expert, B, E, G, BB=bb, GP=GP)
    return pairs, block_lora, block_expert


def make_blocks(topk_ids: torch.Tensor, token_lora: torch.Tensor | None, num_experts: int, num_loras: int,
                block_size: int, *, values_checked: bool = False) -> BlockList:
    """The BlockList for routing whose shapes were checked: device kernels on a GPU, PyTorch ops
    elsewhere (under the interpreter the few tensor ops are cheaper than interpreted kernels).

    ``token_lora=None`` groups the pairs by expert only (the base GEMM's blocks); ``values_checked``
    says whether the caller has range-checked the ids (recorded in the stamp, not done here).
    """
    L = 1 if token_lora is None else num_loras
    lora = torch.zeros_like(topk_ids[:, 0]) if token_lora is None else token_lora
    if topk_ids.is_cuda and not INTERPRET:
        tensors = _block_tensors_device(topk_ids, lora, num_experts, L, block_size)
    else:
        tensors = block_tensors(topk_ids, lora, num_experts, L, block_size, validate=False)
    return BlockList(*tensors, RoutingStamp.of(topk_ids, token_lora, num_experts, L, block_size,
                                               values_checked=values_checked))
