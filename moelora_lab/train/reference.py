"""The spec of the backward: the gradients of the LoRA op, written out in PyTorch.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, K in, N out, S slices;
pair p = t*k + j; P = M*k pairs.

The forward (``moelora_lab.moe_lora_reference``) gives each pair p with an adapter l and expert e

    T_s  = A_s[l, e] x_p                         [r]    the rank intermediate of slice s
    out_p[s] = w_p? * B_s[l, e] T_s              [N]    (w_p only with mul_routed_weight)

so, with G = dL/dout_p[s] and dY = w_p? * G,

    dB_s[l, e] += dY T_sᵀ        [N, r]     dT_s = B_s[l, e]ᵀ dY          [r]
    dA_s[l, e] += dT_s x_pᵀ      [r, K]     dx_p += A_s[l, e]ᵀ dT_s       [K]
    dw_p       += G · (B_s T_s) = (B_sᵀ G) · T_s                           (mul_routed_weight only)

Two rank intermediates: T (forward's, recomputed here) and dT. Tokens without an adapter, disabled
slots, ranks past ``lora_ranks`` and experts no pair of a slot reaches get exactly zero gradient.
Token rows (x [M, K], every slot reads its token's row) sum dx over the token's k pairs.

:func:`moe_lora_backward_reference` groups the pairs by (adapter, expert), one matmul per group, in
float32 (float64 stays float64), the way ``moe_lora_reference`` computes the forward. Tests check it
against torch autograd of the forward spec.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..validate import SPEC_DTYPES, check_op_inputs


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


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


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
    acc = _acc_dtype(x)
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
