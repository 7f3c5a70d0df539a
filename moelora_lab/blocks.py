"""Routing metadata that outlives one call, and what it was built for.

Shape legend: M tokens, k top-k, E experts, L adapters, r rank, B blocks, BM pairs per block.

A :class:`BlockList` (pairs grouped into blocks, what the kernels read) and a :class:`LayerPlan`
(the block lists of one layer call) are worth reusing: across w13 and w2, across benchmark
repetitions, inside CUDA graphs. Reused with other routing they would give silently wrong results,
so each one carries a :class:`RoutingStamp`: the shapes it was built for, and a stamp of the
routing tensors themselves. A stamp is read on the host (no device synchronisation): the tensor
must be the same memory with the same layout, still alive, and not modified in place since
(``Tensor._version``). Under ``torch.inference_mode`` tensors keep no version, so there an
in-place change of the routing cannot be seen: rebuild the plan when the routing changes.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class TensorStamp:
    """The identity of one tensor's contents, read without a device synchronisation."""

    ref: weakref.ref
    data_ptr: int
    shape: tuple
    stride: tuple
    version: int | None       # None for inference tensors, which keep no version counter

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorStamp":
        version = None if t.is_inference() else t._version
        return cls(weakref.ref(t), t.data_ptr(), tuple(t.shape), t.stride(), version)

    def differs(self, t: torch.Tensor) -> str | None:
        """Why ``t`` is not the stamped tensor (None when it is)."""
        if self.ref() is None:
            return "the tensor it was built from no longer exists"
        if (t.data_ptr(), tuple(t.shape), t.stride()) != (self.data_ptr, self.shape, self.stride):
            return "it was built from another tensor"
        if self.version is not None and not t.is_inference() and t._version != self.version:
            return "the tensor was modified in place since"
        return None


@dataclass(frozen=True, eq=False)
class RoutingStamp:
    """What a BlockList was built for: sizes, block size, device and the routing tensors.

    ``token_lora`` is None for expert-only blocks (the base GEMM's), which ignore adapters.
    ``values_checked``: the ids were range-checked when it was built, so a call that passes the
    same (unchanged) tensors need not check them again.
    """

    num_tokens: int
    top_k: int
    num_experts: int
    num_loras: int
    block_size: int
    device: torch.device
    topk_ids: TensorStamp
    token_lora: TensorStamp | None
    values_checked: bool

    @classmethod
    def of(cls, topk_ids, token_lora, num_experts: int, num_loras: int, block_size: int, *,
           values_checked: bool) -> "RoutingStamp":
        M, k = topk_ids.shape
        return cls(M, k, num_experts, num_loras, block_size, topk_ids.device, TensorStamp.of(topk_ids),
                   None if token_lora is None else TensorStamp.of(token_lora), values_checked)


@dataclass(frozen=True, eq=False)
class BlockList:
    """All adapters' blocks in one flat list: what the Triton kernels consume.

    Pairs are grouped by (adapter, expert) ("virtual experts" v = l*E + e), each group padded to
    ``block_size`` and laid end to end, so the grid is sized from the real work:
        sorted_pairs [B * BM] int32  pair ids, sentinel M*k in padding and unused blocks
        block_lora   [B] int32       adapter of each block, -1 for unused blocks
        block_expert [B] int32       expert of each block, -1 for unused blocks
    B = floor(M*k / BM) + min(L*E, M*k) bounds the blocks any routing can need and depends only on
    shapes, so the grid stays fixed under CUDA-graph capture. Build one with
    :func:`moelora_lab.block_list` (or ``block_list_device``, ``naive_block_list``); ``routing``
    records what it was built for and is checked on every call that reuses it.
    """

    sorted_pairs: torch.Tensor
    block_lora: torch.Tensor
    block_expert: torch.Tensor
    routing: RoutingStamp

    @property
    def block_size(self) -> int:
        return self.routing.block_size

    @property
    def num_blocks(self) -> int:
        return self.block_lora.numel()

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.sorted_pairs, self.block_lora, self.block_expert

    def with_slots_disabled(self, enabled: torch.Tensor) -> "BlockList":
        """The same blocks with those of disabled adapter slots marked unused (no sync)."""
        on = enabled[self.block_lora.clamp(min=0).long()] & (self.block_lora >= 0)
        lora = torch.where(on, self.block_lora, torch.full_like(self.block_lora, -1))
        return BlockList(self.sorted_pairs, lora, self.block_expert, self.routing)


@dataclass(frozen=True, eq=False)
class LayerPlan:
    """Routing metadata of one layer call, computed once and shared by w13 and w2.

    Build it with :func:`moelora_lab.plan_layer`; the layer checks on every call that it was made
    for this call's routing tensors, adapters, rank and schedule.
    """

    base_blocks: BlockList           # pairs grouped by expert, for the base GEMMs
    lora_blocks: BlockList | None    # pairs grouped by (adapter, expert), for the LoRA ops (None: not needed)
    lora_path: str | None            # the op's Triton path the LoRA launches take (None: no LoRA launch)
    num_loras: int | None            # None: a plan for the layer without LoRA
    rank: int | None
    routing: RoutingStamp            # the routing tensors, E and L it was made for
    tiles: dict                      # the base grouped GEMMs' tiles (``moe.gemm_tiles``)
    schedule: str                    # the schedule it was made for (a row of ``layer.table``)
    lora_config: object = None       # KernelConfig of the LoRA blocks' launches (None: no LoRA blocks)
