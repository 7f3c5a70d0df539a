"""Input validation: the one module every public entry point (the spec, the op, the layer,
the routing helpers and the plots) checks its inputs with.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, K in, N out, S slices,
H hidden, I expert intermediate.

Errors are for users: each message names the argument, what was given and what is accepted.
Shapes, dtypes, devices, memory overlap and reused routing metadata are checked on the host for
free. Value checks that read tensor contents (id ranges) need one device synchronisation per call
(all of a call's ranges are read at once); they are skipped under CUDA graph capture, when the
routing metadata passed in was built from the same, unchanged tensors (its stamp says their values
were checked then), and with ``validate=False``.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from ..blocks import BlockList, LayerPlan
from .basic import (FLOAT_DTYPES, INDEX_DTYPES, SPEC_DTYPES, check_bool, check_choice, check_int, check_no_overlap,  # noqa: F401
                    check_no_self_overlap, check_range, check_rows, check_same_device, check_tensor, check_values,
                    tensors_in, wants_grad)


# without LoRA weights any adapter id of token_lora is accepted: checks use this many slots
ANY_SLOT = 2**31 - 1


# ---- routing ---------------------------------------------------------------------------------


def routing_ranges(topk_ids, token_lora, num_experts: int, num_loras: int) -> list[tuple]:
    """The value checks of the routing ids, for :func:`check_values`."""
    return [("topk_ids", topk_ids, 0, num_experts, f"experts of a {num_experts}-expert layer"),
            ("token_lora", token_lora, -1, num_loras, f"-1 = no adapter, else a slot of {num_loras}")]


def check_routing(topk_ids, token_lora, num_experts: int, num_loras: int, topk_weights=None, *,
                  values: bool = True, dtypes: tuple = FLOAT_DTYPES) -> tuple[int, int]:
    """Validate the routing tensors shared by every public op; returns (M, k).

    ``values=False`` checks shapes, dtypes and devices only (no device synchronisation); ``dtypes``: those
    accepted for topk_weights.
    """
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=INDEX_DTYPES, legend="[M, k]")
    M, k = topk_ids.shape
    check_tensor("token_lora", token_lora, dtypes=INDEX_DTYPES, shape=(M,), legend="[M] (one adapter slot per token)")
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, dtypes=dtypes, shape=(M, k),
                     legend="[M, k] (same shape as topk_ids)")
    check_same_device(topk_ids=topk_ids, token_lora=token_lora, topk_weights=topk_weights)
    if values:
        check_values(routing_ranges(topk_ids, token_lora, num_experts, num_loras))
    return M, k


def check_stamp(name: str, stamp, topk_ids, token_lora, num_experts: int, num_loras: int, rebuild: str) -> bool:
    """Check that routing metadata was built for this call; returns whether its ids were checked then."""
    M, k = topk_ids.shape
    built = dict(M=stamp.num_tokens, k=stamp.top_k, E=stamp.num_experts, L=stamp.num_loras)
    now = dict(M=M, k=k, E=num_experts, L=num_loras)
    for key in built:
        if built[key] != now[key]:
            raise ValueError(f"{name}: built for {key}={built[key]}, but this call has {key}={now[key]}; {rebuild}")
    if stamp.device != topk_ids.device:
        raise ValueError(f"{name}: built on {stamp.device}, but the routing is on {topk_ids.device}; {rebuild}")
    for what, st, t in (("topk_ids", stamp.topk_ids, topk_ids), ("token_lora", stamp.token_lora, token_lora)):
        why = None if st is None else st.differs(t)
        if why:
            raise ValueError(f"{name}: not built for this call's {what} ({why}); {rebuild}")
    return stamp.values_checked


def check_blocks(blocks, topk_ids, token_lora, num_experts: int, num_loras: int, name: str = "blocks") -> int:
    """Check a BlockList passed in for reuse against this call's routing; returns its block size."""
    if not isinstance(blocks, BlockList):
        raise TypeError(f"{name}: expected a BlockList from moelora_lab.block_list(...), got {type(blocks).__name__}")
    check_stamp(name, blocks.routing, topk_ids, token_lora, num_experts, num_loras,
                "rebuild it with moelora_lab.block_list(topk_ids, token_lora, num_experts, num_loras, block_size)")
    bs = blocks.block_size
    if bs < 16 or bs & (bs - 1):
        raise ValueError(f"{name}: block size {bs} is not a power of two >= 16 (tl.dot needs 16 rows); rebuild it "
                         "with block_size=16, 32 or 64")
    return bs


def check_plan(plan, topk_ids, token_lora, num_experts: int, num_loras: int | None, rank: int | None) -> bool:
    """Check a LayerPlan against this layer call; returns whether its routing ids were checked."""
    if not isinstance(plan, LayerPlan):
        raise TypeError(f"plan: expected a LayerPlan from moelora_lab.plan_layer(...), got {type(plan).__name__}")
    fix = ("make it with moelora_lab.plan_layer(topk_ids, token_lora, num_experts, num_loras, rank, "
           "schedule=...) for this call")
    want = "without LoRA" if num_loras is None else f"with {num_loras} adapters of rank {rank}"
    have = "without LoRA" if plan.num_loras is None else f"with {plan.num_loras} adapters of rank {plan.rank}"
    if (plan.num_loras, plan.rank) != (num_loras, rank):
        raise ValueError(f"plan: made for a layer {have}, but this call is {want}; {fix}")
    return check_stamp("plan", plan.routing, topk_ids, None if num_loras is None else token_lora, num_experts,
                       plan.routing.num_loras, fix)


# ---- LoRA weights and the op ------------------------------------------------------------------


def check_lora_weights(lora_a, lora_b, num_experts: int | None = None, in_features: int | None = None, *,
                       dtype: torch.dtype | None = None, x: torch.Tensor | None = None,
                       inputs: str = "x has {} features (dim 1)", names: tuple[str, str] = ("lora_a", "lora_b"),
                       dtypes: tuple = FLOAT_DTYPES):
    """Validate S slices of A [L, E, r, K] and B [L, E, N, r]; returns (L, E, r, K, N, S).

    ``in_features`` is the K the weights must expect and ``inputs`` names whose width it is (formatted with
    it); ``dtype`` is x's dtype, which every slice must have; ``x`` is the input whose device every slice
    must share. Each error names the tensor that is wrong where the inputs say which one it is.
    """
    na, nb = names
    for name, ws in ((na, lora_a), (nb, lora_b)):
        if isinstance(ws, torch.Tensor) or not isinstance(ws, Sequence) or len(ws) == 0:
            raise TypeError(f"{name}: expected a non-empty list or tuple of tensors (one per slice), "
                            f"got {type(ws).__name__}")
    if len(lora_a) != len(lora_b):
        raise ValueError(f"{na} and {nb}: got {len(lora_a)} and {len(lora_b)} slices; they must match")
    first = check_tensor(f"{na}[0]", lora_a[0], ndim=4, dtypes=dtypes, legend="[L, E, r, K]")
    if dtype is not None and first.dtype != dtype:
        raise TypeError(f"{na}[0]: dtype {first.dtype} must equal x's dtype {dtype}; cast the weights once, "
                        "when they are loaded")
    L, E, r, K = first.shape
    N = check_tensor(f"{nb}[0]", lora_b[0], ndim=4, dtypes=dtypes, legend="[L, E, N, r]").shape[2]
    for s, (a, b) in enumerate(zip(lora_a, lora_b)):
        check_tensor(f"{na}[{s}]", a, ndim=4, legend="[L, E, r, K]")
        check_tensor(f"{nb}[{s}]", b, ndim=4, legend="[L, E, N, r]")
        # A and B of a slice must agree on L, E and r: when they do not, the message gives both, since either
        # may be the one that is wrong
        for what, dim_a, dim_b in (("adapter slots L", 0, 0), ("experts E", 1, 1), ("rank r", 2, 3)):
            if a.shape[dim_a] != b.shape[dim_b]:
                raise ValueError(f"{na}[{s}], {nb}[{s}]: A [L, E, r, K] {tuple(a.shape)} and B [L, E, N, r] "
                                 f"{tuple(b.shape)} disagree on the {what} ({a.shape[dim_a]} against "
                                 f"{b.shape[dim_b]}); A and B of one slice come from the same adapters")
        check_tensor(f"{na}[{s}]", a, shape=(L, E, r, K), legend="[L, E, r, K]")
        check_tensor(f"{nb}[{s}]", b, shape=(L, E, N, r), legend="[L, E, N, r]")
        for name, w in ((f"{na}[{s}]", a), (f"{nb}[{s}]", b)):
            if w.dtype != first.dtype:
                whose = "x's" if dtype is not None else f"{na}[0]'s"
                raise TypeError(f"{name}: dtype {w.dtype} differs from {whose} {first.dtype}; every slice of A "
                                "and B must share one dtype")
        # x first: a weight on another device than the input is named, whichever of A and B it is
        check_same_device(**({} if x is None else {"x": x}), **{f"{na}[0]": first, f"{na}[{s}]": a, f"{nb}[{s}]": b})
        for name, w, w0 in ((na, a, first), (nb, b, lora_b[0])):
            if w.stride() != w0.stride():     # the kernels read every slice with slice 0's strides
                fix = (f"make them all contiguous, or pass all of {nb} through moelora_lab.pack_lora_b" if name == nb
                       else "make them all contiguous")
                raise ValueError(f"{name}: the slices have different memory layouts (strides {w0.stride()} and "
                                 f"{w.stride()} of slice {s}); {fix}")
    if num_experts is not None and E != num_experts:
        raise ValueError(f"{na}[0]: has {E} experts (dim 1) but the base layer has {num_experts}")
    if in_features is not None and K != in_features:
        raise ValueError(f"{na}[0]: expects K={K} input features (dim 3) but {inputs.format(in_features)}; "
                         "A [L, E, r, K] multiplies those rows")
    return L, E, r, K, N, len(lora_a)


class OpDims(NamedTuple):
    M: int
    k: int
    L: int
    E: int
    r: int
    K: int
    N: int
    S: int


def check_op_inputs(x, topk_ids, topk_weights, token_lora, lora_a, lora_b, *, mul_routed_weight: bool = False,
                    values: bool = True, same_dtype: bool = False, dtypes: tuple = FLOAT_DTYPES) -> OpDims:
    """Validate the LoRA op's tensors (``values=False``: no id-range checks, no synchronisation;
    ``same_dtype``: the weights must be in x's dtype, as the kernels need; ``dtypes``: the float dtypes
    accepted, ``SPEC_DTYPES`` for the specs)."""
    check_bool("mul_routed_weight", mul_routed_weight)
    check_tensor("x", x, ndim=2, dtypes=dtypes, legend="[M, K] token rows or [M*k, K] pair rows")
    L, E, r, K, N, S = check_lora_weights(lora_a, lora_b, in_features=x.shape[1], dtype=x.dtype if same_dtype else None,
                                          x=x, dtypes=dtypes)
    if mul_routed_weight and topk_weights is None:
        raise ValueError("topk_weights: required with mul_routed_weight=True (each pair's delta is scaled by its "
                         "routing weight); pass the [M, k] weights or set mul_routed_weight=False")
    M, k = check_routing(topk_ids, token_lora, E, L, topk_weights, values=values, dtypes=dtypes)
    if x.shape[0] not in (M, M * k):
        raise ValueError(f"x: has {x.shape[0]} rows; expected M={M} (token rows) or M*k={M * k} (pair rows)")
    check_same_device(x=x, topk_ids=topk_ids, **{"lora_a[0]": lora_a[0]})
    return OpDims(M, k, L, E, r, K, N, S)


def check_lora_ranks(lora_ranks, num_loras: int, rank: int) -> list[tuple]:
    """Shape and dtype of the per-slot ranks [L]; returns their value check for :func:`check_values`."""
    if lora_ranks is None:
        return []
    check_tensor("lora_ranks", lora_ranks, dtypes=INDEX_DTYPES, shape=(num_loras,), legend="[L] actual rank per slot")
    return [("lora_ranks", lora_ranks, 0, rank + 1, f"ranks of a rank-{rank} slot")]


def check_enabled(enabled, num_loras: int) -> None:
    if enabled is not None:
        check_tensor("enabled", enabled, dtypes=(torch.bool,), shape=(num_loras,), legend="[L] bool, one flag per slot")


def check_output(output, M: int, k: int, SN: int, x, **inputs) -> None:
    """The op's output [M, k, S*N]: x's dtype and device, (token, slot) rows contiguous, no shared memory."""
    check_tensor("output", output, dtypes=(x.dtype,), shape=(M, k, SN), legend="[M, k, S*N] in x's dtype")
    if output.device != x.device:
        raise ValueError(f"output: is on {output.device} but x is on {x.device}")
    check_no_self_overlap("output", output)
    if output.stride(2) != 1 or output.stride(0) != k * output.stride(1):
        raise ValueError("output: must have contiguous (token, slot) rows and columns "
                         f"(strides {tuple(output.stride())}); pass output.contiguous() or a fresh buffer")
    check_no_overlap("output", output, x=x, **inputs)


# ---- the layer -------------------------------------------------------------------------------


class LayerDims(NamedTuple):
    M: int
    k: int
    E: int
    H: int
    I: int
    L: int | None     # None: no LoRA weights
    r: int | None


def check_layer_base(x, topk_ids, w13, w2, *, same_dtype: bool = False, dtypes: tuple = FLOAT_DTYPES,
                     base_dtypes: tuple | None = None) -> tuple[int, int, int]:
    """x [M, H], topk_ids [M, k], w13 [E, 2I, H], w2 [E, H, I]; returns (E, H, I). ``base_dtypes``: those of
    w13 and w2 where they are not x's (the data of a quantized base), overriding ``same_dtype`` for them."""
    check_tensor("x", x, ndim=2, dtypes=dtypes, legend="[M, H]")
    same = same_dtype and base_dtypes is None
    w_dtypes = base_dtypes or ((x.dtype,) if same else dtypes)
    check_tensor("w13", w13, ndim=3, dtypes=w_dtypes, legend="[E, 2I, H]" + (" in x's dtype" if same else ""))
    E, two_i, H = w13.shape
    if two_i % 2:
        raise ValueError(f"w13: dim 1 must be 2*I (gate and up stacked), got {two_i}")
    check_tensor("w2", w2, dtypes=w_dtypes, shape=(E, H, two_i // 2),
                 legend="[E, H, I]" + (" in x's dtype" if same else ""))
    if x.shape[1] != H:
        raise ValueError(f"x: has {x.shape[1]} features but w13 expects H={H}")
    check_tensor("topk_ids", topk_ids, ndim=2, legend="[M, k]")
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids: has {topk_ids.shape[0]} rows but x has M={x.shape[0]}")
    check_same_device(x=x, w13=w13, w2=w2)
    return E, H, two_i // 2


def check_layer_inputs(x, topk_ids, topk_weights, token_lora, w13, w2, w13_lora_a, w13_lora_b, w2_lora_a,
                       w2_lora_b, *, base_dtypes: tuple | None = None) -> LayerDims:
    """Everything the kernel layer reads, shapes/dtypes/devices only (the ids are checked apart); ``base_dtypes``
    as for :func:`check_layer_base` (w13 and w2 the data of a quantized base)."""
    E, H, I = check_layer_base(x, topk_ids, w13, w2, same_dtype=True, base_dtypes=base_dtypes)
    if topk_weights is None:
        raise ValueError("topk_weights: required by the layer (the routing weights scale each expert's output)")
    lora = (w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b)
    given = [t is not None for t in lora]
    if any(given) and not all(given):
        raise ValueError("w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b: give all four or none")
    M, k = check_routing(topk_ids, token_lora, E, 1, topk_weights, values=False)
    check_same_device(x=x, topk_ids=topk_ids)
    if not all(given):
        return LayerDims(M, k, E, H, I, None, None)
    L, _, r, _, n13, s13 = check_lora_weights(w13_lora_a, w13_lora_b, E, H, dtype=x.dtype, x=x,
                                              names=("w13_lora_a", "w13_lora_b"))
    L2, _, r2, _, n2, s2 = check_lora_weights(w2_lora_a, w2_lora_b, E, I, dtype=x.dtype, x=x,
                                              inputs="the activation w2 reads has {} features (I, dim 2 of w2)",
                                              names=("w2_lora_a", "w2_lora_b"))
    if (s13, n13) != (2, I):
        raise ValueError(f"w13_lora_a, w13_lora_b: expected 2 slices (gate, up) of A [L, E, r, {H}] and B "
                         f"[L, E, {I}, r]; got {s13} slice(s) with N={n13}")
    if (s2, n2) != (1, H):
        raise ValueError(f"w2_lora_a, w2_lora_b: expected 1 slice of A [L, E, r, {I}] and B [L, E, {H}, r]; got "
                         f"{s2} slice(s) with N={n2}")
    if (L2, r2) != (L, r):
        raise ValueError(f"w2_lora_a[0]: has {L2} adapter slots of rank {r2}, but w13_lora_a has {L} of rank {r}; "
                         "every slot needs both its w13 and its w2 LoRA (zero-filled where an adapter has none)")
    check_same_device(x=x, w13_lora_a=w13_lora_a[0], w2_lora_a=w2_lora_a[0])
    return LayerDims(M, k, E, H, I, L, r)
