"""Exercises of notebook 09 (the backward pass: training adapters on the MoE layer).

Shape legend: M tokens, k top-k, E experts, L adapters, r rank, K in, N out, S slices, P = M*k pairs; n pairs
of one (adapter, expert) group; c bytes per element of x, T and dT.
Every truth comes from the lab: ``reference.moe_lora_backward_reference`` (the backward's spec),
``profile.grad_traffic.grad_op_traffic`` (its byte model) and autograd through ``reference.moe_layer_reference``.
"""
from __future__ import annotations

import math

import torch

from .core import Exercise, Result, compare, predict_result, register, with_known_misses

NB = "09_backward_pass"

# ---- 09.group_grads: the backward of one (adapter, expert) group ------------------------------------------

GROUP_CASES = (dict(n=5, K=12, N=8, r=3), dict(n=1, K=7, N=9, r=1), dict(n=16, K=24, N=20, r=6))


def _spec_group(xs, a, b, g):
    """(dx, dA, dB) of one group by the spec: L = E = 1, k = 1, one slice, every pair on adapter 0."""
    from ..reference import moe_lora_backward_reference
    n = xs.shape[0]
    zeros = torch.zeros(n, 1, dtype=torch.int32)
    got = moe_lora_backward_reference(xs, zeros, torch.ones(n, 1, dtype=xs.dtype), zeros[:, 0], [a[None, None]],
                                      [b[None, None]], g[:, None, :])
    return got.x, got.lora_a[0][0, 0], got.lora_b[0][0, 0]


def _grade_group(fn) -> Result:
    if not callable(fn):
        return Result(False, f"09.group_grads: expected a function, got {type(fn).__name__}")
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31 - 1, ())))
    for i, c in enumerate(GROUP_CASES):
        xs, a = torch.randn(c["n"], c["K"], generator=gen), torch.randn(c["r"], c["K"], generator=gen)
        b, g = torch.randn(c["N"], c["r"], generator=gen), torch.randn(c["n"], c["N"], generator=gen)
        want = _spec_group(*(t.double() for t in (xs, a, b, g)))
        out = fn(xs.clone(), a.clone(), b.clone(), g.clone())
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            return Result(False, f"09.group_grads: return three tensors (dx, da, db), got {type(out).__name__}")
        what = f"case {i + 1} (n = {c['n']}, K = {c['K']}, N = {c['N']}, r = {c['r']})"
        for name, got, ref, legend in zip(("dx", "da", "db"), out, want, ("[n, K]", "[r, K]", "[N, r]")):
            if isinstance(got, torch.Tensor) and got.ndim == 2 and got.shape != ref.shape and got.shape == ref.T.shape \
                    and torch.allclose(got.T.double(), ref, rtol=1e-4, atol=1e-4):
                return Result(False, f"09.group_grads: {what}: {name} is right but transposed: return it as {legend}, "
                                     "the shape of the tensor it is the gradient of")
            wrong = compare("09.group_grads", got, ref, what=f"{what}: {name} {legend}", row_name="row")
            if wrong:
                nudges = ()
                if name == "da" and isinstance(got, torch.Tensor) and got.shape == ref.shape:
                    nudges = ("dA = dTᵀ xs, with dT = G B: the gradient reaching T, not G itself",)
                elif name == "db" and isinstance(got, torch.Tensor) and got.shape == ref.shape:
                    nudges = ("dB = Gᵀ T, with T = xs Aᵀ recomputed from the forward",)
                return Result(False, wrong.message, wrong.details, nudges=nudges)
    return Result(True, f"09.group_grads: equals the spec (moe_lora_backward_reference) on {len(GROUP_CASES)} fresh "
                        "groups, one of a single pair at rank 1")


GROUP_STUB = '''\
import torch


def group_grads(xs, a, b, g):
    """The LoRA gradients of one (adapter, expert) group: its n pairs, one slice, no routing weight.

    xs [n, K]: the pairs' input rows; a [r, K]: A[l, e]; b [N, r]: B[l, e]; the forward gave each pair
    out = b @ (a @ x), i.e. out [n, N] = (xs @ a.T) @ b.T; g [n, N]: the gradient of the loss w.r.t. out.
    Returns (dx [n, K], da [r, K], db [N, r]).
    """
    raise NotImplementedError
'''

# ---- 09.t_bytes: the bytes of T and dT in the two-kernel backward ---------------------------------------

T_BYTES = dict(shape="qwen3-30b-a3b", M=256, rank=16, dtype_bytes=2)      # w13: K = hidden, N = intermediate


def t_bytes_truth() -> tuple[float, dict]:
    """(bytes of T and dT written and read back by the two-kernel backward, the quantities behind it) for
    the case of :data:`T_BYTES`: w13's op, one adapter, every token on it (grad_op_traffic's parts)."""
    from ..config import MoEShape
    from ..profile.grad_traffic import GradWorkload, grad_op_traffic, grad_tiles
    c = T_BYTES
    s = MoEShape.from_name(c["shape"])
    P = c["M"] * s.top_k
    per_expert = [P // s.num_experts + (e < P % s.num_experts) for e in range(s.num_experts)]
    wl = GradWorkload.from_counts([per_expert], num_tokens=c["M"], top_k=s.top_k, block_size=16)
    t = grad_op_traffic("two_kernel", wl, in_features=s.hidden, out_features=s.intermediate, num_slices=2,
                        rank=c["rank"], dtype_bytes=c["dtype_bytes"])
    BN, BK, _ = grad_tiles(c["rank"])
    truth = sum(t.total.part(p) for p in ("t_write", "dt_write", "t_read", "dt_read"))
    return float(truth), dict(P=P, K=s.hidden, N=s.intermediate, k=s.top_k, BN=BN, BK=BK, S=2, r=c["rank"],
                              c=c["dtype_bytes"])


def _grade_t_bytes(guess) -> Result:
    truth, q = t_bytes_truth()
    S, P, r, c, K, N, BN, BK = q["S"], q["P"], q["r"], q["c"], q["K"], q["N"], q["BN"], q["BK"]
    one = S * P * r * c                                     # one pass over T (or dT) of both slices
    n_reads, k_reads = math.ceil(N / BN), math.ceil(K / BK)
    explain = (f"T and dT are [S, P, r] = [{S}, {P}, {r}] in bf16: {one:,} bytes each. Each is written once; the "
               f"weight kernel reads T once per N tile of dB (⌈{N}/{BN}⌉ = {n_reads}) and dT once per K tile of "
               f"dA (⌈{K}/{BK}⌉ = {k_reads}): {one:,} · (2 + {n_reads} + {k_reads}) = {truth:,.0f} bytes")
    res = predict_result("09.t_bytes", guess, truth, rel=0.05, unit=" B", explain=explain)
    return with_known_misses(res, guess, {
        2 * one: "that writes T and dT but never reads them back; the weight kernel reads them, and "
                 "more than once",
        4 * one: "that reads T and dT back once each; the weight kernel reads them once per tile of its output",
        truth / S: "w13 has two slices (gate and up), each with its own T and dT",
        truth * 2: "T and dT are stored in x's dtype (bf16, 2 bytes), not in float32",
        truth / q["k"]: "each token is k pairs, and each pair has its own row of T",
        one * (1 + n_reads): "that is T alone; dT goes through HBM too",
        one * (1 + k_reads): "that is dT alone; T goes through HBM too"}, rel=0.05)


T_BYTES_STUB = '''\
# The two-kernel backward of qwen3-30b-a3b's w13 LoRA (K = 2048 in, N = 768 out per slice, S = 2 slices:
# gate and up), rank r = 16, bf16, M = 256 tokens, top_k = 8, every token on one adapter.
# The weight kernel's tiles: BN = 64 columns of dB, BK = 64 columns of dA.
# How many bytes of T and dT does it write and read back, T and dT together? Write a number, then run the check.
t_bytes_guess = None
'''

# ---- 09.mean_scale: the joint loss against a plain mean over the batch ----------------------------------

JOINT = dict(tokens_per_adapter=(8, 8), no_adapter_tokens=4)    # the batch of the notebook's section 4


def mean_scale_truth() -> float:
    """Adapter 0's LoRA gradient under the mean of every token's loss over the batch, as a multiple of its
    gradient under the joint loss sum_l mean(loss over l's tokens): autograd through moe_layer_reference on a
    tiny problem with :data:`JOINT`'s tokens."""
    from ..config import LoRAShape, make_problem
    from ..reference import moe_layer_reference
    counts, none = JOINT["tokens_per_adapter"], JOINT["no_adapter_tokens"]
    M = sum(counts) + none
    p = make_problem("tiny", LoRAShape(num_loras=len(counts), rank=4), num_tokens=M, seed=9)
    lora = torch.cat([torch.full((n,), l) for l, n in enumerate(counts)] + [torch.full((none,), -1)])
    token_lora = lora[torch.randperm(M, generator=torch.Generator().manual_seed(9))].to(torch.int32)
    target = torch.randn(M, p.shape.hidden, generator=torch.Generator().manual_seed(10))
    grads = []
    for joint in (True, False):
        a = [w.clone().requires_grad_(True) for w in p.w13_lora_a]
        y = moe_layer_reference(p.x, p.topk_ids, p.topk_weights, token_lora, p.w13, p.w2, a, list(p.w13_lora_b),
                                list(p.w2_lora_a), list(p.w2_lora_b))
        per_token = ((y - target) ** 2).mean(dim=1)
        loss = sum(per_token[token_lora == l].mean() for l in range(len(counts))) if joint else per_token.mean()
        loss.backward()
        grads.append(a[0].grad[0])                             # adapter 0's A of the gate slice
    joint_grad, mean_grad = grads
    return round(float((mean_grad * joint_grad).sum() / (joint_grad * joint_grad).sum()), 6)   # float32 noise off


def _grade_mean_scale(guess) -> Result:
    truth = mean_scale_truth()
    (n0, n1), none = JOINT["tokens_per_adapter"], JOINT["no_adapter_tokens"]
    M = n0 + n1 + none
    explain = (f"the joint loss divides adapter 0's summed token losses by its own {n0} tokens; the plain mean "
               f"divides them by all {M}, and the other tokens add nothing to adapter 0's gradient: "
               f"{n0} / {M} = {truth:.3g}")
    res = predict_result("09.mean_scale", guess, truth, rel=0.02, explain=explain)
    return with_known_misses(res, guess, {
        n0 / (n0 + n1): "the tokens without an adapter count in a mean over the batch too",
        1.0: "the two losses divide adapter 0's token losses by different counts",
        M / n0: "that is the joint loss's gradient as a multiple of the mean's: the other way round",
        1 / (len(JOINT["tokens_per_adapter"]) + 1): "count tokens, not adapters"}, rel=0.02)


MEAN_SCALE_STUB = '''\
# The batch below: 8 tokens on adapter 0, 8 on adapter 1, 4 without an adapter. The joint loss is
# mean(losses of adapter 0's tokens) + mean(losses of adapter 1's tokens). Were it instead the mean of
# all 20 tokens' losses, adapter 0's gradient would be its joint-loss gradient times what number?
mean_scale_guess = None
'''

register(
    Exercise("09.group_grads", NB, "code", "the LoRA gradients of one (adapter, expert) group",
             "group_grads", GROUP_STUB, _grade_group,
             hint="Recompute T = xs A^T [n, r] first. The chain rule through out = T B^T gives dB = G^T T and "
                  "the gradient reaching T, dT = G B [n, r]; through T = xs A^T it gives dA = dT^T xs and "
                  "dx = dT A. Each gradient has the shape of what it is the gradient of."),
    Exercise("09.t_bytes", NB, "predict", "the bytes of T and dT in the two-kernel backward",
             "t_bytes_guess", T_BYTES_STUB, _grade_t_bytes,
             hint="T and dT each hold r values per pair and slice: S·P·r elements of c bytes, P = M·k. The rank "
                  "kernel writes both once. The weight kernel reads T again for every BN-wide tile of dB's N "
                  "columns, and dT again for every BK-wide tile of dA's K columns."),
    Exercise("09.mean_scale", NB, "predict", "the joint loss against a plain mean over the batch",
             "mean_scale_guess", MEAN_SCALE_STUB, _grade_mean_scale,
             hint="A token's loss reaches only the LoRA of its own adapter. Under the joint loss adapter 0's "
                  "token losses are divided by how many tokens adapter 0 has; under a mean over the batch, by "
                  "how many tokens the batch has."),
)
