"""Routing and the metadata the kernels read: top-k routing, and pairs grouped into blocks.

    host.py    route (softmax, top-k); align_block_size and block_list (pairs grouped by adapter and expert,
               padded to blocks) in PyTorch: the spec of the block lists and what the CPU runs
    device.py  block_list_device and the layer's block lists built by the Triton kernels of kernels/align.py
               (one launch for few pairs, count / scan / place for many)

The block lists themselves (``BlockList``, ``LayerPlan``) and the stamps that remember what they were built for
are in ``moelora_lab.blocks``.
"""
from .device import block_list_device, make_block_lists, make_blocks
from .host import (Alignment, align_block_size, align_block_size_loop, block_list, block_tensors, max_blocks,
                   naive_block_list, padded_row_length, route, use_naive_assignment)

__all__ = ["block_list_device", "make_block_lists", "make_blocks", "Alignment", "align_block_size",
           "align_block_size_loop", "block_list", "block_tensors", "max_blocks", "naive_block_list",
           "padded_row_length", "route", "use_naive_assignment"]
