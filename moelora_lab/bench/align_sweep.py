"""``python -m moelora_lab.bench align``: the routing metadata (the block list of (adapter, expert)
groups), made by the PyTorch spec (``routing.block_list``) and by the device kernels
(``align.block_list_device``), checked equal, then each timed.

Shape legend: M tokens, E experts, k top-k, L adapters; BLOCK_M rows per block (``--block-size``).
"""
from __future__ import annotations

import torch

from ..align import block_list_device
from ..config import MoEShape
from ..profile import timing
from ..routing import block_list
from .common import sweep_parser, sweep_routing

NAME = "align"


def add_parser(sub):
    a = sweep_parser(sub, NAME, "routing metadata: PyTorch ops vs device kernels", name="align",
                     presets=("qwen3-30b-a3b", "deepseek-v2-lite"), tokens=(1, 16, 128, 512, 2048, 8192), dtype=False)
    a.add_argument("--block-size", type=int, default=16)


def run(args) -> list[dict]:
    prov = timing.provenance(args.command)
    rows = []
    for preset in args.presets:
        shape = MoEShape.from_name(preset)
        for M in args.tokens:
            ids, _, lora = sweep_routing(shape, args.loras, M, args.seed)
            E, L, bs = shape.num_experts, args.loras, args.block_size
            fns = {"torch_ops": lambda: block_list(ids, lora, E, L, bs),
                   "triton_kernels": lambda: block_list_device(ids, lora, E, L, bs, validate=False)}
            spec, dev = (fns[m]().tensors for m in ("torch_ops", "triton_kernels"))
            if not all(torch.equal(a, b) for a, b in zip(spec, dev)):
                raise RuntimeError(f"{preset} M={M}: the device kernels' block list differs from block_list()")
            for method, fn in fns.items():
                t = timing.time_cuda(fn)
                rows.append(dict(preset=preset, M=M, loras=L, block_size=bs, method=method,
                                 us_median=round(t.median_us, 2), us_p20=round(t.p20_us, 2),
                                 us_p80=round(t.p80_us, 2), **prov))
    return rows
