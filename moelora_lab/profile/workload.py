"""The counts that decide what one MoE-LoRA call moves (the byte model's input, ``traffic``): expected under
uniform random routing (``Workload.dense``) or counted from one routing (``count_workload``).

Shape legend: M tokens, E experts, k top-k, L adapters; pair = (token, slot).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..validate import INDEX_DTYPES, check_int, check_range, check_tensor


def _expected_distinct(bins: int, draws: int) -> int:
    """Expected number of distinct bins hit by ``draws`` uniform draws: n*(1-(1-1/n)^d), rounded."""
    if bins == 0 or draws == 0:
        return 0
    return round(bins * (1.0 - (1.0 - 1.0 / bins) ** draws))


@dataclass(frozen=True)
class Workload:
    """Counts that decide the traffic of one MoE-LoRA call.

    num_tokens: M. top_k: k. tokens_with_adapter: tokens t with token_lora[t] >= 0.
    pairs_with_adapter: P, the (token, slot) pairs of those tokens.
    touched_adapter_experts: distinct (adapter, expert) with at least one pair.
    touched_experts: distinct experts with at least one pair, with an adapter or without.
    """

    num_tokens: int
    top_k: int
    tokens_with_adapter: int
    pairs_with_adapter: int
    touched_adapter_experts: int
    touched_experts: int

    def __post_init__(self) -> None:
        m = check_int("num_tokens", self.num_tokens, low=0)
        k = check_int("top_k", self.top_k, low=1)
        check_int("tokens_with_adapter", self.tokens_with_adapter, low=0, high=m)
        p = check_int("pairs_with_adapter", self.pairs_with_adapter, low=0, high=self.tokens_with_adapter * k)
        check_int("touched_adapter_experts", self.touched_adapter_experts, low=0, high=p)
        check_int("touched_experts", self.touched_experts, low=0, high=m * k)

    @classmethod
    def dense(cls, num_tokens: int, top_k: int, num_experts: int, num_loras: int) -> "Workload":
        """*Expected* counts under uniform random routing and uniformly random adapters.

        Every token has an adapter, so tokens_with_adapter = M and pairs_with_adapter = M*k.
        With d = M*k draws, touched_experts = E*(1-(1-1/E)^d) and touched_adapter_experts =
        E*L*(1-(1-1/(E*L))^d), each rounded to the nearest int (the expected number of distinct
        bins; slots of one token are treated as independent draws).
        """
        m = check_int("num_tokens", num_tokens, low=0)
        e = check_int("num_experts", num_experts, low=1)
        k = check_int("top_k", top_k, low=1, high=e)
        n_loras = check_int("num_loras", num_loras, low=1)
        draws = m * k
        return cls(num_tokens=m, top_k=k, tokens_with_adapter=m, pairs_with_adapter=draws,
                   touched_adapter_experts=_expected_distinct(e * n_loras, draws),
                   touched_experts=_expected_distinct(e, draws))


def count_workload(topk_ids: torch.Tensor, token_lora: torch.Tensor, num_experts: int, num_loras: int) -> Workload:
    """*Counted* (exact) workload of one routing: topk_ids [M, k] in 0..E-1, token_lora [M] in -1..L-1.

    A token with token_lora == -1 has no adapter: its pairs count for touched_experts only.
    """
    e = check_int("num_experts", num_experts, low=1)
    n_loras = check_int("num_loras", num_loras, low=1)
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=INDEX_DTYPES, legend="[M, k]")
    m, k = topk_ids.shape
    check_int("top_k (topk_ids.shape[1])", k, low=1)
    check_tensor("token_lora", token_lora, dtypes=INDEX_DTYPES, shape=(m,), legend="[M]", device=topk_ids.device)
    check_range("topk_ids", topk_ids, 0, e, "expert ids")
    check_range("token_lora", token_lora, -1, n_loras, "adapter ids, -1 for none")
    ids = topk_ids.long()
    has = token_lora.long() >= 0
    keys = token_lora.long()[has].unsqueeze(1) * e + ids[has]
    n_tokens = int(has.sum())
    return Workload(num_tokens=m, top_k=k, tokens_with_adapter=n_tokens, pairs_with_adapter=n_tokens * k,
                    touched_adapter_experts=int(torch.unique(keys).numel()),
                    touched_experts=int(torch.unique(ids).numel()))
