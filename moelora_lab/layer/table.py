"""The table of the layer's schedules: one row per way of running the MoE layer with LoRA.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, H hidden, I expert intermediate,
P = M*k pairs.

A schedule is a runner plus a row. The runner takes one validated :class:`LayerCall` (the layer's
face checks the inputs once, plans once and hands the call over) and returns y [M, H]. The row says
what the schedule is (``status``), how it runs (``streams``, its ``stages`` as the tracer records
them), which of the call's arguments it honours (``joins``, ``lora_paths``) and its limits. The face,
``schedule="auto"``, the README's schedule table, the benchmarks, the plots, the trace export and the
stage model all read this table; no other module spells a schedule's name.

Status: ``product`` rows are what ``auto`` may run; ``experiment`` rows were measured and lost or wait to
be measured (the data README says which). Their code lives in ``moelora_lab.experiments``, which no
product module imports: the row names the runner by its import path and the face imports it on first
use. Adding a schedule: write its runner, add its row (CONTRIBUTING.md walks through it).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from .. import rules
from ..base_moe import fused_columns

STATUSES = ("product", "baseline", "experiment")
JOINS = ("fold", "vllm")                 # the joins of separate LoRA kernels' deltas (see ``face``)
AUTO = "auto"                            # not a row: the choice among the product rows (``plan.resolve_schedule``)
AUTO_CPU = "sequential"                  # what ``auto`` runs where CUDA streams do not (the CPU)
AUTO_GPU = "dual_stream"                 # ... on a GPU ...
AUTO_LARGE = "in_k"                      # ... unless the call brings a pack and the GPU rule says it pays


# what a row says of a quantized base unless it names its own reason (a new runner serves FP8 only once it calls
# quant.base_gemm for its base GEMMs and says so with fp8_refusal=None)
NO_FP8 = "its base GEMMs run the bf16/fp16/fp32 grouped GEMM only"


class Dims(NamedTuple):
    M: int
    k: int
    E: int
    H: int
    I: int
    L: int | None          # None: the plain layer (no LoRA weights)
    r: int | None


@dataclass(frozen=True)
class LayerCall:
    """One validated call of the layer: everything a runner reads (the legend above).

    The tensors are the caller's, checked; ``weights`` [P] float32 and ``token_lora32`` [M] int32 are
    contiguous copies made once; ``lora`` is ``(w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b)`` or None
    (no LoRA, or rank 0); ``lora_ranks`` [L] int32 on x's device or None; ``plan`` holds the routing
    metadata and the tiles; ``dual`` is whether two CUDA streams really run (a two-stream row on a GPU).
    """

    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    weights: torch.Tensor
    token_lora: torch.Tensor
    token_lora32: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    lora: tuple | None
    lora_ranks: torch.Tensor | None
    in_k: object | None
    plan: object
    dims: Dims
    join: str = "fold"
    dual: bool = False
    side_priority: str = "highest"
    tracer: object = None


@dataclass(frozen=True)
class Schedule:
    """One row of the table (see the module docstring)."""

    name: str
    runner: str | Callable          # "module:function" (imported on first use) or the function itself
    status: str                     # one of STATUSES
    streams: int                    # CUDA streams it runs on a GPU (one on the CPU, always)
    stages: tuple                   # (stage, lane) in launch order, as the tracer records them (lane "lora": the
                                    # work ``Streams.side`` runs, on the side stream where two streams run)
    summary: str                    # one line: what it does (the README's table, ``--help``)
    joins: tuple = ("fold",)        # the joins it runs (others are refused by name)
    lora_paths: tuple | None = ()   # the op's paths it launches: None any, () none (its LoRA is inside)
    lora_inside: str = ""           # where its LoRA is computed when it launches no path of the op
    lora_blocks: bool = True        # its plan needs the (adapter, expert) block list
    plan_path: str | None = None    # the LoRA path its plan always takes (None: the op's rule)
    gemm_lora_tiles: bool = False   # its base GEMMs carry the LoRA: the plan takes the GEMM's LoRA tiles
    needs_pack: bool = False        # needs the weights packed by ``pack_in_k`` (``in_k=``)
    max_columns: int | str | None = None  # the most L*r it can run, or the name of the rule in ``rules`` that
                                          # holds it (read at each call: ``column_limit``); None: any
    cpu_runs: str | None = None     # the row that runs in its place where CUDA streams do not (with a warning)
    fp8_refusal: str | None = NO_FP8  # why it cannot run on a quantized (FP8Weight) base; None: it can
    style: dict | None = None       # how plots draw it: color, marker, label

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"Schedule {self.name!r}: status must be one of {STATUSES}, got {self.status!r}")
        if self.name == AUTO or not self.name.isidentifier():
            raise ValueError(f"Schedule: {self.name!r} cannot name a schedule (an identifier other than 'auto')")
        limit = self.max_columns
        if isinstance(limit, str) and not (limit.isupper() and hasattr(rules, limit)):
            raise ValueError(f"Schedule {self.name!r}: max_columns={limit!r} names no rule of "
                             "moelora_lab.rules; pass an int or the name of a rule")

    @property
    def run(self) -> Callable:
        """The runner, imported on first use."""
        if callable(self.runner):
            return self.runner
        module, function = self.runner.split(":")
        return getattr(importlib.import_module(module), function)

    @property
    def column_limit(self) -> int | None:
        """The most L*r it can run now (None: any): ``max_columns``, read from ``rules`` where it names a rule."""
        return getattr(rules, self.max_columns) if isinstance(self.max_columns, str) else self.max_columns

    @property
    def stage_names(self) -> tuple:
        return tuple(stage for stage, _ in self.stages)

    @property
    def one_stream(self) -> bool:
        return self.streams == 1

    def ignored(self, join: str, lora_path: str) -> str | None:
        """Why this schedule cannot honour the call's ``join`` and ``lora_path`` (naming the argument), or None."""
        if join not in self.joins:
            return (f"join: {join!r} has no meaning with schedule={self.name!r} (the LoRA is added inside "
                    f"{self.lora_inside}, there is no delta to join); leave join at 'fold' or pick another schedule")
        if lora_path != "auto" and self.lora_paths is not None and lora_path not in self.lora_paths:
            runs = (f"runs only {', '.join(repr(p) for p in self.lora_paths)}" if self.lora_paths
                    else "launches no LoRA path")
            return (f"lora_path: {lora_path!r} has no meaning with schedule={self.name!r} (it {runs}: its LoRA is "
                    f"inside {self.lora_inside}); leave lora_path at 'auto' or pick another schedule")
        return None

    def refuses_fp8(self) -> str | None:
        """Why this schedule cannot run on a quantized (FP8Weight) base, naming the argument and the fix, or None."""
        if self.fp8_refusal is None:
            return None
        serve = ", ".join(repr(n) for n, row in SCHEDULES.items() if row.fp8_refusal is None)
        return (f"schedule={self.name!r}: cannot run on a quantized (FP8) base: {self.fp8_refusal}; use "
                f"schedule='auto' or one of {serve}, or pass w13 and w2 as tensors (FP8Weight.dequantize(dtype))")

    def too_wide(self, num_loras: int, rank: int) -> str | None:
        """Why L adapters of rank r exceed this schedule's limit, or None."""
        limit = self.column_limit
        if limit is None or fused_columns(num_loras, rank) <= limit:
            return None
        return (f"schedule={self.name!r}: its LoRA needs L*r <= {limit} (padded to a power of two, at "
                f"least 16), got L={num_loras}, r={rank}; use schedule='dual_stream' or 'sequential' for more or "
                "wider adapters")


_TWO = "moelora_lab.layer.two_kernel:run"
_SEQUENTIAL_STAGES = (("base_w13", "main"), ("lora_w13", "lora"), ("act", "main"), ("base_w2", "main"),
                      ("lora_w2", "lora"), ("sum", "main"))

# The rows, in the order the README, ``--help`` and the plots list them.
SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    Schedule("sequential", _TWO, "product", 1, _SEQUENTIAL_STAGES,
             "base GEMMs, then the LoRA kernels of the op and the joins, all on the current stream "
             "(what `auto` runs on the CPU)",
             joins=JOINS, lora_paths=None, fp8_refusal=None,
             style=dict(color="#1f77b4", marker="s", label="LoRA, one stream")),
    Schedule("dual_stream", _TWO, "product", 2, _SEQUENTIAL_STAGES,
             "the same kernels, the LoRA ones on a high-priority side stream beside the base GEMMs "
             "(what `auto` runs on a GPU unless `in_k` pays)",
             joins=JOINS, lora_paths=None, cpu_runs="sequential", fp8_refusal=None,
             style=dict(color="#2ca02c", marker="^", label="LoRA, two streams (folded join)")),
    Schedule("in_k", "moelora_lab.layer.in_k:run", "product", 1,
             (("shrink_w13", "main"), ("w13+lora", "main"), ("act", "main"), ("shrink_w2", "main"),
              ("w2+lora", "main"), ("sum", "main")),
             "both LoRA ops in their GEMMs' K over inputs widened by each pair's shrink (needs `in_k=pack_in_k(...)`; "
             "what `auto` runs on a GPU at large M)",
             lora_inside="the grouped GEMMs' K", needs_pack=True,
             fp8_refusal="its pack widens W with every slot's LoRA B columns, which FP8 weights cannot hold",
             style=dict(color="#e377c2", marker="P", label="both LoRA ops in K")),
    Schedule("fused", "moelora_lab.experiments.in_gemm:run_fused", "experiment", 1,
             (("w13+lora", "main"), ("act", "main"), ("w2+lora", "main"), ("sum", "main")),
             "the LoRA inside the base grouped GEMMs (every N tile recomputes the shrink)",
             lora_inside="the grouped GEMMs", lora_blocks=False, gemm_lora_tiles=True,
             max_columns="MAX_FUSED_COLUMNS",
             style=dict(color="#ff7f0e", marker="D", label="LoRA inside the base GEMMs")),
    Schedule("epilogue", "moelora_lab.experiments.in_gemm:run_epilogue", "experiment", 1,
             (("shrink_w13", "main"), ("w13+lora", "main"), ("act", "main"), ("shrink_w2", "main"),
              ("w2+lora", "main"), ("sum", "main")),
             "one shrink per pair into T, the expand inside the base GEMMs",
             lora_paths=("two_kernel",), lora_inside="the grouped GEMMs (after one shrink per pair)",
             plan_path="two_kernel", max_columns="MAX_FUSED_COLUMNS",
             style=dict(color="#8c564b", marker="v", label="shrink once, expand in the GEMM epilogue")),
    Schedule("in_join", "moelora_lab.experiments.in_join:run", "experiment", 2,
             (("base_w13", "main"), ("shrink_w13", "lora"), ("act+lora", "main"), ("base_w2", "main"),
              ("sum+lora", "main")),
             "the LoRA inside the activation and the top-k sum (w13's shrink the only LoRA launch)",
             lora_paths=("two_kernel",), lora_inside="the activation and the top-k sum", plan_path="two_kernel",
             style=dict(color="#bcbd22", marker="X", label="LoRA inside the joins")),
    Schedule("in_k_act", "moelora_lab.experiments.in_k_act:run", "experiment", 1,
             (("shrink_w13", "main"), ("w13+lora+act", "main"), ("shrink_w2", "main"), ("w2+lora", "main"),
              ("sum", "main")),
             "`in_k` with the activation in the w13 GEMM's epilogue (its output never goes through memory)",
             lora_inside="the grouped GEMMs' K", needs_pack=True,
             fp8_refusal="its pack widens W with every slot's LoRA B columns, which FP8 weights cannot hold",
             style=dict(color="#9467bd", marker="*", label="LoRA in K, activation in the GEMM")),
)}


def _check_auto_rows():
    for name in (AUTO_CPU, AUTO_GPU, AUTO_LARGE):
        if SCHEDULES[name].status != "product":
            raise ValueError(f"auto runs {name!r}, which is not a product row")
    for name in (AUTO_CPU, AUTO_GPU):                 # what auto runs on a quantized base
        if SCHEDULES[name].fp8_refusal is not None:
            raise ValueError(f"auto runs {name!r} on a quantized base, which it cannot run")


_check_auto_rows()


def schedule_names(*statuses: str) -> tuple:
    """The rows' names (of the given statuses; all rows without any)."""
    return tuple(name for name, row in SCHEDULES.items() if not statuses or row.status in statuses)


def choices() -> tuple:
    """What ``schedule=`` accepts: every row, and ``auto``."""
    return (*SCHEDULES, AUTO)


def get_schedule(name: str) -> Schedule:
    """The row called ``name`` (a ValueError naming the choices otherwise)."""
    if not isinstance(name, str):
        raise TypeError(f"schedule: expected a str (one of {', '.join(choices())}), got {type(name).__name__}")
    if name not in SCHEDULES:
        raise ValueError(f"schedule: {name!r} is not one of {', '.join(repr(c) for c in choices())}")
    return SCHEDULES[name]
