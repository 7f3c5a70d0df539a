"""The MoE layer with LoRA on its routed experts, run on one stream or two.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, H hidden, I expert intermediate,
P = M*k pairs.

    c1 = W13[e] x_t            (base, main stream)   d13 = B13 A13 x_t       (LoRA, side stream)
    h  = silu(c1g + d13g) * (c1u + d13u)             -- the join of the w13 pair
    c3 = w * W2[e] h           (base, main stream)   d2  = w * B2 A2 h       (LoRA, side stream)
    y  = sum_j c3 + d2                               -- the join of the w2 pair

Schedules: ``sequential`` runs everything on the current stream; ``dual_stream`` runs the LoRA ops
on one process-wide side stream, forked and joined with CUDA events, so they can overlap the base
GEMMs (both launch the same kernels on the same buffers, so their results are bitwise equal);
``fused`` computes the LoRA inside the base grouped GEMMs (``kernels/base_moe``: no LoRA launch, no
delta buffer, no join; for L*r <= ``moe.MAX_FUSED_COLUMNS``); ``auto`` is dual-stream on a GPU
while the experts get at most ``DUAL_STREAM_MAX_PAIRS_PER_EXPERT`` pairs each (the LoRA kernels are
short and latency-bound next to long, bandwidth-bound base GEMMs), and sequential beyond (both are
long and bandwidth-bound: a second stream only takes bandwidth away; H200 data in
``data/h200/layer.csv``).

The side stream has the highest priority the device offers (``side_priority="highest"``): the
block scheduler then places the LoRA kernels' programs ahead of the base GEMM's waiting ones, so the
short LoRA work finishes early and the long base GEMM absorbs it. At ``"default"`` priority the LoRA
programs queue behind the base GEMM's, and two streams lost to one at rank 16 from M = 16 to 512.

Joins: ``fold`` (ours) lets the LoRA kernels write their deltas only for pairs with an adapter
into uninitialised buffers, and the activation and the top-k sum read the delta where the token has
an adapter: no memset, no extra pass. ``vllm`` reproduces vLLM's join for comparison: zero-fill a
delta buffer, LoRA writes into it, then ``c += delta`` before the activation and before the sum.

Buffer lifetimes: every tensor the side stream touches is either allocated on the main stream
before the fork (so the caching allocator orders its reuse after the main stream's next work) or
allocated on the side stream itself; the main stream waits for the side stream's event before it
reads a delta and before the function returns, so no buffer is released while the side stream may
still use it, and no ``record_stream`` is needed. Events are created per call, which keeps them
valid under CUDA-graph capture and replay.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch

from ._backend import INTERPRET
from ._checks import INDEX_DTYPES, check_choice, check_range, check_tensor
from .dispatch import choose_config, choose_path
from .moe import (MAX_FUSED_COLUMNS, GemmLoRA, fused_columns, gemm_tiles, moe_gemm, silu_and_mul,
                  topk_sum)
from .ops import run_lora
from .reference import _check_layer, check_lora_weights
from .align import make_blocks
from .routing import BlockList, check_routing

SCHEDULES = ("sequential", "dual_stream", "fused", "auto")
# ``auto`` overlaps the LoRA stream up to this many pairs per expert (H200, qwen3-30b-a3b, r 16, two
# streams over one: -23% at M = 1, -1..-6% at M = 16..512 (32 pairs per expert), +6% at M = 2048;
# r 64: -25%, -3..-8%, +3%)
DUAL_STREAM_MAX_PAIRS_PER_EXPERT = 32
JOINS = ("fold", "vllm")
SIDE_PRIORITIES = ("highest", "default")
_AUX_STREAMS: dict = {}


def aux_stream(device: torch.device, priority: str = "highest") -> "torch.cuda.Stream":
    """The side stream of this process for ``device`` and ``priority`` (one of ``SIDE_PRIORITIES``;
    one stream is enough: more would only compete)."""
    check_choice("side_priority", priority, SIDE_PRIORITIES)
    key = (torch.device(device).index or 0, priority)
    if key not in _AUX_STREAMS:
        least, highest = torch.cuda.Stream.priority_range()
        _AUX_STREAMS[key] = torch.cuda.Stream(device=device, priority=highest if priority == "highest" else least)
    return _AUX_STREAMS[key]


def fused_fits(num_loras: int, rank: int) -> bool:
    """Whether the in-GEMM LoRA can run: the stacked shrink of all adapters fits in registers."""
    return fused_columns(num_loras, rank) <= MAX_FUSED_COLUMNS


def _fused(schedule: str, fits: bool) -> bool:
    if schedule == "fused" and not fits:
        raise ValueError(f"schedule='fused': the in-GEMM LoRA needs L*r <= {MAX_FUSED_COLUMNS} (padded to a power "
                         "of two, at least 16); use schedule='dual_stream' or 'sequential' for more or "
                         "wider adapters")
    return schedule == "fused"


def resolve_schedule(schedule: str, device: torch.device, *, num_pairs: int = 0, num_experts: int = 1,
                     fits: bool = False) -> str:
    """The schedule a call really runs (``fits``: :func:`fused_fits` for the layer's LoRA)."""
    check_choice("schedule", schedule, SCHEDULES)
    if _fused(schedule, fits):
        return "fused"
    gpu = device.type == "cuda" and not INTERPRET
    if schedule == "auto":
        few = num_pairs <= DUAL_STREAM_MAX_PAIRS_PER_EXPERT * num_experts
        return "dual_stream" if gpu and few else "sequential"
    if schedule == "dual_stream" and not gpu:
        warnings.warn("schedule='dual_stream' needs CUDA streams; on the CPU the layer runs sequentially "
                      "(same kernels, same results)", RuntimeWarning, stacklevel=3)
        return "sequential"
    return schedule


class _Streams:
    """Fork / join helper. ``fork()`` marks the point the side work depends on (record it before
    enqueuing the base GEMM, so both can start together); ``side(name, fork)`` runs work on the side
    stream after that point; ``join()`` makes the main stream wait for it."""

    def __init__(self, dual: bool, device, tracer=None, priority: str = "highest"):
        self.dual, self.tracer = dual, tracer
        self.main = torch.cuda.current_stream(device) if dual else None
        self.aux = aux_stream(device, priority) if dual else None

    def fork(self):
        if not self.dual:
            return None
        event = torch.cuda.Event()
        event.record(self.main)
        return event

    @contextlib.contextmanager
    def side(self, name: str, fork):
        if not self.dual:
            with self.stage(name, "lora"):
                yield
            return
        self.aux.wait_event(fork)
        with torch.cuda.stream(self.aux), self.stage(name, "lora"):
            yield
        self.joined = torch.cuda.Event()
        self.joined.record(self.aux)

    def join(self):
        if self.dual:
            self.main.wait_event(self.joined)

    def stage(self, name, lane):
        return self.tracer.stage(name, lane) if self.tracer is not None else contextlib.nullcontext()


@dataclass(frozen=True)
class LayerPlan:
    """Routing metadata of one layer call, computed once and shared by w13 and w2."""

    base_blocks: BlockList           # pairs grouped by expert, for the base GEMMs
    lora_blocks: BlockList | None    # pairs grouped by (adapter, expert), for the LoRA ops
    lora_path: str | None            # 'one_shot', 'two_kernel', 'small_batch' or 'in_gemm' (fused)


def plan_layer(topk_ids, token_lora, num_experts: int, num_loras: int | None, rank: int | None, *,
               hidden: int | None = None, intermediate: int | None = None, lora_path: str = "auto",
               schedule: str = "auto", validate: bool = True) -> LayerPlan:
    """Build the routing metadata (and pick the LoRA path) for :func:`moe_lora_layer`.

    ``num_loras=None`` plans a layer without LoRA. Reuse a plan across calls with the same routing
    (benchmarks, CUDA graphs that capture only the layer's kernels). ``validate=False`` skips the
    id-range checks (they synchronise with the GPU) for routing that was already checked. A plan for
    ``schedule="fused"`` has no LoRA blocks: the base GEMMs carry the LoRA.
    """
    if validate:
        check_routing(topk_ids, token_lora, num_experts, num_loras or 2**31 - 1)
    M, k = topk_ids.shape
    P = M * k
    tiles = gemm_tiles(P, num_experts)
    base = make_blocks(topk_ids, torch.zeros_like(token_lora), num_experts, 1, tiles["BLOCK_M"])
    if num_loras is None:
        return LayerPlan(base, None, None)
    check_choice("schedule", schedule, SCHEDULES)
    fits = fused_fits(num_loras, rank)
    if _fused(schedule, fits):
        return LayerPlan(base, None, "in_gemm")
    path = choose_path(P, num_experts, num_loras, rank) if lora_path == "auto" else lora_path
    cfg = choose_config(path, P, min(P, num_loras * num_experts), intermediate or 1, 2,
                        topk_ids.device, rank=rank)
    return LayerPlan(base, make_blocks(topk_ids, token_lora, num_experts, num_loras, cfg.block_m), path)


def moe_lora_layer(x, topk_ids, topk_weights, token_lora, w13, w2, w13_lora_a=None, w13_lora_b=None,
                   w2_lora_a=None, w2_lora_b=None, *, schedule: str = "auto", join: str = "fold",
                   lora_path: str = "auto", plan: LayerPlan | None = None, tracer=None,
                   lora_ranks: torch.Tensor | None = None, side_priority: str = "highest") -> torch.Tensor:
    """One MoE layer with LoRA on w13 (2 slices) and w2 (1 slice): y [M, H] in x's dtype.

    ``schedule``: 'sequential', 'dual_stream', 'fused' or 'auto' (see the module docstring); ``join``:
    'fold' or 'vllm' (two-kernel schedules only). Without LoRA weights it is the plain MoE layer.
    ``plan`` (from :func:`plan_layer`) skips the
    routing-metadata work and the id-range checks (which synchronise with the GPU); ``tracer``
    (see ``profile.timeline``) records per-stream intervals of every stage. ``lora_ranks`` [L]: the
    actual rank of each slot, as in :func:`moelora_lab.moe_lora`. ``side_priority``: 'highest' or
    'default', the priority of the side stream when two streams run.
    """
    E, H, I = _check_layer(x, topk_ids, w13, w2)
    check_choice("side_priority", side_priority, SIDE_PRIORITIES)
    check_tensor("w13", w13, dtypes=(x.dtype,), legend="[E, 2I, H] in x's dtype")
    check_tensor("w2", w2, dtypes=(x.dtype,), legend="[E, H, I] in x's dtype")
    check_choice("join", join, JOINS)
    check_choice("schedule", schedule, SCHEDULES)
    check_choice("lora_path", lora_path, ("auto", "one_shot", "two_kernel", "small_batch"))
    lora_given = [t is not None for t in (w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b)]
    if any(lora_given) and not all(lora_given):
        raise ValueError("w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b: give all four or none")
    with_lora = all(lora_given)
    L = 2**31 - 1                                    # without LoRA any adapter id is accepted
    if with_lora:
        L, _, r, _, n13, s13 = check_lora_weights(w13_lora_a, w13_lora_b, num_experts=E, in_features=H)
        _, _, r2, _, n2, s2 = check_lora_weights(w2_lora_a, w2_lora_b, num_experts=E, in_features=I)
        if (s13, n13, s2, n2, r2) != (2, I, 1, H, r):
            raise ValueError(f"LoRA weights: expected w13 slices 2 x [L, E, r, {H}] / [L, E, {I}, r] and w2 "
                             f"1 x [L, E, r, {I}] / [L, E, {H}, r] with one rank; got S={s13}, N={n13}, "
                             f"S={s2}, N={n2}, r={r}/{r2}")
        if w13_lora_a[0].dtype != x.dtype:
            raise TypeError(f"w13_lora_a[0]: dtype {w13_lora_a[0].dtype} must equal x's dtype {x.dtype}")
        if lora_ranks is not None:
            check_tensor("lora_ranks", lora_ranks, dtypes=INDEX_DTYPES, shape=(L,), legend="[L] actual rank per slot")
            check_range("lora_ranks", lora_ranks, 0, r + 1, f"ranks of a rank-{r} slot")
            lora_ranks = lora_ranks.to(device=x.device, dtype=torch.int32).contiguous()
    if plan is None:
        check_routing(topk_ids, token_lora, E, L, topk_weights)
    elif not isinstance(plan, LayerPlan):
        raise TypeError("plan: expected a LayerPlan from plan_layer(...) made with the layer's num_loras and rank")
    if x.device.type != "cuda" and not INTERPRET:
        raise ValueError(f"x: the layer's Triton kernels need CUDA tensors (got {x.device}); set "
                         "MOELORA_INTERPRET=1 before importing moelora_lab to run them on the CPU")
    M, k = topk_ids.shape
    P = M * k
    fits = with_lora and fused_fits(L, r)
    run = (resolve_schedule(schedule, x.device, num_pairs=P, num_experts=E, fits=fits) if with_lora
           else "sequential")
    if plan is not None and with_lora and (plan.lora_blocks is None) != (run == "fused"):
        raise TypeError(f"plan: made for another schedule than this call's ({run!r}); pass plan_layer(..., "
                        f"schedule={schedule!r}) with the layer's num_loras, rank, hidden and intermediate")
    if run == "fused" and join != "fold":
        raise ValueError(f"join: {join!r} has no meaning with schedule='fused' (the LoRA is added inside the GEMMs, "
                         "there is no join); leave join at 'fold' or pick another schedule")
    dual = run == "dual_stream"
    if INTERPRET and x.dtype == torch.bfloat16:
        raise TypeError("x: bfloat16 is mis-computed by the Triton interpreter; use float32 or float16 on the CPU")

    weights = topk_weights.reshape(-1).float().contiguous()
    if plan is None:
        plan = plan_layer(topk_ids, token_lora, E, L if with_lora else None, r if with_lora else None,
                          hidden=H, intermediate=I, lora_path=lora_path, schedule=run, validate=False)
    if run == "fused":
        token_lora = token_lora.to(torch.int32).contiguous()
        return _fused_layer(x, topk_ids, weights, token_lora, w13, w2, plan.base_blocks, tiles=gemm_tiles(P, E, lora=True),
                            lora13=GemmLoRA(token_lora, w13_lora_a, w13_lora_b, lora_ranks),
                            lora2=GemmLoRA(token_lora, w2_lora_a, w2_lora_b, lora_ranks), tracer=tracer)
    tiles = gemm_tiles(P, E)
    base_blocks, lora_blocks, path = plan.base_blocks, plan.lora_blocks, plan.lora_path
    streams = _Streams(dual, x.device, tracer, side_priority)
    c1, h, c3, y = _buffers(x, M, k, H, I)
    d13 = d2 = None
    if with_lora:
        alloc = torch.zeros if join == "vllm" else torch.empty       # vLLM's join needs zeroed deltas
        d13 = alloc(M, k, 2 * I, dtype=x.dtype, device=x.device)
        d2 = alloc(M, k, H, dtype=x.dtype, device=x.device)

    fork = streams.fork()                        # x, routing and buffers are ready
    with streams.stage("base_w13", "main"):
        moe_gemm(x, w13, base_blocks, c1, top_k=k, tiles=tiles)
    if with_lora:
        with streams.side("lora_w13", fork):
            run_lora(x, topk_ids, topk_weights, token_lora, w13_lora_a, w13_lora_b, d13, lora_blocks, path,
                     mul_routed_weight=False, add_inputs=False, lora_ranks=lora_ranks)
        streams.join()
    delta13 = d13.view(P, 2 * I) if with_lora else None
    with streams.stage("act", "main"):
        if with_lora and join == "vllm":
            c1.add_(delta13)
            delta13 = None
        silu_and_mul(c1, h, top_k=k, delta=delta13, token_lora=token_lora)
    fork = streams.fork()                        # h is ready
    with streams.stage("base_w2", "main"):
        moe_gemm(h, w2, base_blocks, c3, top_k=k, topk_weights=weights, tiles=tiles)
    if with_lora:
        with streams.side("lora_w2", fork):
            run_lora(h, topk_ids, topk_weights, token_lora, w2_lora_a, w2_lora_b, d2, lora_blocks, path,
                     mul_routed_weight=True, add_inputs=False, lora_ranks=lora_ranks)
        streams.join()
    delta2 = d2.view(P, H) if with_lora else None
    with streams.stage("sum", "main"):
        if with_lora and join == "vllm":
            c3.add_(delta2)
            delta2 = None
        topk_sum(c3, y, top_k=k, delta=delta2, token_lora=token_lora)
    return y


def _buffers(x, M: int, k: int, H: int, I: int):
    """The layer's activations, uninitialised, on the current stream: c1 [P, 2I], h [P, I], c3 [P, H], y [M, H]."""
    P = M * k
    return tuple(torch.empty(*shape, dtype=x.dtype, device=x.device) for shape in ((P, 2 * I), (P, I), (P, H), (M, H)))


def _fused_layer(x, topk_ids, weights, token_lora, w13, w2, blocks, *, tiles, lora13, lora2, tracer):
    """The ``fused`` schedule: four launches, the LoRA computed inside the two grouped GEMMs."""
    M, k = topk_ids.shape
    streams = _Streams(False, x.device, tracer)
    c1, h, c3, y = _buffers(x, M, k, w2.shape[1], w2.shape[2])
    with streams.stage("w13+lora", "main"):
        moe_gemm(x, w13, blocks, c1, top_k=k, tiles=tiles, lora=lora13)
    with streams.stage("act", "main"):
        silu_and_mul(c1, h, top_k=k)
    with streams.stage("w2+lora", "main"):
        moe_gemm(h, w2, blocks, c3, top_k=k, topk_weights=weights, tiles=tiles, lora=lora2)
    with streams.stage("sum", "main"):
        topk_sum(c3, y, top_k=k)
    return y
