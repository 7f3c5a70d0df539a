"""The device-side routing metadata equals the PyTorch spec exactly."""
import pytest
import torch

from moelora_lab import rules
from moelora_lab.routing import device as align
from moelora_lab.routing.device import block_list_device
from moelora_lab.routing import block_list
from utils import STRIDED_KINDS, strided


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


@pytest.mark.parametrize("recount_max_pairs", [0, 1 << 20])
def test_device_blocks_many_chunks_and_edge_cases(device, monkeypatch, recount_max_pairs):
    # 2400 pairs in the three-launch construction (19 chunks) or the recount (75); one hot (adapter, expert)
    monkeypatch.setattr(rules, "SORT_MAX_PAIRS", 0)
    monkeypatch.setattr(rules, "RECOUNT_MAX_PAIRS", recount_max_pairs)
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


@pytest.fixture(params=["one_launch", "recount", "three_launches", "three_launches_wide"])
def launches(request, monkeypatch):
    """Every construction: one program per list sorting in registers; one launch whose programs each
    count all pairs (histogram steps of a few pairs, so a chunk's start falls inside one); or count +
    scan + place (with the chunk size of few pairs, or the widest chunks, used for many pairs). Table
    programs of a few blocks, so there are several."""
    if request.param != "one_launch":
        monkeypatch.setattr(rules, "SORT_MAX_PAIRS", 0)
        monkeypatch.setattr(rules, "TABLE_BLOCKS", 8)
    if request.param == "recount":
        monkeypatch.setattr(rules, "RECOUNT_MAX_PAIRS", 1 << 30)
        monkeypatch.setattr(rules, "HIST_PAIRS", 64)              # chunk starts inside a step: partial steps
        monkeypatch.setattr(rules, "RECOUNT_SUB", 32)
    if request.param.startswith("three_launches"):
        monkeypatch.setattr(rules, "RECOUNT_MAX_PAIRS", 0)
        monkeypatch.setattr(rules, "SCAN_TILE", 128)               # the scan then takes several steps
    if request.param == "three_launches_wide":
        monkeypatch.setattr(align, "chunk_pairs", lambda n: rules.SUB)
    return request.param


def test_launch_rules():
    # chunks grow with the pairs and never past SUB; the sort gets more warps for more pairs
    pairs = (1, 4096, 4097, 8192, 8193, 16384, 16385, 1 << 20)
    sizes = [align.chunk_pairs(n) for n in pairs]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1] == rules.SUB
    warps = [align.count_warps(n) for n in pairs]              # fewer warps for wider chunks
    assert warps == sorted(warps, reverse=True) and warps[-1] >= 1
    assert align.sort_warps(8) <= align.sort_warps(rules.SORT_MAX_PAIRS)
    assert rules.SORT_MAX_PAIRS < rules.RECOUNT_MAX_PAIRS       # sort, then recount, then three launches
    assert rules.RECOUNT_MAX_PAIRS % rules.RECOUNT_SUB == 0 and rules.HIST_PAIRS & (rules.HIST_PAIRS - 1) == 0


@pytest.mark.parametrize("seed", range(3))
def test_two_lists_in_the_same_launches_equal_the_spec(device, seed, launches):
    # a layer's base list (by expert, its own block size) and LoRA list (by adapter and expert)
    ids, lora, E, L = random_routing(100 + seed, device)
    base_bs, lora_bs = (16, 64) if seed % 2 else (64, 16)
    base, by_adapter = align._block_tensors_device(ids, lora, E, [(None, base_bs), (L, lora_bs)])
    for a, b in zip(base, block_list(ids, torch.zeros_like(lora), E, 1, base_bs).tensors):
        assert torch.equal(a, b)
    for a, b in zip(by_adapter, block_list(ids, lora, E, L, lora_bs).tensors):
        assert torch.equal(a, b)


def test_int64_routing_and_a_hot_group(device, launches):
    # int64 ids (as torch.topk gives), one hot (adapter, expert) spanning chunks, tokens without
    # adapters; the sort in registers and the recount (every program counts every pair) are slow under the
    # interpreter, so they get fewer tokens (the recount's 800 pairs still span 13 histogram chunks)
    M = {"one_launch": 200, "recount": 400}.get(launches, 1200)
    g = torch.Generator().manual_seed(12)
    ids = torch.randint(0, 8, (M, 2), generator=g)
    ids[:, 1] = (ids[:, 0] + 1) % 8
    ids[M // 6: M * 3 // 4, 0] = 5
    lora = torch.randint(-1, 3, (M,), generator=g)
    ids, lora = ids.to(device), lora.to(device)
    for bs in (1, 16, 128):
        for a, b in zip(block_list_device(ids, lora, 8, 3, bs).tensors, block_list(ids, lora, 8, 3, bs).tensors):
            assert torch.equal(a, b)


@pytest.mark.parametrize("how", STRIDED_KINDS)
def test_strided_routing_equals_the_spec(device, launches, how):
    # views of the routing (a column of a wider tensor, every other element, transposed storage): the kernels
    # read pair p's ids at ptr + p, so the launcher hands them contiguous copies
    ids, lora, E, L = random_routing(7, device)
    ids_view, lora_view = strided(ids.long(), how), strided(lora, how)
    assert not ids_view.is_contiguous() and not lora_view.is_contiguous()
    for a, b in zip(block_list_device(ids_view, lora_view, E, L, 16).tensors, block_list(ids, lora, E, L, 16).tensors):
        assert torch.equal(a, b)


def test_more_than_two_lists_is_refused(device):
    ids, lora, E, L = random_routing(1, device)
    with pytest.raises(ValueError, match="at most two"):
        align._block_tensors_device(ids, lora, E, [(None, 16)] * 3)


@pytest.mark.parametrize("how", ["chained", "unchained", "recount"])
def test_launches_replayed_from_a_cuda_graph_follow_new_routing(device, monkeypatch, how):
    # the plan captured once and replayed on other routing in the same tensors (as a server does): the
    # three launches with and without chaining on the GPU (each kernel must see all of the one before
    # it), and the recount in one launch
    if device != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    monkeypatch.setattr(rules, "SORT_MAX_PAIRS", 0)
    monkeypatch.setattr(rules, "RECOUNT_MAX_PAIRS", 1 << 20 if how == "recount" else 0)
    monkeypatch.setattr(rules, "PDL", how == "chained")
    g = torch.Generator().manual_seed(21)
    M, E, k, L = 1500, 64, 6, 4
    routings = [(torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)]).to(torch.int32),
                 torch.randint(-1, L, (M,), generator=g).to(torch.int32)) for _ in range(3)]
    ids, lora = (t.to(device) for t in routings[0])
    lists = [(None, 64), (L, 16)]
    align._block_tensors_device(ids, lora, E, lists)                 # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        base, by_adapter = align._block_tensors_device(ids, lora, E, lists)
    for new_ids, new_lora in routings[1:]:
        ids.copy_(new_ids)
        lora.copy_(new_lora)
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(base, block_list(new_ids, torch.zeros_like(new_lora), E, 1, 64).tensors):
            assert torch.equal(a.cpu(), b)
        for a, b in zip(by_adapter, block_list(new_ids, new_lora, E, L, 16).tensors):
            assert torch.equal(a.cpu(), b)


def test_launches_chain_only_where_the_gpu_can(device, monkeypatch):
    dev = torch.device(device)
    if dev.type == "cpu":
        assert not align.chained_launches(dev)                       # no CUDA stream to chain on
    monkeypatch.setattr(rules, "PDL", False)
    assert not align.chained_launches(dev)


def test_construction_switches_the_rule_inside_and_restores_it(device):
    ids, lora, E, L = random_routing(3, device)
    want = block_list(ids, lora, E, L, 16).tensors
    def now():
        return rules.SORT_MAX_PAIRS, rules.RECOUNT_MAX_PAIRS, rules.PDL

    rule = now()
    for how in (dict(sort_max_pairs=0), dict(sort_max_pairs=1 << 20), dict(sort_max_pairs=0, recount_max_pairs=0),
                dict(recount_max_pairs=1 << 20), dict(chained=False)):
        with align.construction(**how):
            assert now() != rule
            got = block_list_device(ids, lora, E, L, 16).tensors
        assert all(torch.equal(a, b) for a, b in zip(got, want)) and now() == rule
    with pytest.raises(RuntimeError, match="inside"):
        with align.construction(sort_max_pairs=0):
            raise RuntimeError("inside")
    assert now() == rule
    for name in ("sort_max_pairs", "recount_max_pairs"):
        with pytest.raises(ValueError, match=name):
            with align.construction(**{name: -1}):
                pass
