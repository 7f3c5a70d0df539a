"""The spec: naive PyTorch MoE-LoRA, accumulating in float32 (float64 inputs: in float64).

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, K in, N out, S slices,
H hidden, I expert intermediate; pair p = t*k + j.

Every kernel in the lab is checked against these functions. Each comes twice: a ``*_loop``
version to read line by line, and a vectorized version (grouped by (adapter, expert), one
matmul per group) fast enough for real presets on a CPU. Tests check that the two agree.
"""
from __future__ import annotations

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


def moe_layer_reference(x, topk_ids, topk_weights, token_lora, w13, w2,
                        w13_lora_a, w13_lora_b, w2_lora_a, w2_lora_b):
    """The whole MoE layer with LoRA on w13 (2 slices) and w2 (1 slice): [M, H] float32.

    c1 = W13[e] x_t + LoRA13 (no routing weight);  h = silu(gate) * up;
    c3 = w_tj * (W2[e] h + LoRA2 h);  y_t = sum_j c3[t, j].
    """
    E, H, I = check_layer_base(x, topk_ids, w13, w2, dtypes=SPEC_DTYPES)
    acc = _acc(x)
    M, k = topk_ids.shape
    experts = topk_ids.reshape(-1).long()                                       # [M*k]
    xs = x.to(acc).repeat_interleave(k, dim=0)                                  # [M*k, H]
    c1 = torch.zeros(M * k, 2 * I, dtype=acc, device=x.device)
    for e in torch.unique(experts).tolist():                                    # grouped base GEMM
        sel = experts == e
        c1[sel] = xs[sel] @ w13[e].to(acc).T
    c1 += moe_lora_reference(x, topk_ids, topk_weights, token_lora, w13_lora_a, w13_lora_b).view(M * k, 2 * I)
    h = F.silu(c1[:, :I]) * c1[:, I:]                                           # [M*k, I]
    c3 = torch.zeros(M * k, H, dtype=acc, device=x.device)
    for e in torch.unique(experts).tolist():
        sel = experts == e
        c3[sel] = h[sel] @ w2[e].to(acc).T
    c3 = c3 * topk_weights.reshape(-1, 1).to(acc)
    c3 += moe_lora_reference(h, topk_ids, topk_weights, token_lora, w2_lora_a, w2_lora_b,
                             mul_routed_weight=True).view(M * k, H)
    return c3.view(M, k, H).sum(dim=1)
