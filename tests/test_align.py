"""The device-side routing metadata equals the PyTorch spec exactly."""
import pytest
import torch

from moelora_lab.align import block_list_device
from moelora_lab.routing import block_list


def random_routing(seed, device):
    g = torch.Generator().manual_seed(seed)
    M = int(torch.randint(1, 300, (1,), generator=g))
    E = int(torch.randint(1, 40, (1,), generator=g))
    k = int(torch.randint(1, min(E, 8) + 1, (1,), generator=g))
    L = int(torch.randint(1, 5, (1,), generator=g))
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)]).to(torch.int32)
    lora = torch.randint(-1, L, (M,), generator=g).to(torch.int32)
    return ids.to(device), lora.to(device), E, L


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_size", [16, 64])
def test_device_blocks_equal_the_spec(device, seed, block_size):
    ids, lora, E, L = random_routing(seed, device)
    want = block_list(ids, lora, E, L, block_size)
    got = block_list_device(ids, lora, E, L, block_size)
    for a, b in zip(got.tensors, want.tensors):
        assert torch.equal(a, b)


def test_device_blocks_many_chunks_and_edge_cases(device):
    # 2400 pairs: several chunks and several scatter steps per chunk; one hot (adapter, expert)
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 8, (1200, 2), generator=g).to(torch.int32)
    ids[:, 1] = (ids[:, 0] + 1) % 8
    ids[:600, 0] = 3
    lora = torch.randint(-1, 3, (1200,), generator=g).to(torch.int32)
    ids, lora = ids.to(device), lora.to(device)
    for a, b in zip(block_list_device(ids, lora, 8, 3, 16).tensors, block_list(ids, lora, 8, 3, 16).tensors):
        assert torch.equal(a, b)
    none = torch.full((5,), -1, dtype=torch.int32, device=device)
    got = block_list_device(ids[:5], none, 8, 3, 16)
    assert torch.all(got.block_lora == -1) and torch.all(got.sorted_pairs == 10)
