"""The spec: naive PyTorch MoE-LoRA and its backward, accumulating in float32 (float64 inputs: in float64).

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, K in, N out, S slices,
H hidden, I expert intermediate; pair p = t*k + j, P = M*k pairs.

Every kernel in the lab is checked against these functions. Each forward comes twice: a ``*_loop``
version to read line by line, and a vectorized version (grouped by (adapter, expert), one
matmul per group) fast enough for real presets on a CPU. Tests check that the two agree.

The backward. The forward gives each pair p with an adapter l and expert e

    T_s  = A_s[l, e] x_p                         [r]    the rank intermediate of slice s
    out_p[s] = w_p? * B_s[l, e] T_s              [N]    (w_p only with mul_routed_weight)

so, with G = dL/dout_p[s] and dY = w_p? * G,

    dB_s[l, e] += dY T_sᵀ        [N, r]     dT_s = B_s[l, e]ᵀ dY          [r]
    dA_s[l, e] += dT_s x_pᵀ      [r, K]     dx_p += A_s[l, e]ᵀ dT_s       [K]
    dw_p       += G · (B_s T_s) = (B_sᵀ G) · T_s                           (mul_routed_weight only)

Two rank intermediates: T (the forward's, recomputed) and dT. Tokens without an adapter, disabled
slots, ranks past ``lora_ranks`` and experts no pair of a slot reaches get exactly zero gradient.
Token rows (x [M, K], every slot reads its token's row) sum dx over the token's k pairs.
:func:`moe_lora_backward_reference` groups the pairs by (adapter, expert), one matmul per group, as
:func:`moe_lora_reference` computes the forward; tests check it against torch autograd of the forward
spec in float64.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .validate import SPEC_DTYPES, check_layer_base, check_op_inputs


def _acc(x: torch.Tensor) -> torch.dtype:
    """The accumulation dtype: float32, or float64 for float64 inputs (the gradient checks)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def moe_lora_reference_loop(x, topk_ids, topk_weights, token_lora, lora_a, lora_b, *, mul_routed_weight=False):
    """One pair at a time: out[t, j, s*N:(s+1)*N] = w? * B_s[l, e] @ (A_s[l, e] @ x_row)."""
    M, k, L, E, r, K, N, S = check_op_inputs(x, topk_ids, topk_weights, token_lora, lora_a, lora_b,
                                             mul_routed_weight=mul_routed_weight, dtypes=SPEC_DTYPES)
    acc = _acc(x)
    out = torch.zeros(M, k, S * N, dtype=acc, device=x.device)
    pair_rows = x.shape[0] == M * k and k > 1
    for t in range(M):
        l = int(token_lora[t])
        if l < 0:
            continue                                     # no adapter: the delta is zero
        for j in range(k):
            e = int(topk_ids[t, j])
            row = x[t * k + j] if pair_rows else x[t]    # [K]
            for s in range(S):
                shrunk = lora_a[s][l, e].to(acc) @ row.to(acc)          # [r]
                delta = lora_b[s][l, e].to(acc) @ shrunk                # [N]
                if mul_routed_weight:
                    delta = delta * float(topk_weights[t, j])
                out[t, j, s * N:(s + 1) * N] = delta
    return out


def moe_lora_reference(x, topk_ids, topk_weights, token_lora, lora_a, lora_b, *, mul_routed_weight=False):
    """LoRA delta of every pair, [M, k, S*N] float32; zero rows for tokens without an adapter.

    x is [M, K] (token rows: every slot of a token reads the same row, the w13 input) or [M*k, K]
    (pair rows, the w2 input). With k == 1 the two coincide.
    """
    M, k, L, E, r, K, N, S = check_op_inputs(x, topk_ids, topk_weights, token_lora, lora_a, lora_b,
                                             mul_routed_weight=mul_routed_weight, dtypes=SPEC_DTYPES)
    acc = _acc(x)
    out = torch.zeros(M * k, S * N, dtype=acc, device=x.device)
    pair_lora = token_lora.long().repeat_interleave(k)          # [M*k]
    pair_expert = topk_ids.reshape(-1).long()                   # [M*k]
    rows = torch.arange(M * k, device=x.device)
    src = rows if x.shape[0] == M * k else rows // k            # row of x read by each pair
    key = torch.where(pair_lora >= 0, pair_lora * E + pair_expert, torch.full_like(pair_lora, -1))
    weight = topk_weights.reshape(-1).to(acc) if mul_routed_weight else None
    for g in torch.unique(key).tolist():                        # one matmul per (adapter, expert)
        if g < 0:
            continue
        l, e = divmod(g, E)
        sel = (key == g).nonzero().squeeze(1)                   # [n] pairs of this group
        xs = x[src[sel]].to(acc)                                # [n, K]
        for s in range(S):
            delta = (xs @ lora_a[s][l, e].to(acc).T) @ lora_b[s][l, e].to(acc).T   # [n, N]
            if weight is not None:
                delta = delta * weight[sel, None]
            out[sel, s * N:(s + 1) * N] = delta
    return out.view(M, k, S * N)


def moe_layer_reference_loop(x, topk_ids, topk_weights, token_lora, w13, w2,
                             w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b):
    """The whole layer, one pair at a time: y_t = sum_j w_tj (W2_e + B2 A2) h_tj, [M, H] float32."""
    E, H, I = check_layer_base(x, topk_ids, w13, w2, dtypes=SPEC_DTYPES)
    acc = _acc(x)
    M, k = topk_ids.shape
    lora13 = moe_lora_reference_loop(x, topk_ids, topk_weights, token_lora, w13_lora_a, w13_lora_b)
    y = torch.zeros(M, H, dtype=acc, device=x.device)
    for t in range(M):
        for j in range(k):
            e = int(topk_ids[t, j])
            c1 = w13[e].to(acc) @ x[t].to(acc) + lora13[t, j]        # [2I] gate | up
            h = F.silu(c1[:I]) * c1[I:]                             # [I]
            c3 = w2[e].to(acc) @ h                                   # [H]
            l = int(token_lora[t])
            if l >= 0:
                c3 = c3 + w2_lora_b[0][l, e].to(acc) @ (w2_lora_a[0][l, e].to(acc) @ h)
            y[t] += float(topk_weights[t, j]) * c3
    return y


def _reads(fn, name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` as a GEMM reads it: ``fn(t)``, checked to keep t's shape and dtype (it stands for the activation, not
    a new one), or t itself where ``fn`` is None."""
    if fn is None:
        return t
    if not callable(fn):
        raise TypeError(f"{name}: expected a function of the GEMM's input or None, got {type(fn).__name__}")
    out = fn(t)
    if not isinstance(out, torch.Tensor) or out.shape != t.shape or out.dtype != t.dtype:
        got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"{name}: returned {got} for an input of {tuple(t.shape)} {t.dtype}; it must return a "
                         "tensor of the same shape and dtype (the activation as the GEMM reads it)")
    return out


def moe_layer_reference(x, topk_ids, topk_weights, token_lora, w13, w2,
                        w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b, *, base_input=None, lora_input=None):
    """The whole MoE layer with LoRA on w13 (2 slices) and w2 (1 slice): [M, H] float32.

    c1 = W13[e] x_t + LoRA13 (no routing weight);  h = silu(gate) * up;
    c3 = w_tj * (W2[e] h + LoRA2 h);  y_t = sum_j c3[t, j].

    ``base_input``, a function of a [rows, K] tensor in the accumulation dtype, is applied to the input of each base
    GEMM only (x [M, H] before W13, h [M*k, I] before W2), e.g. FP8 activation quantization; the LoRA ops still
    read the unquantized x and h. None: the base reads them as they are. ``lora_input`` likewise for the LoRA ops'
    inputs (only to show a mistake: a LoRA fed the base's quantized activations).
    """
    E, H, I = check_layer_base(x, topk_ids, w13, w2, dtypes=SPEC_DTYPES)
    acc = _acc(x)
    M, k = topk_ids.shape
    experts = topk_ids.reshape(-1).long()                                       # [M*k]
    xb = _reads(base_input, "base_input", x.to(acc))                            # the W13 GEMM's input
    xs = xb.repeat_interleave(k, dim=0)                                         # [M*k, H]
    c1 = torch.zeros(M * k, 2 * I, dtype=acc, device=x.device)
    for e in torch.unique(experts).tolist():                                    # grouped base GEMM
        sel = experts == e
        c1[sel] = xs[sel] @ w13[e].to(acc).T
    xl = x if lora_input is None else _reads(lora_input, "lora_input", x.to(acc))
    c1 += moe_lora_reference(xl, topk_ids, topk_weights, token_lora, w13_lora_a, w13_lora_b).view(M * k, 2 * I)
    h = F.silu(c1[:, :I]) * c1[:, I:]                                           # [M*k, I]
    hb = _reads(base_input, "base_input", h)                                    # the W2 GEMM's input
    c3 = torch.zeros(M * k, H, dtype=acc, device=x.device)
    for e in torch.unique(experts).tolist():
        sel = experts == e
        c3[sel] = hb[sel] @ w2[e].to(acc).T
    c3 = c3 * topk_weights.reshape(-1, 1).to(acc)
    c3 += moe_lora_reference(_reads(lora_input, "lora_input", h), topk_ids, topk_weights, token_lora, w2_lora_a,
                             w2_lora_b, mul_routed_weight=True).view(M * k, H)
    return c3.view(M, k, H).sum(dim=1)


@dataclass
class LoRAGrads:
    """The gradients of one LoRA op call, each in its input's shape; None where not asked for.

    x [M, K] or [M*k, K]; topk_weights [M, k] (only with mul_routed_weight); lora_a / lora_b lists
    of [L, E, r, K] / [L, E, N, r], one per slice. Accumulated in float32 (float64 inputs: float64).
    """
    x: torch.Tensor | None
    topk_weights: torch.Tensor | None
    lora_a: list | None
    lora_b: list | None


def effective_lora(token_lora, enabled=None):
    """token_lora with disabled slots turned into -1 (no adapter)."""
    if enabled is None:
        return token_lora
    on = (token_lora >= 0) & enabled.to(token_lora.device)[token_lora.clamp(min=0).long()]
    return torch.where(on, token_lora, torch.full_like(token_lora, -1))


def moe_lora_backward_reference(x, topk_ids, topk_weights, token_lora, lora_a, lora_b, grad_out, *,
                                mul_routed_weight: bool = False, lora_ranks=None, enabled=None) -> LoRAGrads:
    """Gradients of ``moe_lora(...)`` (the delta, [M, k, S*N]) given ``grad_out`` [M, k, S*N].

    Arguments as :func:`moelora_lab.moe_lora`; ``lora_ranks`` [L] cuts slot l's rank to its value (rows of
    A and columns of B past it get zero gradient and are never read), ``enabled`` [L] bool turns slots off.
    """
    M, k, L, E, r, K, N, S = check_op_inputs(x, topk_ids, topk_weights, token_lora, lora_a, lora_b,
                                             mul_routed_weight=mul_routed_weight, dtypes=SPEC_DTYPES)
    acc = _acc(x)
    dev = x.device
    token_lora = effective_lora(token_lora, enabled)
    g = grad_out.reshape(M * k, S * N).to(acc)
    dx = torch.zeros(x.shape, dtype=acc, device=dev)
    dw = torch.zeros(M * k, dtype=acc, device=dev) if mul_routed_weight else None
    da = [torch.zeros(a.shape, dtype=acc, device=dev) for a in lora_a]
    db = [torch.zeros(b.shape, dtype=acc, device=dev) for b in lora_b]
    pair_lora = token_lora.long().repeat_interleave(k)
    pair_expert = topk_ids.reshape(-1).long()
    rows = torch.arange(M * k, device=dev)
    src = rows if x.shape[0] == M * k else rows // k
    key = torch.where(pair_lora >= 0, pair_lora * E + pair_expert, torch.full_like(pair_lora, -1))
    w = topk_weights.reshape(-1).to(acc) if mul_routed_weight else None
    for grp in torch.unique(key).tolist():
        if grp < 0:
            continue
        l, e = divmod(grp, E)
        rl = r if lora_ranks is None else min(r, int(lora_ranks[l]))
        if rl == 0:
            continue
        sel = (key == grp).nonzero().squeeze(1)              # [n] pairs of this group
        xs = x[src[sel]].to(acc)                              # [n, K]
        for s in range(S):
            a = lora_a[s][l, e, :rl].to(acc)                  # [rl, K]
            b = lora_b[s][l, e, :, :rl].to(acc)               # [N, rl]
            gs = g[sel, s * N:(s + 1) * N]                    # [n, N]
            t = xs @ a.T                                      # [n, rl]  T
            gt = gs @ b                                       # [n, rl]  Bᵀ G
            if w is not None:
                dw[sel] += (gt * t).sum(1)
                dt = gt * w[sel, None]
                dy = gs * w[sel, None]
            else:
                dt, dy = gt, gs
            db[s][l, e, :, :rl] += dy.T @ t
            da[s][l, e, :rl] += dt.T @ xs
            dx.index_add_(0, src[sel], dt @ a)
    return LoRAGrads(x=dx, topk_weights=None if dw is None else dw.view(M, k), lora_a=da, lora_b=db)
