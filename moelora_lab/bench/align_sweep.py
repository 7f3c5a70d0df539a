"""``python -m moelora_lab.bench align``: the routing metadata (the block list of (adapter, expert)
groups), made by the PyTorch spec (``routing.block_list``) and by the device kernels
(``align.block_list_device``), checked equal, then each timed. Beside the rule's construction the others
are timed where they can compete: the one-program sort (``triton_sort``, up to ``SORT_ROWS_MAX_PAIRS``
pairs), the one-launch recount (``triton_recount``, up to ``RECOUNT_ROWS_MAX_PAIRS``), the three launches
(``triton_three``) and, where the rule runs those, the three not chained (``triton_unchained``).

Shape legend: M tokens, E experts, k top-k, L adapters; BLOCK_M rows per block (``--block-size``).
"""
from __future__ import annotations

import torch

from .. import rules
from ..routing import device as align
from ..routing.device import block_list_device
from ..config import MoEShape
from ..profile import timing
from ..routing.host import block_list
from .common import sweep_parser, sweep_routing

NAME = "align"
SORT_ROWS_MAX_PAIRS = 4096     # the one-program sort grows fast with the pairs (tens of µs past this)
RECOUNT_ROWS_MAX_PAIRS = 4096  # so does the recount (every program reads all pairs)


def add_parser(sub):
    a = sweep_parser(sub, NAME, "routing metadata: PyTorch ops vs device kernels", name="align",
                     presets=("qwen3-30b-a3b", "deepseek-v2-lite"), tokens=(1, 16, 64, 128, 512, 2048, 8192), dtype=False)
    a.add_argument("--block-size", type=int, default=16,
                   help="rows per block of the block list (default: %(default)s)")


def run(args) -> list[dict]:
    prov = timing.provenance(args.command)
    rows = []
    for preset in args.presets:
        shape = MoEShape.from_name(preset)
        for M in args.tokens:
            ids, _, lora = sweep_routing(shape, args.loras, M, args.seed, args.adapters)
            E, L, bs = shape.num_experts, args.loras, args.block_size
            fns = {"torch_ops": lambda: block_list(ids, lora, E, L, bs),
                   "triton_kernels": lambda: block_list_device(ids, lora, E, L, bs, validate=False)}
            n = M * shape.top_k
            sorts, recounts = n <= rules.SORT_MAX_PAIRS, rules.SORT_MAX_PAIRS < n <= rules.RECOUNT_MAX_PAIRS
            if not sorts and n <= SORT_ROWS_MAX_PAIRS:
                fns["triton_sort"] = _built(ids, lora, E, L, bs, sort_max_pairs=n)
            if not recounts and n <= RECOUNT_ROWS_MAX_PAIRS:
                fns["triton_recount"] = _built(ids, lora, E, L, bs, sort_max_pairs=0, recount_max_pairs=n)
            if sorts or recounts:
                fns["triton_three"] = _built(ids, lora, E, L, bs, sort_max_pairs=0, recount_max_pairs=0)
            else:
                fns["triton_unchained"] = _built(ids, lora, E, L, bs, chained=False)
            spec = fns["torch_ops"]().tensors
            for method, fn in list(fns.items())[1:]:              # every way against the spec
                if not all(torch.equal(a, b) for a, b in zip(spec, fn().tensors)):
                    raise RuntimeError(f"{preset} M={M}: the block list of {method} differs from block_list()")
            for method, fn in fns.items():
                t = timing.time_cuda(fn)
                rows.append(dict(preset=preset, M=M, loras=L, block_size=bs, method=method,
                                 us_median=round(t.median_us, 2), us_p20=round(t.p20_us, 2),
                                 us_p80=round(t.p80_us, 2), **prov))
    return rows


def _built(ids, lora, E, L, bs, **how):
    """block_list_device the way ``how`` says (see ``align.construction``)."""
    def build():
        with align.construction(**how):
            return block_list_device(ids, lora, E, L, bs, validate=False)
    return build
