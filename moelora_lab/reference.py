"""The spec: naive PyTorch MoE-LoRA, accumulating in float32.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, K in, N out, S slices,
H hidden, I expert intermediate; pair p = t*k + j.

Every kernel in the lab is checked against these functions. Each comes twice: a ``*_loop``
version to read line by line, and a vectorized version (grouped by (adapter, expert), one
matmul per group) fast enough for real presets on a CPU. Tests check that the two agree.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from ._checks import FLOAT_DTYPES, check_same_device, check_tensor
from .routing import check_routing


def check_lora_weights(lora_a, lora_b, num_experts: int | None = None, in_features: int | None = None):
    """Validate S slices of A [L, E, r, K] and B [L, E, N, r]; returns (L, E, r, K, N, S)."""
    for name, ws in (("lora_a", lora_a), ("lora_b", lora_b)):
        if isinstance(ws, torch.Tensor) or not isinstance(ws, Sequence) or len(ws) == 0:
            raise TypeError(f"{name}: expected a non-empty list or tuple of tensors (one per slice), "
                            f"got {type(ws).__name__}")
    if len(lora_a) != len(lora_b):
        raise ValueError(f"lora_a and lora_b: got {len(lora_a)} and {len(lora_b)} slices; they must match")
    first = check_tensor("lora_a[0]", lora_a[0], ndim=4, dtypes=FLOAT_DTYPES, legend="[L, E, r, K]")
    L, E, r, K = first.shape
    N = check_tensor("lora_b[0]", lora_b[0], ndim=4, dtypes=FLOAT_DTYPES, legend="[L, E, N, r]").shape[2]
    for s, (a, b) in enumerate(zip(lora_a, lora_b)):
        check_tensor(f"lora_a[{s}]", a, dtypes=(first.dtype,), shape=(L, E, r, K), legend="[L, E, r, K]")
        check_tensor(f"lora_b[{s}]", b, dtypes=(first.dtype,), shape=(L, E, N, r), legend="[L, E, N, r]")
        check_same_device(**{"lora_a[0]": first, f"lora_a[{s}]": a, f"lora_b[{s}]": b})
        for name, w, w0 in (("lora_a", a, first), ("lora_b", b, lora_b[0])):
            if w.stride() != w0.stride():     # the kernels read every slice with slice 0's strides
                raise ValueError(f"{name}: the slices have different memory layouts (strides {w0.stride()} and "
                                 f"{w.stride()}); make them all contiguous, or pass all of lora_b through "
                                 "moelora_lab.pack_lora_b")
    if num_experts is not None and E != num_experts:
        raise ValueError(f"lora_a[0]: has {E} experts (dim 1) but the base layer has {num_experts}")
    if in_features is not None and K != in_features:
        raise ValueError(f"lora_a[0]: expects K={K} input features (dim 3) but x has {in_features}")
    return L, E, r, K, N, len(lora_a)


def _check_op_inputs(x, topk_ids, topk_weights, token_lora, lora_a, lora_b):
    """Shared validation of the LoRA op's inputs; returns (M, k, L, E, r, K, N, S)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, legend="[M, K] token rows or [M*k, K] pair rows")
    L, E, r, K, N, S = check_lora_weights(lora_a, lora_b, in_features=x.shape[1])
    check_routing(topk_ids, token_lora, E, L, topk_weights)
    M, k = topk_ids.shape
    if x.shape[0] not in (M, M * k):
        raise ValueError(f"x: has {x.shape[0]} rows; expected M={M} (token rows) or M*k={M * k} (pair rows)")
    check_same_device(x=x, topk_ids=topk_ids, **{"lora_a[0]": lora_a[0]})
    return M, k, L, E, r, K, N, S


def moe_lora_reference_loop(x, topk_ids, topk_weights, token_lora, lora_a, lora_b, *, mul_routed_weight=False):
    """One pair at a time: out[t, j, s*N:(s+1)*N] = w? * B_s[l, e] @ (A_s[l, e] @ x_row)."""
    M, k, L, E, r, K, N, S = _check_op_inputs(x, topk_ids, topk_weights, token_lora, lora_a, lora_b)
    out = torch.zeros(M, k, S * N, dtype=torch.float32, device=x.device)
    pair_rows = x.shape[0] == M * k and k > 1
    for t in range(M):
        l = int(token_lora[t])
        if l < 0:
            continue                                     # no adapter: the delta is zero
        for j in range(k):
            e = int(topk_ids[t, j])
            row = x[t * k + j] if pair_rows else x[t]    # [K]
            for s in range(S):
                shrunk = lora_a[s][l, e].float() @ row.float()          # [r]
                delta = lora_b[s][l, e].float() @ shrunk                # [N]
                if mul_routed_weight:
                    delta = delta * float(topk_weights[t, j])
                out[t, j, s * N:(s + 1) * N] = delta
    return out


def moe_lora_reference(x, topk_ids, topk_weights, token_lora, lora_a, lora_b, *, mul_routed_weight=False):
    """LoRA delta of every pair, [M, k, S*N] float32; zero rows for tokens without an adapter.

    x is [M, K] (token rows: every slot of a token reads the same row, the w13 input) or [M*k, K]
    (pair rows, the w2 input). With k == 1 the two coincide.
    """
    M, k, L, E, r, K, N, S = _check_op_inputs(x, topk_ids, topk_weights, token_lora, lora_a, lora_b)
    out = torch.zeros(M * k, S * N, dtype=torch.float32, device=x.device)
    pair_lora = token_lora.long().repeat_interleave(k)          # [M*k]
    pair_expert = topk_ids.reshape(-1).long()                   # [M*k]
    rows = torch.arange(M * k, device=x.device)
    src = rows if x.shape[0] == M * k else rows // k            # row of x read by each pair
    key = torch.where(pair_lora >= 0, pair_lora * E + pair_expert, torch.full_like(pair_lora, -1))
    weight = topk_weights.reshape(-1).float() if mul_routed_weight else None
    for g in torch.unique(key).tolist():                        # one matmul per (adapter, expert)
        if g < 0:
            continue
        l, e = divmod(g, E)
        sel = (key == g).nonzero().squeeze(1)                   # [n] pairs of this group
        xs = x[src[sel]].float()                                # [n, K]
        for s in range(S):
            delta = (xs @ lora_a[s][l, e].float().T) @ lora_b[s][l, e].float().T   # [n, N]
            if weight is not None:
                delta = delta * weight[sel, None]
            out[sel, s * N:(s + 1) * N] = delta
    return out.view(M, k, S * N)


def _check_layer(x, topk_ids, w13, w2):
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, legend="[M, H]")
    check_tensor("w13", w13, ndim=3, dtypes=FLOAT_DTYPES, legend="[E, 2I, H]")
    E, two_i, H = w13.shape
    if two_i % 2:
        raise ValueError(f"w13: dim 1 must be 2*I (gate and up stacked), got {two_i}")
    check_tensor("w2", w2, dtypes=FLOAT_DTYPES, shape=(E, H, two_i // 2), legend="[E, H, I]")
    if x.shape[1] != H:
        raise ValueError(f"x: has {x.shape[1]} features but w13 expects H={H}")
    check_tensor("topk_ids", topk_ids, ndim=2, legend="[M, k]")
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids: has {topk_ids.shape[0]} rows but x has M={x.shape[0]}")
    return E, H, two_i // 2


def moe_layer_reference_loop(x, topk_ids, topk_weights, token_lora, w13, w2,
                             w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b):
    """The whole layer, one pair at a time: y_t = sum_j w_tj (W2_e + B2 A2) h_tj, [M, H] float32."""
    E, H, I = _check_layer(x, topk_ids, w13, w2)
    M, k = topk_ids.shape
    lora13 = moe_lora_reference_loop(x, topk_ids, topk_weights, token_lora, w13_lora_a, w13_lora_b)
    y = torch.zeros(M, H, dtype=torch.float32, device=x.device)
    for t in range(M):
        for j in range(k):
            e = int(topk_ids[t, j])
            c1 = w13[e].float() @ x[t].float() + lora13[t, j]        # [2I] gate | up
            h = F.silu(c1[:I]) * c1[I:]                             # [I]
            c3 = w2[e].float() @ h                                   # [H]
            l = int(token_lora[t])
            if l >= 0:
                c3 = c3 + w2_lora_b[0][l, e].float() @ (w2_lora_a[0][l, e].float() @ h)
            y[t] += float(topk_weights[t, j]) * c3
    return y


def moe_layer_reference(x, topk_ids, topk_weights, token_lora, w13, w2,
                        w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b):
    """The whole MoE layer with LoRA on w13 (2 slices) and w2 (1 slice): [M, H] float32.

    c1 = W13[e] x_t + LoRA13 (no routing weight);  h = silu(gate) * up;
    c3 = w_tj * (W2[e] h + LoRA2 h);  y_t = sum_j c3[t, j].
    """
    E, H, I = _check_layer(x, topk_ids, w13, w2)
    M, k = topk_ids.shape
    experts = topk_ids.reshape(-1).long()                                       # [M*k]
    xs = x.float().repeat_interleave(k, dim=0)                                  # [M*k, H]
    c1 = torch.zeros(M * k, 2 * I, dtype=torch.float32, device=x.device)
    for e in torch.unique(experts).tolist():                                    # grouped base GEMM
        sel = experts == e
        c1[sel] = xs[sel] @ w13[e].float().T
    c1 += moe_lora_reference(x, topk_ids, topk_weights, token_lora, w13_lora_a, w13_lora_b).view(M * k, 2 * I)
    h = F.silu(c1[:, :I]) * c1[:, I:]                                           # [M*k, I]
    c3 = torch.zeros(M * k, H, dtype=torch.float32, device=x.device)
    for e in torch.unique(experts).tolist():
        sel = experts == e
        c3[sel] = h[sel] @ w2[e].float().T
    c3 = c3 * topk_weights.reshape(-1, 1).float()
    c3 += moe_lora_reference(h, topk_ids, topk_weights, token_lora, w2_lora_a, w2_lora_b,
                             mul_routed_weight=True).view(M * k, H)
    return c3.view(M, k, H).sum(dim=1)
