"""The table of LoRA paths: one entry per way of computing the op, with its launcher.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, K in, N out, S slices,
P = M*k pairs, B blocks.

Every path computes the same delta (see :func:`moelora_lab.moe_lora`); they differ in memory
traffic and launches. The dispatcher, the op, the layer, the benchmarks' command-line choices and
the README's table all read :data:`PATHS`, so adding a path means one kernel module plus one entry
here. Launchers take inputs that were already validated and never synchronise with the device.

Status: ``product`` rows are what ``auto`` may run; ``experiment`` rows were measured and lost (their
code lives in ``moelora_lab.experiments``, which no product module imports: the row names its launcher
by import path, "module:function", imported on first use). Both run when asked for by name.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import triton

from ..blocks import BlockList
from .dispatch import KernelConfig, choose_config, choose_path, choose_side_path, one_shot_build_rule
from ..kernels.one_shot import one_shot_kernel
from ..kernels.two_kernel import expand_kernel, shrink_kernel
from ..reference import moe_lora_reference
from ..validate import check_bool

STATUSES = ("product", "experiment")


class LoRACall(NamedTuple):
    """One validated call of the op, as every launcher receives it."""

    x: torch.Tensor                  # [M, K] token rows or [P, K] pair rows
    topk_ids: torch.Tensor           # [M, k]
    topk_weights: torch.Tensor | None  # [M, k] (read with mul_routed_weight)
    token_lora: torch.Tensor         # [M], -1 = no adapter (disabled slots already -1)
    lora_a: list                     # S x [L, E, r, K]
    lora_b: list                     # S x [L, E, N, r]
    output: torch.Tensor             # [M, k, S*N]
    blocks: BlockList | None         # for paths with uses_blocks
    lora_ranks: torch.Tensor | None  # [L] int32 on x's device
    mul_routed_weight: bool
    add_inputs: bool
    side_stream: bool = False        # beside the base GEMMs (the two-stream layer): the tile rule's side tiles

    @property
    def dims(self):
        M, k = self.topk_ids.shape
        L, E, R, K = self.lora_a[0].shape
        return M, k, L, E, R, K, self.lora_b[0].shape[2], len(self.lora_a)

    @property
    def token_rows(self) -> bool:
        M, k = self.topk_ids.shape
        return not (self.x.shape[0] == M * k and k > 1)

    @property
    def out2d(self) -> torch.Tensor:
        """The output as [P, S*N] rows."""
        return self.output.view(self.topk_ids.numel(), -1)

    def ranks_or(self, stand_in: torch.Tensor) -> torch.Tensor:
        """The lora_ranks pointer, or a never-read stand-in without them (HAS_RANKS=False)."""
        return stand_in if self.lora_ranks is None else self.lora_ranks

    def weights(self) -> torch.Tensor:
        """[P] fp32 routing weights (the output buffer as a never-read stand-in without them)."""
        if self.topk_weights is None:
            return self.output
        return self.topk_weights.reshape(-1).float().contiguous()


@dataclass(frozen=True)
class LoRAPath:
    """A way to compute the op, and what it supports."""

    name: str
    launcher: str | Callable     # (call, cfg) -> None: "module:function" (imported on first use) or the function
    summary: str                 # one line for the docs and the command-line help
    kernels: str                 # where its code lives
    triton: bool                 # Triton kernels: a CUDA GPU, or the interpreter on the CPU
    uses_blocks: bool            # reads a BlockList (pairs grouped by (adapter, expert))
    max_rank: int | None = None  # widest rank it runs; None: any
    add_inputs: bool = True      # accumulates into the output (False: overwrite only, always supported)
    token_rows: bool = True      # reads [M, K] token rows (pair rows [P, K] always supported)
    status: str = "product"      # one of STATUSES: only product rows may be picked by ``auto``

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"LoRAPath {self.name!r}: status {self.status!r} is not one of {', '.join(STATUSES)}")
        if not callable(self.launcher) and (not isinstance(self.launcher, str) or self.launcher.count(":") != 1):
            raise ValueError(f"LoRAPath {self.name!r}: launcher must be a function or 'module:function', "
                             f"got {self.launcher!r}")

    @property
    def launch(self) -> Callable[[LoRACall, KernelConfig | None], None]:
        """The launcher, imported on first use."""
        if callable(self.launcher):
            return self.launcher
        module, function = self.launcher.split(":")
        return getattr(importlib.import_module(module), function)

    def unsupported(self, rank: int, add_inputs: bool, token_rows: bool) -> str | None:
        """Why this path cannot run the call (None when it can)."""
        if self.max_rank is not None and rank > self.max_rank:
            return f"ranks up to {self.max_rank} (this call has r={rank})"
        if add_inputs and not self.add_inputs:
            return "add_inputs=False only"
        if token_rows and not self.token_rows:
            return "pair rows [M*k, K] only"
        return None


def _slice_pairs(num_slices: int):
    """(first slice, slices) of each launch: the kernels take two slices at a time."""
    return [(s0, min(2, num_slices - s0)) for s0 in range(0, num_slices, 2)]


def _slices(ws, s0):
    """Pointers for a launch covering slices s0 and s0+1 (slice s0 twice when only one is left)."""
    return ws[s0], ws[min(s0 + 1, len(ws) - 1)]


def _precision(x) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _block_config(call: LoRACall, cfg: KernelConfig | None, path: str) -> KernelConfig:
    M, k, L, E, R, K, N, S = call.dims
    cfg = cfg or choose_config(path, M * k, min(M * k, L * E), N, S, call.x.device, rank=R,
                               side_stream=call.side_stream)
    return cfg.replace(block_m=call.blocks.block_size)


def launch_reference(call: LoRACall, cfg: KernelConfig | None = None) -> None:
    """The spec in PyTorch (fp32), written into the rows of pairs with an adapter."""
    M, k, L, E, R, K, N, S = call.dims
    lora_a, lora_b = call.lora_a, call.lora_b
    if call.lora_ranks is not None:                        # the spec on weights cut to each slot's rank
        keep = torch.arange(R, device=call.x.device)[None, :] < call.lora_ranks[:, None]      # [L, r]
        lora_a = [torch.where(keep[:, None, :, None], w, torch.zeros_like(w)) for w in lora_a]
        lora_b = [torch.where(keep[:, None, None, :], w, torch.zeros_like(w)) for w in lora_b]
    delta = moe_lora_reference(call.x, call.topk_ids, call.topk_weights, call.token_lora, lora_a, lora_b,
                               mul_routed_weight=call.mul_routed_weight)
    out = call.output
    owned = (call.token_lora >= 0).view(M, 1, 1)
    new = delta + out.float() if call.add_inputs else delta
    out.copy_(torch.where(owned, new.to(out.dtype), out))


def launch_one_shot(call: LoRACall, cfg: KernelConfig | None = None):
    """Returns the compiled kernel on a GPU (registers, spills), for ``profile.report``. The kernel's
    output prefetch and expand pipeline are the measured rule's (``dispatch.one_shot_build_rule``); the
    other ways it was built are timed by ``python -m moelora_lab.bench expand``."""
    x, blocks, out2d, weights = call.x, call.blocks, call.out2d, call.weights()
    M, k, L, E, R, K, N, S = call.dims
    if out2d.shape[1] > 1 and out2d.stride(1) != 1:      # the kernel takes the columns as contiguous
        raise ValueError(f"output: the one-shot path needs contiguous columns (column stride {out2d.stride(1)})")
    cfg = _block_config(call, cfg, "one_shot")
    block_r, rank_tiles = cfg.rank_tiling(R)
    n_chunks = min(cfg.n_chunks, triton.cdiv(N, cfg.block_n))    # never more chunks than N tiles
    prefetch, stages = one_shot_build_rule(block_r)
    compiled = None
    for s0, ns in _slice_pairs(S):
        compiled = one_shot_kernel[(blocks.num_blocks, ns * n_chunks)](
            x, *_slices(call.lora_a, s0), *_slices(call.lora_b, s0), out2d, weights, *blocks.tensors,
            call.ranks_or(blocks.block_lora), M * k, k if call.token_rows else 1, K, N, R, s0 * N,
            x.stride(0), x.stride(1), *call.lora_a[0].stride(), *call.lora_b[0].stride(), out2d.stride(0),
            N_CHUNKS=n_chunks, BLOCK_M=blocks.block_size, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            BLOCK_R=block_r, RANK_TILES=rank_tiles, MUL_ROUTED_WEIGHT=call.mul_routed_weight,
            ADD_INPUTS=call.add_inputs, HAS_RANKS=call.lora_ranks is not None, PREFETCH_OUT=prefetch,
            EXPAND_STAGES=stages, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return compiled


def launch_two_kernel(call: LoRACall, cfg: KernelConfig | None = None) -> None:
    M, k, L, E, R, K, N, S = call.dims
    cfg = _block_config(call, cfg, "two_kernel")
    # [S, P, r] in HBM, uninitialised: the shrink writes every row and rank the expand reads (the
    # rows of pairs with an adapter, the ranks below the slot's rank)
    inter = torch.empty(S, M * k, R, dtype=call.x.dtype, device=call.x.device)
    launch_shrink(call.x, call.lora_a, inter, call.blocks, cfg, top_k=k, token_rows=call.token_rows,
                  lora_ranks=call.lora_ranks)
    launch_expand(inter, call.lora_b, call.out2d, call.weights(), call.blocks, cfg,
                  mul_routed_weight=call.mul_routed_weight, add_inputs=call.add_inputs, lora_ranks=call.lora_ranks)


def launch_shrink(x, lora_a, inter, blocks: BlockList, cfg: KernelConfig, *, top_k: int, token_rows: bool,
                  lora_ranks=None, one_read: bool = False) -> None:
    """The shrink alone: inter[s, p, :r_l] = A_s[l, e] x_p for the blocks' pairs (inter [S, P, R], R =
    A's rank dim; ``lora_ranks`` [L] int32 caps each slot's rows). The sharded layers run it apart
    from the expand, with a collective between the two. ``one_read=True`` gives both slices of a
    launch to one program, which reads its x rows once instead of once per slice (same results)."""
    check_bool("one_read", one_read)
    R, K = lora_a[0].shape[2], lora_a[0].shape[3]
    block_r, rank_tiles = cfg.rank_tiling(R)
    ranks = blocks.block_lora if lora_ranks is None else lora_ranks
    for s0, ns in _slice_pairs(len(lora_a)):
        t = inter[s0:s0 + ns]
        both = one_read and ns == 2
        shrink_kernel[(blocks.num_blocks, 1 if both else ns, rank_tiles)](
            x, *_slices(lora_a, s0), t, *blocks.tensors, ranks,
            inter.shape[1], top_k, K, R, x.stride(0), x.stride(1), *lora_a[0].stride(), *t.stride(),
            BLOCK_M=blocks.block_size, BLOCK_K=cfg.block_k, BLOCK_R=block_r, TOKEN_ROWS=token_rows,
            DOT_PRECISION=_precision(x), HAS_RANKS=lora_ranks is not None, BOTH_SLICES=both,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def launch_expand(inter, lora_b, out2d, weights, blocks: BlockList, cfg: KernelConfig, *, mul_routed_weight: bool,
                  add_inputs: bool, lora_ranks=None) -> None:
    """The expand alone: out2d[p, s*N:(s+1)*N] (+)= w_p B_s[l, e] inter[s, p] (inter [S, P, R], B
    [L, E, N, R]; out2d [P, >= S*N] rows, a column slice of a wider buffer is fine)."""
    N, R = lora_b[0].shape[2], lora_b[0].shape[3]
    block_r, _ = cfg.rank_tiling(R)
    ranks = blocks.block_lora if lora_ranks is None else lora_ranks
    for s0, ns in _slice_pairs(len(lora_b)):
        t = inter[s0:s0 + ns]
        expand_kernel[(blocks.num_blocks, ns, triton.cdiv(N, cfg.block_n))](
            t, *_slices(lora_b, s0), out2d, weights, *blocks.tensors, ranks, inter.shape[1], N, R, s0 * N,
            *t.stride(), *lora_b[0].stride(), *out2d.stride(),
            BLOCK_M=blocks.block_size, BLOCK_N=cfg.block_n, BLOCK_R=block_r,
            MUL_ROUTED_WEIGHT=mul_routed_weight, ADD_INPUTS=add_inputs, DOT_PRECISION=_precision(inter),
            HAS_RANKS=lora_ranks is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


PATHS: dict[str, LoRAPath] = {p.name: p for p in (
    LoRAPath("reference", launch_reference, "the spec in PyTorch, fp32 accumulation, one matmul per (adapter, expert)",
             "moelora_lab/reference.py", triton=False, uses_blocks=False),
    LoRAPath("two_kernel", launch_two_kernel, "shrink writes the rank intermediate T [S, P, r] to HBM, expand reads it "
             "back", "moelora_lab/kernels/two_kernel.py", triton=True, uses_blocks=True),
    LoRAPath("one_shot", launch_one_shot, "shrink into registers and expand from them: T never touches HBM; rank "
             "tiles for any r", "moelora_lab/kernels/one_shot.py", triton=True, uses_blocks=True),
    LoRAPath("small_batch", "moelora_lab.experiments.small_batch:launch", "a persistent per-pair GEMV for "
             "decode-sized work, no block list", "moelora_lab/experiments/kernels/small_batch.py", triton=True,
             uses_blocks=False, status="experiment"),
)}
TRITON_PATHS = tuple(name for name, p in PATHS.items() if p.triton)
PATH_CHOICES = tuple(PATHS) + ("auto",)      # what ``moe_lora(path=...)`` accepts
KERNEL_CHOICES = TRITON_PATHS + ("auto",)    # what the layer's ``lora_path=`` and ``bench --paths`` accept


def get_path(name: str, argument: str = "path", choices: tuple = PATH_CHOICES) -> str:
    """Check a path name against the table (a ValueError listing the accepted names otherwise)."""
    if not isinstance(name, str) or name not in choices:
        raise ValueError(f"{argument}: {name!r} is not one of {', '.join(repr(c) for c in choices)}")
    return name


def paths_markdown() -> str:
    """The table as Markdown, for the README (a test keeps the two equal)."""
    rows = ["| path | status | what it does | ranks | add_inputs | token rows | runs on | code |",
            "|---|---|---|---|---|---|---|---|"]
    for p in PATHS.values():
        ranks = "any" if p.max_rank is None else f"<= {p.max_rank}"
        where = "CUDA GPU, or the Triton interpreter on the CPU" if p.triton else "any torch device"
        rows.append(f"| `{p.name}` | {p.status} | {p.summary} | {ranks} | {'yes' if p.add_inputs else 'no'} | "
                    f"{'yes' if p.token_rows else 'no'} | {where} | `{p.kernels}` |")
    return "\n".join(rows)


def resolve_path(path: str, *, num_pairs: int, num_experts: int, num_loras: int, rank: int, add_inputs: bool,
                 token_rows: bool, choice_rank: int | None = None, n_out: int | None = None,
                 side_stream: bool = False) -> str:
    """The path a call runs: ``auto`` follows the measured rule (``dispatch.choose_path``, or
    ``dispatch.choose_side_path`` for the LoRA on the two-stream layer's side stream (``side_stream``), at
    ``choice_rank``: the slots' real rank when known, else ``rank``; ``n_out``: the output columns per
    slice, N) among the product paths that support the call at the weights' ``rank`` (never an
    experiment row); an explicit path must support it (a ValueError says why not)."""
    get_path(path)
    if path == "auto":
        rule = choose_side_path if side_stream else choose_path
        preferred = rule(num_pairs, num_experts, num_loras, rank if choice_rank is None else choice_rank, n_out)
        order = [preferred] + [n for n in TRITON_PATHS if n != preferred]
        for name in order:
            if PATHS[name].status == "product" and PATHS[name].unsupported(rank, add_inputs, token_rows) is None:
                return name
        return "reference"
    why = PATHS[path].unsupported(rank, add_inputs, token_rows)
    if why:
        raise ValueError(f"path: {path!r} supports {why}; use path='auto' to pick one that runs this call")
    return path
