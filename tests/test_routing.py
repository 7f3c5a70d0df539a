import pytest
import torch

from moelora_lab import align_block_size, route, use_naive_assignment
from moelora_lab.routing import align_block_size_loop, padded_row_length


def test_route_softmax_topk_renormalized():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 3.5]])
    w, ids = route(logits, 2)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert ids.tolist() == [[1, 2], [3, 0]]
    e = torch.exp(torch.tensor([2.0, 1.0]))
    assert torch.allclose(w[0], e / e.sum())
    w_raw, _ = route(logits, 2, renormalize=False)
    assert torch.allclose(w_raw[0], torch.softmax(logits[0], 0)[[1, 2]])


def test_hand_example():
    # 3 tokens, k=2, E=4, L=2, block 2. Token 0 -> adapter 1, token 1 -> none, token 2 -> adapter 1.
    topk_ids = torch.tensor([[2, 0], [1, 2], [2, 3]], dtype=torch.int32)
    token_lora = torch.tensor([1, -1, 1], dtype=torch.int32)
    al = align_block_size(topk_ids, token_lora, num_experts=4, num_loras=2, block_size=2)
    S = 6  # sentinel M*k
    # adapter 1: expert 0 <- pair 1; expert 2 <- pairs 0, 4; expert 3 <- pair 5
    assert padded_row_length(6, 4, 2) == 10 and al.sorted_token_ids.shape == (2, 10)
    assert al.sorted_token_ids[1].tolist() == [1, S, 0, 4, 5, S, S, S, S, S]
    assert al.expert_ids[1].tolist() == [0, 2, 3, -1, -1]
    assert al.sorted_token_ids[0].tolist() == [S] * 10 and al.expert_ids[0].tolist() == [-1] * 5
    assert al.num_tokens_post_padded.tolist() == [0, 6]
    assert al.block_size == 2
    assert al.padding_waste(6) == pytest.approx(2 / 6)


@pytest.mark.parametrize("seed", range(12))
def test_alignment_invariants_randomized(seed):
    g = torch.Generator().manual_seed(seed)
    M = int(torch.randint(1, 40, (1,), generator=g))
    E = int(torch.randint(1, 12, (1,), generator=g))
    k = int(torch.randint(1, E + 1, (1,), generator=g))
    L = int(torch.randint(1, 5, (1,), generator=g))
    bs = int(torch.tensor([1, 2, 3, 4, 8, 16])[torch.randint(0, 6, (1,), generator=g)])
    topk_ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)]).to(torch.int32)
    token_lora = torch.randint(-1, L - 1 if L > 1 else 0, (M,), generator=g).to(torch.int32)  # last slot unused
    al = align_block_size(topk_ids, token_lora, E, L, bs)
    n = M * k
    sid, eid, ntpp = al
    assert sid.shape[1] % bs == 0 and eid.shape == (L, sid.shape[1] // bs)
    seen = {}
    for l in range(L):
        row, blocks, total = sid[l].tolist(), eid[l].tolist(), int(ntpp[l])
        assert total % bs == 0
        assert all(v == n for v in row[total:]) and all(b == -1 for b in blocks[total // bs:])
        experts = blocks[: total // bs]
        assert experts == sorted(experts) and -1 not in experts           # experts ascending
        for b, e in enumerate(experts):
            pairs = [p for p in row[b * bs:(b + 1) * bs] if p < n]
            assert pairs == sorted(pairs)
            for p in pairs:
                assert token_lora[p // k] == l and topk_ids[p // k, p % k] == e  # right row, right segment
                assert p not in seen
                seen[p] = l
    expect = {t * k + j for t in range(M) for j in range(k) if token_lora[t] >= 0}
    assert set(seen) == expect                                           # every valid pair exactly once
    assert int(ntpp[L - 1]) == 0 and torch.all(sid[L - 1] == n)          # unused adapter row is empty
    loop = align_block_size_loop(topk_ids, token_lora, E, L, bs)
    assert all(torch.equal(a, b) for a, b in zip(al, loop))


def test_alignment_int64_inputs_and_empty():
    topk = torch.zeros(2, 1, dtype=torch.int64)
    al = align_block_size(topk, torch.tensor([-1, -1]), 4, 3, 4)
    assert al.num_tokens_post_padded.tolist() == [0, 0, 0]
    assert al.padding_waste(2) == 0.0


def test_naive_rule():
    assert use_naive_assignment(num_pairs=8, num_experts=64, num_loras=1)          # 64 <= 64
    assert not use_naive_assignment(num_pairs=9, num_experts=64, num_loras=1)
    assert use_naive_assignment(num_pairs=64, num_experts=128, num_loras=4)        # qwen3 M=8, L=4


@pytest.mark.parametrize("call, exc, match", [
    (lambda: route(torch.zeros(3), 1), ValueError, "router_logits: expected a 2-D tensor \\[M, E\\]"),
    (lambda: route(torch.zeros(3, 4), 5), ValueError, "top_k: must be <= 4"),
    (lambda: route(torch.zeros(3, 4, dtype=torch.int32), 1), TypeError, "router_logits: dtype torch.int32"),
    (lambda: align_block_size(torch.zeros(2, 2, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), 4, 2, 4),
     ValueError, "token_lora: expected shape \\(2,\\)"),
    (lambda: align_block_size(torch.full((2, 2), 4, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), 4, 2, 4),
     ValueError, "topk_ids: value 4 is out of range; accepted values are 0 .. 3"),
    (lambda: align_block_size(torch.zeros(2, 2, dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32), 4, 2, 4),
     ValueError, "token_lora: value 2 is out of range; accepted values are -1 .. 1"),
    (lambda: align_block_size(torch.zeros(2, 2, dtype=torch.float32), torch.zeros(2, dtype=torch.int32), 4, 2, 4),
     TypeError, "topk_ids: dtype torch.float32 is not supported; use one of int32, int64"),
    (lambda: align_block_size(torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), 4, 2, 0),
     ValueError, "block_size: must be >= 1, got 0"),
    (lambda: align_block_size([[0]], torch.zeros(1, dtype=torch.int32), 4, 2, 4),
     TypeError, "topk_ids: expected a torch.Tensor"),
])
def test_validation_messages(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
