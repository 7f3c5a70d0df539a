"""The layer with LoRA in K: grouped GEMMs over inputs widened by each pair's shrink and weights widened by B.

Shape legend: M tokens, k top-k, E experts, L adapters, r rank, H hidden, I expert intermediate,
P = M*k pairs, S slices.

A pair of adapter l computes W x + B_l (A_l x). Widen both operands by L*r columns: x_ext = [x | T]
with T holding the pair's shrink A_l x in columns l*r .. l*r + r and zeros elsewhere, and W_ext =
[W | B of every slot] (packed once). Then W_ext x_ext is the base output plus the pair's own LoRA:
the LoRA rides the GEMM's pipelined K loop as a few more K steps, with no delta buffer and no join.

``pack_w2_in_k`` stores w2_ext [E, H, I + L*r]; ``pack_w13_in_k`` stores w13_ext [E, 2I, H' + L*r]
(H' = ``moe.tail_start(H)``: zero columns up to a multiple of 128, so no K step mixes x and T; row n
of slice s takes B_s's row). Two layers use them:

- ``w2_in_k_layer``: w13 as the two-stream layer runs it (base GEMM on the main stream, w13's LoRA on
  the side stream, joined before the activation); the activation writes h into the first I columns
  of h_ext [P, I + L*r]; the w2 shrink writes each pair's T2 = A2 h into its adapter's r columns of
  the rest and zeros into every other column (one launch, ``kernels/in_k.py``); the w2 GEMM is the
  plain grouped GEMM over h_ext and w2_ext.
- ``in_k_layer``: w13's LoRA in K as well, on one stream: the shrink writes T1 [S, P, L*r] of both
  slices (x read by token), the w13 GEMM reads its last K steps from T1 (the pair's row) instead of
  x (``moe_gemm(..., x_tail=T1)``), and the activation reads no delta. No LoRA kernel runs beside a
  GEMM and no delta is written anywhere.

What it trades: the GEMMs' K grows by L*r (every pair multiplies through every slot's columns, zeros
but its own) and the shrinks run before their GEMMs, on the critical path, where two streams hide
them beside the base GEMMs. ``python -m moelora_lab.bench in_k`` measures where that pays.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ._backend import INTERPRET, on_device
from .blocks import LayerPlan
from .in_k_launch import gemm_after_shrink, shrink_tail as _shrink_tail
from .layer_plan import IN_GEMM, plan_layer
from .moe import gemm_tiles, moe_gemm, silu_and_mul, tail_start, topk_sum
from .ops import run_lora
from .streams import Streams
from .validate import check_layer_inputs, check_lora_ranks, check_plan, check_values, routing_ranges

W13_ONE_READ = True   # in_k_layer's w13 shrink writes both slices from one read of x


def _pack(w: torch.Tensor, lora_b, at: int, names: tuple, slices: int) -> torch.Tensor:
    """[E, N, at + L*r]: w, zeros up to column ``at``, then every slot's B (rows of slice s from B_s)."""
    wn, bn = names
    if not isinstance(w, torch.Tensor) or w.dim() != 3:
        raise TypeError(f"{wn}: expected a tensor [E, N, K], got {getattr(w, 'shape', type(w).__name__)}")
    if (not isinstance(lora_b, (list, tuple)) or len(lora_b) != slices
            or not all(isinstance(b, torch.Tensor) for b in lora_b)):
        count = "one tensor [L, E, H, r] (w2 has one slice)" if slices == 1 else "two tensors [L, E, I, r] (gate, up)"
        raise TypeError(f"{bn}: expected a list of {count}")
    E, N, K = w.shape
    for s, b in enumerate(lora_b):
        if b.dim() != 4 or tuple(b.shape[1:3]) != (E, N // slices) or b.shape[:1] + b.shape[3:] != lora_b[0].shape[:1] + lora_b[0].shape[3:]:
            raise ValueError(f"{bn}[{s}]: expected [L, {E}, {N // slices}, r] for {wn} of shape {tuple(w.shape)}, "
                             f"got {tuple(b.shape)}")
        if b.dtype != w.dtype or b.device != w.device:
            raise TypeError(f"{bn}[{s}]: expected {w.dtype} on {w.device} like {wn}, got {b.dtype} on {b.device}")
    b = torch.cat(list(lora_b), dim=2)                                        # [L, E, N, r]
    L, r = b.shape[0], b.shape[3]
    ext = w.new_zeros(E, N, at + L * r)
    ext[:, :, :K] = w
    # every pair multiplies its zero columns (other slots', past its slot's rank) by these: NaN or inf there
    # (a slot allocated but not loaded yet, B past a slot's rank) would reach every row as 0 * NaN, so they
    # are packed as zeros
    ext[:, :, at:] = torch.nan_to_num(b.permute(1, 2, 0, 3).reshape(E, N, L * r), nan=0.0, posinf=0.0, neginf=0.0)
    return ext


def pack_w2_in_k(w2: torch.Tensor, w2_lora_b) -> torch.Tensor:
    """w2_ext [E, H, I + L*r], contiguous: w2 [E, H, I] followed by B2 [L, E, H, r] of every slot
    (column I + l*r + j is rank j of slot l; scaling folded into B as everywhere). Pack again when an
    adapter slot changes."""
    return _pack(w2, w2_lora_b, w2.shape[2] if isinstance(w2, torch.Tensor) and w2.dim() == 3 else 0,
                 ("w2", "w2_lora_b"), 1)


def pack_w13_in_k(w13: torch.Tensor, w13_lora_b) -> torch.Tensor:
    """w13_ext [E, 2I, H' + L*r], contiguous (H' = ``moe.tail_start(H)``): w13 [E, 2I, H], zeros up to
    column H', then B of every slot: gate rows from w13_lora_b[0], up rows from w13_lora_b[1], each
    [L, E, I, r]. Pack again when an adapter slot changes."""
    at = tail_start(w13.shape[2]) if isinstance(w13, torch.Tensor) and w13.dim() == 3 else 0
    return _pack(w13, w13_lora_b, at, ("w13", "w13_lora_b"), 2)


class InKWeights(NamedTuple):
    """The layer's base weights packed once with every slot's B (:func:`pack_in_k`). ``w13`` [E, 2I, H] and
    ``w2`` [E, H, I] are views of ``w13_ext`` and ``w2_ext``: give them to ``moe_lora_layer`` with
    ``in_k=`` this, and every schedule reads the one copy of the base weights (``auto`` may then run
    :func:`in_k_layer`). ``lora_b`` and ``versions`` record the B tensors packed and their in-place
    version counters, so a layer call notices an adapter changed since."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_ext: torch.Tensor
    w2_ext: torch.Tensor
    lora_b: tuple
    versions: tuple


def _version(t: torch.Tensor):
    try:
        return t._version
    except RuntimeError:      # an inference-mode tensor keeps no version counter
        return None


def pack_in_k(w13: torch.Tensor, w2: torch.Tensor, w13_lora_b, w2_lora_b) -> InKWeights:
    """Pack the layer once for the LoRA in K: ``w13_ext`` and ``w2_ext`` as :func:`pack_w13_in_k` and
    :func:`pack_w2_in_k` build them, and ``w13`` / ``w2`` as views of them (drop your own copies of the
    base weights). Pack again when an adapter slot changes: the layer refuses a stale pack.

    The packed K multiplies every pair's zero columns (another slot's, past its slot's rank) by those
    slots' B, so NaN and inf in B (a slot allocated but not loaded yet, B past a slot's rank) are packed
    as zeros: they never reach a row, as on every other schedule. The one difference: a token whose own
    adapter holds NaN inside its rank gets NaN from the other schedules and a delta without those
    values from ``in_k``. (Dropping the unused columns inside the GEMMs instead kept B as it is, but the
    select took the W tile off the bulk-copy to tensor-core path: 1.12-1.67x each GEMM's time at M = 2048
    and 8192, r 16 and 64, on an H100: data/history/tail_mask_b69769dfe1.csv.)"""
    w13_ext, w2_ext = pack_w13_in_k(w13, w13_lora_b), pack_w2_in_k(w2, w2_lora_b)
    bs = (*w13_lora_b, *w2_lora_b)
    return InKWeights(w13_ext[:, :, :w13.shape[2]], w2_ext[:, :, :w2.shape[2]], w13_ext, w2_ext, bs,
                      tuple(_version(b) for b in bs))


def check_in_k(pack, w13, w2, w13_lora_b, w2_lora_b) -> None:
    """A TypeError / ValueError unless ``pack`` (from :func:`pack_in_k`) holds these very weights, unchanged."""
    if not isinstance(pack, InKWeights):
        raise TypeError(f"in_k: expected the InKWeights of pack_in_k(w13, w2, w13_lora_b, w2_lora_b), got "
                        f"{type(pack).__name__}")
    if w13_lora_b is None:
        raise ValueError("in_k: packs the LoRA's B into the base weights, but the call has no LoRA; drop in_k")

    def same(a, b):
        return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()

    if not (same(w13, pack.w13) and same(w2, pack.w2)):
        raise ValueError("w13, w2: not the views in_k holds; pass in_k.w13 and in_k.w2, so that every schedule "
                         "reads the one packed copy of the base weights")
    bs = (*w13_lora_b, *w2_lora_b)
    if len(bs) != len(pack.lora_b) or any(a is not b for a, b in zip(bs, pack.lora_b)):
        raise ValueError("w13_lora_b, w2_lora_b: not the tensors in_k was packed from; pack_in_k(...) again with "
                         "these")
    if any(v is not None and _version(b) != v for b, v in zip(bs, pack.versions)):
        raise ValueError("w13_lora_b, w2_lora_b: changed in place since pack_in_k packed them; pack again "
                         "(in_k holds a copy of every slot's B)")


def _split(ext, at: int, cols: int, lora_a, slices: int, names: tuple):
    """The base weight [E, N, cols] and B [L, E, N/S, r] of each slice, as views of ``ext``."""
    en, an, pack = names
    if not isinstance(lora_a, (list, tuple)) or len(lora_a) != slices or getattr(lora_a[0], "dim", lambda: 0)() != 4:
        raise TypeError(f"{an}: expected a list of {slices} tensor(s) [L, E, r, K]")
    if not isinstance(ext, torch.Tensor) or ext.dim() != 3:
        raise TypeError(f"{en}: expected a tensor [E, N, K' + L*r] from {pack}, got "
                        f"{getattr(ext, 'shape', type(ext).__name__)}")
    E, N, width = ext.shape
    L, r = lora_a[0].shape[0], lora_a[0].shape[2]
    if width != at + L * r or not ext.is_contiguous():
        raise ValueError(f"{en}: expected a contiguous [E, N, {at} + L*r] = [{E}, {N}, {at + L * r}] (L = {L}, "
                         f"r = {r} from {an}), got {tuple(ext.shape)}; build it with {pack}")
    n = N // slices
    return ext[:, :, :cols], [ext[:, s * n:(s + 1) * n, at:].view(E, n, L, r).permute(2, 0, 1, 3)
                              for s in range(slices)]


def _w2_split(w2_ext, w13, w2_lora_a):
    if not isinstance(w13, torch.Tensor) or w13.dim() != 3:
        raise TypeError("w13, w2_ext: expected tensors [E, 2I, H] and [E, H, I + L*r] (w2_ext from pack_w2_in_k)")
    I = w13.shape[1] // 2
    return _split(w2_ext, I, I, w2_lora_a, 1, ("w2_ext", "w2_lora_a", "pack_w2_in_k(w2, w2_lora_b)"))


def _prepare(x, topk_ids, topk_weights, token_lora, weights, plan, lora_ranks, validate):
    """Checks shared by both layers (``weights``: w13, w2 and the four LoRA tensors, as the layer takes
    them); returns the dims, the plan (built here if None) and the ranks on x's device."""
    M, k, E, H, I, L, r = check_layer_inputs(x, topk_ids, topk_weights, token_lora, *weights)
    ranges = check_lora_ranks(lora_ranks, L, r)
    checked = check_plan(plan, topk_ids, token_lora, E, L, r) if plan is not None else False
    if plan is not None and plan.lora_path in IN_GEMM.values():
        raise ValueError(f"plan: made for an in-GEMM schedule ({plan.lora_path!r}); pass plan_layer(..., "
                         "schedule='sequential')")
    if validate:
        check_values(ranges + ([] if checked else routing_ranges(topk_ids, token_lora, E, L)))
    if x.device.type != "cuda" and not INTERPRET:
        raise ValueError(f"x: the layer's Triton kernels need CUDA tensors (got {x.device}); set "
                         "MOELORA_INTERPRET=1 before importing moelora_lab to run them on the CPU")
    if M and plan is None:
        with on_device(x):
            plan = plan_layer(topk_ids, token_lora, E, L, r, hidden=H, intermediate=I, schedule="sequential",
                              validate=False, lora_ranks=lora_ranks)
    if lora_ranks is not None:
        lora_ranks = lora_ranks.to(device=x.device, dtype=torch.int32).contiguous()
    return (M, k, E, H, I, L, r), plan, lora_ranks


def w2_in_k_layer(x, topk_ids, topk_weights, token_lora, w13, w2_ext, w13_lora_a, w13_lora_b, w2_lora_a, *,
                  plan: LayerPlan | None = None, dual: bool | None = None, lora_ranks: torch.Tensor | None = None,
                  validate: bool = True, tracer=None) -> torch.Tensor:
    """y [M, H] of the MoE layer with LoRA, as :func:`moelora_lab.moe_lora_layer` computes it, with w2's
    LoRA in the w2 GEMM's K (``w2_ext`` from :func:`pack_w2_in_k`). ``plan``: from ``plan_layer(...,
    schedule="sequential")`` on these routing tensors (built here if None). ``dual``: w13's LoRA on a
    side stream (default: on a CUDA GPU; never on the CPU). Other arguments as for the layer."""
    w2, w2_lora_b = _w2_split(w2_ext, w13, w2_lora_a)
    weights = (w13, w2, w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b)
    (M, k, E, H, I, L, r), plan, lora_ranks = _prepare(x, topk_ids, topk_weights, token_lora, weights, plan,
                                                       lora_ranks, validate)
    gpu = x.device.type == "cuda" and not INTERPRET
    if dual and not gpu:
        raise ValueError("dual: True needs CUDA streams; leave it None (or False) on the CPU")
    if M == 0:
        return x.new_empty(0, H)
    P = M * k
    with on_device(x):
        token_lora32 = token_lora.to(torch.int32).contiguous()
        streams = Streams(gpu if dual is None else dual, x.device, tracer)
        c1 = x.new_empty(P, 2 * I)
        h_ext = x.new_empty(P, I + L * r)
        d13 = x.new_empty(M, k, 2 * I)
        fork = streams.fork()
        with streams.stage("base_w13", "main"):
            moe_gemm(x, w13, plan.base_blocks, c1, top_k=k, tiles=gemm_tiles(P, E))
        with streams.side("lora_w13", fork):
            run_lora(x, topk_ids, topk_weights, token_lora, w13_lora_a, w13_lora_b, d13, plan.lora_blocks,
                     plan.lora_path, mul_routed_weight=False, add_inputs=False, lora_ranks=lora_ranks)
        streams.join()
        _act_and_shrink(c1, d13.view(P, 2 * I), h_ext, w2_lora_a[0], plan, token_lora32, streams, k, H, I, r,
                        lora_ranks)
        return _w2_and_sum(h_ext, w2_ext, plan, token_lora32, topk_weights, streams, M, k, H)


def in_k_layer(x, topk_ids, topk_weights, token_lora, w13_ext, w2_ext, w13_lora_a, w2_lora_a, *,
               plan: LayerPlan | None = None, lora_ranks: torch.Tensor | None = None, validate: bool = True,
               tracer=None, overlap: bool = False) -> torch.Tensor:
    """y [M, H] of the MoE layer with LoRA, as :func:`moelora_lab.moe_lora_layer` computes it, with both
    LoRA ops in their GEMMs' K, on one stream (``w13_ext`` from :func:`pack_w13_in_k`, ``w2_ext`` from
    :func:`pack_w2_in_k`). ``plan``: from ``plan_layer(..., schedule="sequential")`` on these routing
    tensors (built here if None). ``overlap``: each shrink and its GEMM as one launch, the GEMM tiles
    waiting for the shrink only before their tail K steps (``kernels/in_k_overlap``; an experiment,
    measured slower from M = 512 on, not what ``schedule="in_k"`` runs). Other arguments as for the layer."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise TypeError(f"x: expected a tensor [M, H], got {getattr(x, 'shape', type(x).__name__)}")
    H = x.shape[1]
    w13, w13_lora_b = _split(w13_ext, tail_start(H), H, w13_lora_a, 2,
                             ("w13_ext", "w13_lora_a", "pack_w13_in_k(w13, w13_lora_b)"))
    w2, w2_lora_b = _w2_split(w2_ext, w13, w2_lora_a)
    weights = (w13, w2, w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b)
    (M, k, E, H, I, L, r), plan, lora_ranks = _prepare(x, topk_ids, topk_weights, token_lora, weights, plan,
                                                       lora_ranks, validate)
    if M == 0:
        return x.new_empty(0, H)
    P = M * k
    with on_device(x):
        x = x.contiguous()
        token_lora32 = token_lora.to(torch.int32).contiguous()
        streams = Streams(False, x.device, tracer)
        t13 = x.new_empty(2, P, L * r)
        c1, h_ext = x.new_empty(P, 2 * I), x.new_empty(P, I + L * r)
        if overlap:
            return _overlapped(x, plan, token_lora32, topk_weights, w13_lora_a, w2_lora_a[0], w13_ext, w2_ext, t13,
                               c1, h_ext, streams, lora_ranks, M, k, H, I, r)
        with streams.stage("shrink_w13", "main"):
            _shrink_tail(x, w13_lora_a, plan, token_lora32, k, t13, I, r, lora_ranks, token_rows=True,
                         one_read=W13_ONE_READ)
        with streams.stage("w13+lora", "main"):
            moe_gemm(x, w13_ext, plan.base_blocks, c1, top_k=k, tiles=gemm_tiles(P, E), x_tail=t13)
        _act_and_shrink(c1, None, h_ext, w2_lora_a[0], plan, token_lora32, streams, k, H, I, r, lora_ranks)
        return _w2_and_sum(h_ext, w2_ext, plan, token_lora32, topk_weights, streams, M, k, H)


def _overlapped(x, plan, token_lora32, topk_weights, a13, a2, w13_ext, w2_ext, t13, c1, h_ext, streams, lora_ranks,
                M: int, k: int, H: int, I: int, r: int):
    """``in_k_layer(..., overlap=True)`` from its buffers on: each shrink in one launch with its GEMM."""
    P = M * k
    with streams.stage("w13+lora", "main"):
        gemm_after_shrink(x, a13, plan, token_lora32, k, t13, I, r, lora_ranks, x, w13_ext, c1, x_cols=H,
                          tail_at=tail_start(H), token_rows=True, one_read=W13_ONE_READ)
    with streams.stage("act", "main"):
        silu_and_mul(c1, h_ext[:, :I], top_k=k)
    c3, y = x.new_empty(P, H), x.new_empty(M, H)
    with streams.stage("w2+lora", "main"):
        gemm_after_shrink(h_ext, [a2], plan, token_lora32, k, h_ext[:, I:].unsqueeze(0), H, r, lora_ranks, h_ext,
                          w2_ext, c3, x_cols=I, tail_at=I, topk_weights=topk_weights.reshape(-1).float().contiguous())
    with streams.stage("sum", "main"):
        topk_sum(c3, y, top_k=k)
    return y


def _act_and_shrink(c1, delta, h_ext, a2, plan, token_lora32, streams, k: int, H: int, I: int, r: int,
                    lora_ranks) -> None:
    """h_ext = [h | T2]: the activation (with w13's delta where given) into the first I columns, then
    w2's shrink of the LoRA blocks into the tail (``shrink_tail_kernel``)."""
    with streams.stage("act", "main"):
        silu_and_mul(c1, h_ext[:, :I], top_k=k, delta=delta, token_lora=token_lora32 if delta is not None else None)
    with streams.stage("shrink_w2", "main"):
        _shrink_tail(h_ext, [a2], plan, token_lora32, k, h_ext[:, I:].unsqueeze(0), H, r, lora_ranks)


def _w2_and_sum(h_ext, w2_ext, plan, token_lora32, topk_weights, streams, M: int, k: int, H: int):
    """The layer from h_ext = [h | T2] on: the w2 GEMM over h_ext and w2_ext, the top-k sum."""
    P = M * k
    c3, y = h_ext.new_empty(P, H), h_ext.new_empty(M, H)
    weights = topk_weights.reshape(-1).float().contiguous()
    with streams.stage("w2+lora", "main"):
        moe_gemm(h_ext, w2_ext, plan.base_blocks, c3, top_k=k, topk_weights=weights,
                 tiles=gemm_tiles(P, w2_ext.shape[0]))
    with streams.stage("sum", "main"):
        topk_sum(c3, y, top_k=k)
    return y
