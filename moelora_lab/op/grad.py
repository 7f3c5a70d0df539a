"""The LoRA op's backward: :func:`moe_lora_backward` (validate, pick a path of ``GRAD_PATHS``, launch it), the
``auto`` rule, and the autograd Function ``moe_lora`` runs through when an input requires grad.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, K in, N out, S slices, P = M*k pairs.

Gradients come back as :class:`LoRAGrads` (``moelora_lab.reference``), in float32 (float64 for float64
inputs), as the spec's do; the autograd Function casts each to its input's dtype.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch.autograd.function import once_differentiable

from .._backend import INTERPRET, on_device
from ..blocks import BlockList
from ..reference import LoRAGrads, effective_lora, moe_lora_reference
from ..routing.device import make_blocks
from ..validate import (FLOAT_DTYPES, SPEC_DTYPES, check_blocks, check_choice, check_enabled, check_lora_ranks,
                        check_op_inputs, check_same_device, check_tensor, check_values, routing_ranges)
from .dispatch import KernelConfig, choose_config
from .grad_paths import GRAD_NAMES, GRAD_PATH_CHOICES, GRAD_PATHS, GradCall


def choose_grad_path(num_pairs: int, num_groups: int, block_m: int, x: torch.Tensor) -> str:
    """The ``auto`` rule (a first guess, not yet measured; ``python -m moelora_lab.bench grad`` times it beside both
    designs): the one-shot kernel while the touched groups average at most two blocks (its one program per group
    then has little to walk), else two kernels; float64 (the gradient checks), or x where no Triton kernel runs,
    takes the spec."""
    if x.dtype == torch.float64 or not (INTERPRET or x.device.type == "cuda"):
        return "reference"
    return "one_shot" if num_pairs <= 2 * block_m * max(num_groups, 1) else "two_kernel"


def backward_plan(path: str, x: torch.Tensor, num_pairs: int, num_groups: int, out_features: int, num_slices: int,
                  rank: int, *, blocks: BlockList | None = None, config: KernelConfig | None = None) -> tuple[str, int]:
    """(the path ``path`` runs, its block size): 'auto' resolved by :func:`choose_grad_path`; the block size is the
    blocks' or the config's, else the two-kernel rule's for these pairs (P = M*k), groups (L*E), N, S and r."""
    groups = min(num_pairs, num_groups)
    block_m = blocks.block_size if blocks is not None else (config or choose_config(
        "two_kernel", num_pairs, groups, out_features, num_slices, x.device, rank=rank)).block_m
    return (choose_grad_path(num_pairs, groups, block_m, x) if path == "auto" else path), block_m


def moe_lora_backward(x, topk_ids, topk_weights, token_lora, lora_a, lora_b, grad_out, *,
                      mul_routed_weight: bool = False, lora_ranks=None, enabled=None, path: str = "auto",
                      blocks: BlockList | None = None, config: KernelConfig | None = None, needs=None,
                      validate: bool = True, dx_rows: torch.Tensor | None = None) -> LoRAGrads:
    """Gradients of ``moe_lora(...)`` (the delta, [M, k, S*N]) given ``grad_out`` [M, k, S*N].

    ``moe_lora`` calls it itself when an input requires grad (``.backward()`` works through the op); call it
    directly to get every gradient at once, or to pick the path.

    Parameters
    ----------
    x, topk_ids, topk_weights, token_lora, lora_a, lora_b, mul_routed_weight, lora_ranks, enabled
        As :func:`moelora_lab.moe_lora`. The Triton paths take x, A and B in one dtype (fp32, fp16, bf16;
        float64 on the interpreter).
    grad_out : torch.Tensor
        [M, k, S*N] the gradient of the op's output.
    path : str
        'auto' (:func:`choose_grad_path`) or a name of :data:`GRAD_PATHS`: 'reference', 'two_kernel' (T and
        dT through HBM), 'one_shot' (kept in registers), 'one_shot_atomic' (atomics, not deterministic).
    blocks : BlockList, optional
        The routing's block list to reuse (block size a power of two >= 16).
    config : KernelConfig, optional
        Tiles (block_m comes from the blocks).
    needs : iterable of str, optional
        Names of :data:`GRAD_NAMES` to compute (None: all; topk_weights only with mul_routed_weight); the
        others come back None and cost nothing.
    validate : bool
        False skips the id-range checks (one device read).
    dx_rows : torch.Tensor, optional
        [M*k, K] float32 (float64 inputs: float64), contiguous: x's gradient is added into it as one row per
        pair, not summed over a token's k pairs, and comes back as ``.x`` (the layer adds its base part
        there first, which saves a zeroed buffer, a sum and an add).

    Returns
    -------
    LoRAGrads
        x [M, K] or [M*k, K], topk_weights [M, k], lora_a / lora_b lists of [L, E, r, K] / [L, E, N, r]
        (contiguous, whatever B's layout), in float32 (float64 inputs: float64). Tokens without an adapter,
        disabled slots and ranks past ``lora_ranks`` get exact zeros.

    Examples
    --------
    >>> import torch
    >>> import moelora_lab as ml
    >>> p = ml.make_problem("tiny", ml.LoRAShape(num_loras=2, rank=4), num_tokens=8, seed=0)
    >>> inp = p.w13_lora_inputs()
    >>> grad_out = torch.ones(8, 2, 64)                       # [M, k, 2*I]
    >>> grads = ml.moe_lora_backward(**inp, grad_out=grad_out, path="two_kernel")
    >>> tuple(grads.lora_a[0].shape), tuple(grads.x.shape)    # A [L, E, r, K]; x [M, K]
    ((2, 8, 4, 64), (8, 64))
    >>> spec = ml.moe_lora_backward_reference(**inp, grad_out=grad_out)
    >>> torch.allclose(grads.lora_b[1], spec.lora_b[1], rtol=1e-4, atol=1e-4)
    True
    >>> a = [w.clone().requires_grad_() for w in inp["lora_a"]]    # or through autograd
    >>> ml.moe_lora(**(inp | dict(lora_a=a))).sum().backward()
    >>> torch.allclose(a[0].grad, grads.lora_a[0], rtol=1e-4, atol=1e-4)
    True
    """
    check_choice("path", path, GRAD_PATH_CHOICES)
    M, k, L, E, R, K, N, S = check_op_inputs(x, topk_ids, topk_weights, token_lora, lora_a, lora_b,
                                             mul_routed_weight=mul_routed_weight, values=False, dtypes=SPEC_DTYPES)
    check_tensor("grad_out", grad_out, dtypes=SPEC_DTYPES, shape=(M, k, S * N), legend="[M, k, S*N] (moe_lora's output)")
    check_same_device(x=x, grad_out=grad_out)
    check_enabled(enabled, L)
    ranges = check_lora_ranks(lora_ranks, L, R)
    if config is not None and not isinstance(config, KernelConfig):
        raise TypeError(f"config: expected a KernelConfig, got {type(config).__name__}")
    wanted = set(GRAD_NAMES if needs is None else needs)
    if not wanted <= set(GRAD_NAMES):
        raise ValueError(f"needs: {sorted(wanted - set(GRAD_NAMES))} not among {', '.join(GRAD_NAMES)}")
    if not mul_routed_weight:
        wanted.discard("topk_weights")
    checked = False
    if blocks is not None:
        check_blocks(blocks, topk_ids, token_lora, E, L)
        checked = blocks.routing.values_checked
    path, block_m = backward_plan(path, x, M * k, L * E, N, S, R, blocks=blocks, config=config)
    grad_path = GRAD_PATHS[path]
    if grad_path.triton:
        ok = FLOAT_DTYPES + ((torch.float64,) if INTERPRET else ())    # the slices share one dtype (checked)
        for name, t in (("x", x), ("lora_a[0]", lora_a[0])):
            if t.dtype not in ok or t.dtype != x.dtype:
                raise TypeError(f"{name}: dtype {t.dtype}; path {path!r} takes x, A and B in one of "
                                f"{', '.join(str(d) for d in ok)}; use path='reference' for other mixes")
        if x.device.type != "cuda" and not INTERPRET:
            raise ValueError(f"x: the Triton paths need CUDA tensors (got {x.device}); use path='reference'")
    if validate:
        check_values(ranges + ([] if checked else routing_ranges(topk_ids, token_lora, E, L)))
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    if dx_rows is not None:
        check_tensor("dx_rows", dx_rows, dtypes=(acc,), shape=(M * k, K), legend="[M*k, K] pair rows of x's gradient")
        check_same_device(x=x, dx_rows=dx_rows)
        if not dx_rows.is_contiguous():
            raise ValueError("dx_rows: must be contiguous (the kernels add into its rows); pass a contiguous buffer")
        if "x" not in wanted:
            raise ValueError("dx_rows: given, but needs leaves out 'x'; add 'x' to needs or drop dx_rows")
    if M == 0 or R == 0 or not wanted:                 # nothing reaches a weight: zero gradients
        zeros = LoRAGrads(x.new_zeros(x.shape, dtype=acc) if dx_rows is None else dx_rows, x.new_zeros(M, k, dtype=acc),
                          [w.new_zeros(w.shape, dtype=acc) for w in lora_a],
                          [w.new_zeros(w.shape, dtype=acc) for w in lora_b])
        return LoRAGrads(*(getattr(zeros, n) if n in wanted else None for n in GRAD_NAMES))
    if grad_path.triton and INTERPRET and x.dtype == torch.bfloat16:     # the interpreter mis-computes bf16
        x, lora_a, lora_b = x.float(), [w.float() for w in lora_a], [w.float() for w in lora_b]
    g = grad_out.reshape(M * k, S * N)
    if grad_path.triton:
        g = g.to(x.dtype)
        if g.stride(1) != 1 and S * N > 1:
            g = g.contiguous()                           # the kernels take the gradient's columns as contiguous
    with on_device(x):
        if grad_path.triton:
            eff = effective_lora(token_lora, enabled)
            if blocks is None:
                blocks = make_blocks(topk_ids, eff, E, L, block_m, values_checked=validate)
            elif enabled is not None:
                blocks = blocks.with_slots_disabled(enabled.to(x.device))
        call = GradCall(x, topk_ids, topk_weights, token_lora, list(lora_a), list(lora_b), g, blocks, lora_ranks,
                        enabled, mul_routed_weight, frozenset(wanted), config, dx_rows)
        return grad_path.launch(call)


def spec_forward(x, topk_ids, topk_weights, token_lora, lora_a, lora_b, *, mul_routed_weight=False,
                 lora_ranks=None, enabled=None, **_):
    """moe_lora's delta by the spec, in any float dtype (float64 too): the forward the gradient checks use."""
    token_lora = effective_lora(token_lora, enabled)
    if lora_ranks is not None:                           # weights past each slot's rank: zeros, never read
        keep = torch.arange(lora_a[0].shape[2], device=x.device)[None, :] < lora_ranks.to(x.device)[:, None]
        lora_a = [torch.where(keep[:, None, :, None], w, torch.zeros_like(w)) for w in lora_a]
        lora_b = [torch.where(keep[:, None, None, :], w, torch.zeros_like(w)) for w in lora_b]
    return moe_lora_reference(x, topk_ids, topk_weights, token_lora, lora_a, lora_b,
                              mul_routed_weight=mul_routed_weight)


class _Spec(NamedTuple):
    forward: Callable                # the op without autograd, e.g. moelora_lab.moe_lora
    topk_ids: torch.Tensor
    token_lora: torch.Tensor
    options: dict                    # the forward's keyword arguments
    grad_path: str


class MoELoRAFunction(torch.autograd.Function):
    """The op with a backward: ``forward`` runs the op under no_grad, ``backward`` :func:`moe_lora_backward`
    for the inputs that need a gradient (``ctx.needs_input_grad``); no double backward."""

    @staticmethod
    def forward(ctx, spec: _Spec, x, topk_weights, *weights):
        S = len(weights) // 2
        out = spec.forward(x, spec.topk_ids, topk_weights, spec.token_lora, list(weights[:S]), list(weights[S:]),
                           **spec.options)
        ctx.spec = spec
        ctx.save_for_backward(x, topk_weights, *weights)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        spec, (x, topk_weights, *weights) = ctx.spec, ctx.saved_tensors
        S, need, opt = len(weights) // 2, ctx.needs_input_grad, ctx.spec.options
        needs = [n for n, on in (("x", need[1]), ("topk_weights", need[2]), ("lora_a", any(need[3:3 + S])),
                                 ("lora_b", any(need[3 + S:]))) if on]
        got = moe_lora_backward(x, spec.topk_ids, topk_weights, spec.token_lora, weights[:S], weights[S:], grad_out,
                                mul_routed_weight=opt.get("mul_routed_weight", False),
                                lora_ranks=opt.get("lora_ranks"), enabled=opt.get("enabled"), path=spec.grad_path,
                                blocks=opt.get("blocks"), needs=needs, validate=False)

        def cast(grad, like, on):
            return grad.to(like.dtype) if on and grad is not None else None
        return (None, cast(got.x, x, need[1]), cast(got.topk_weights, topk_weights, need[2]),
                *(cast(got.lora_a and got.lora_a[s], weights[s], need[3 + s]) for s in range(S)),
                *(cast(got.lora_b and got.lora_b[s], weights[S + s], need[3 + S + s]) for s in range(S)))


def lora_with_grad(forward, x, topk_ids, topk_weights, token_lora, lora_a, lora_b, *, grad_path: str = "auto",
                   **options):
    """``forward(x, topk_ids, topk_weights, token_lora, lora_a, lora_b, **options)`` (``moe_lora`` or
    :func:`spec_forward`) recorded for autograd, its backward by ``grad_path`` (a name of GRAD_PATHS or
    'auto'). ``moe_lora`` calls this itself when an input requires grad."""
    check_choice("grad_path", grad_path, GRAD_PATH_CHOICES)
    check_op_inputs(x, topk_ids, topk_weights, token_lora, lora_a, lora_b, values=False, dtypes=SPEC_DTYPES,
                    mul_routed_weight=options.get("mul_routed_weight", False))
    spec = _Spec(forward, topk_ids, token_lora, options, grad_path)
    return MoELoRAFunction.apply(spec, x, topk_weights, *lora_a, *lora_b)
