"""The byte model of the op's backward (``profile.grad_traffic``): hand counts, what each design adds beyond the
floor, its workloads from a block list, the routing and counts, and its count against what the kernels load and
store under the interpreter (``exercises.count_memory``)."""
from __future__ import annotations

import pytest
import torch

from moelora_lab.exercises import count_memory
from moelora_lab.op import dispatch, grad_paths
from moelora_lab.op.grad import moe_lora_backward
from moelora_lab.profile import GRAD_TRAFFIC_PATHS, GradWorkload, grad_op_traffic, grad_tiles
from moelora_lab.routing import block_list, naive_block_list
from moelora_lab.tiles import KernelConfig

# K 64, N 32, S 2, R 16, c 2 B, a 4 B; GPU tiles BN = BK = 64, BR = 16
DIMS = dict(in_features=64, out_features=32, num_slices=2, rank=16)


@pytest.fixture
def wl():
    # M 16 tokens, k 2: P 32 pairs, all of adapter 0: group (0, 0) 20 pairs in 2 blocks of 16, (0, 1) 12 in 1
    return GradWorkload.from_counts([[20, 12]], num_tokens=16, top_k=2, block_size=16)


def test_hand_count_floor(wl):
    t = grad_op_traffic("one_shot", wl, **DIMS)
    floor = dict(t.floor.parts)
    assert floor["x"] == 16 * 64 * 2 == 2048                       # X = 32 / k = 16 token rows
    assert floor["grad_out"] == 32 * 2 * 32 * 2 == 4096            # P_v S N c
    assert floor["lora_a"] == 2 * 2 * 16 * 64 * 2 == 8192          # S, 2 groups, r K c
    assert floor["lora_b"] == 2 * 2 * 32 * 16 * 2 == 4096
    assert floor["dx"] == 16 * 64 * 4 == 4096                      # [M, K] fp32
    assert floor["da"] == 2 * 1 * 2 * 16 * 64 * 4 == 16384         # S L E R K a: every element
    assert floor["db"] == 2 * 1 * 2 * 32 * 16 * 4 == 8192
    assert "dw" not in floor and "topk_weights" not in floor       # no routing weight
    assert t.floor.bytes == 47104 and t.floor.bytes_written == 4096 + 16384 + 8192


def test_hand_count_each_path(wl):
    dx = dict(dx_rows_zero=32 * 64 * 4, dx_rmw_read=32 * 64 * 4, dx_rmw_write=32 * 64 * 4, dx_rows_sum=32 * 64 * 4)
    two = grad_op_traffic("two_kernel", wl, **DIMS)
    # x and dY read once more by the weight kernel; T, dT: S P r c = 2*32*16*2 = 2048 written, read back
    # ⌈N/BN⌉ = 1 and ⌈K/BK⌉ = 1 times; dx: 8192 zeroed, read, written (one rank tile), summed over k
    assert two.extra_parts() == dict(x=2048, grad_out=4096, t_write=2048, dt_write=2048, t_read=2048, dt_read=2048,
                                     **dx)
    assert two.extra == 47104 and two.total.launches == 2
    one = grad_op_traffic("one_shot", wl, **DIMS)
    # group (0, 0): one block after its first: per slice its dA slab 16*64*4 = 4096, dB 32*16*4 = 2048
    assert one.extra_parts() == dict(da_rmw_read=8192, da_rmw_write=8192, db_rmw_read=4096, db_rmw_write=4096, **dx)
    assert one.extra == 57344 and one.total.launches == 1
    atomic = grad_op_traffic("one_shot_atomic", wl, **DIMS)
    # 3 blocks, each one atomic read-modify-write of its group's slabs: 3 * 2 * 4096 = 24576, 3 * 2 * 2048 = 12288
    assert atomic.extra_parts() == dict(da_rmw_read=24576, da_rmw_write=24576, db_rmw_read=12288,
                                        db_rmw_write=12288, **dx)
    # FLOPs: 2 S Σ P_g r (3K + 2N) = 2*2*32*16*(192 + 64); the floor recomputes nothing: 4*2*32*16*96
    assert two.total.flops == atomic.total.flops == 524288 and two.floor.flops == 393216


@pytest.mark.parametrize("path", GRAD_TRAFFIC_PATHS)
def test_dx_rows_drops_the_ops_own_buffer_not_the_kernels_rows(wl, path):
    own, given = (grad_op_traffic(path, wl, **DIMS, dx_rows=d) for d in (False, True))
    assert given.floor == own.floor
    # the caller's rows: no [P, K] fp32 zeroing or sum over k, no dx [M, K] write; the kernels' RMW stays
    assert own.total.bytes - given.total.bytes == 2 * 32 * 64 * 4 + 16 * 64 * 4
    assert given.total.part("dx_rmw_write") == own.total.part("dx_rmw_write") == 32 * 64 * 4
    assert given.total.part("dx_rows_zero") == given.total.part("dx") == 0
    with pytest.raises(TypeError, match="dx_rows"):
        grad_op_traffic(path, wl, **DIMS, dx_rows="yes")


def test_hand_count_pair_rows_weights_and_ranks():
    # L 2, E 2, M 4, k 2: adapter 0 on groups (0, 0) 3 pairs, (0, 1) 1; adapter 1 (rank 0) on (1, 1) 2; 2 pairs none
    wl = GradWorkload.from_counts([[3, 1], [0, 2]], num_tokens=4, top_k=2, block_size=16)
    t = grad_op_traffic("two_kernel", wl, **DIMS, x_rows="pair", mul_routed_weight=True, lora_ranks=[16, 0])
    parts = dict(t.total.parts)
    assert parts["x"] == 2 * 4 * 64 * 2                  # P_v = 4 pair rows of slot 0, read by both kernels
    assert parts["topk_weights"] == (6 + 4) * 4          # the rank kernel reads P_u = 6, the dB walk P_v = 4
    assert parts["dw_rmw_read"] == 6 * 4 and parts["dw"] == 8 * 4      # every used pair; dw [P] zeroed
    assert parts["dx"] == 8 * 64 * 4 and "dx_rows_sum" not in parts    # pair rows: no sum over k
    assert parts["t_write"] == 2 * 4 * 16 * 2            # rank-0 pairs have no T
    assert parts["lora_a"] == 2 * 2 * 16 * 64 * 2        # 2 touched groups of slot 0; slot 1 reads none
    assert dict(t.floor.parts)["da"] == 2 * 2 * 2 * 16 * 64 * 4        # zeros of slot 1 included


def test_one_shot_adds_nothing_but_dx_when_every_group_has_one_block():
    wl = GradWorkload.from_counts([[16, 9, 1, 0], [4, 0, 2, 12]], num_tokens=22, top_k=2, block_size=16)
    dx_only = {"dx_rows_zero", "dx_rmw_read", "dx_rmw_write", "dx_rows_sum"}
    paths = {p: grad_op_traffic(p, wl, **DIMS) for p in GRAD_TRAFFIC_PATHS}
    assert {n for n, b in paths["one_shot"].extra_parts().items() if b} == dx_only
    assert paths["one_shot"].extra < paths["two_kernel"].extra
    # atomics: one read-modify-write of each touched group's slabs more (6 groups, 2 slices, R (K + N) a)
    slab = 6 * 2 * 16 * (64 + 32) * 4
    assert paths["one_shot_atomic"].extra - paths["one_shot"].extra == 2 * slab
    assert len({p.floor for p in paths.values()}) == 1


def test_one_shot_slabs_grow_with_blocks_two_kernel_with_rank():
    one = [grad_op_traffic("one_shot", GradWorkload.from_counts([[16 * n]], num_tokens=8 * n, top_k=2,
                                                                block_size=16), **DIMS) for n in (1, 2, 5)]
    slab = 2 * 16 * (64 + 32) * 4                          # S R (K + N) a, read and written per extra block
    assert [o.total.part("da_rmw_read") + o.total.part("db_rmw_read") for o in one] == [0, slab, 4 * slab]
    wl = GradWorkload.from_counts([[40, 3], [7, 0]], num_tokens=25, top_k=2, block_size=32)
    extra = [grad_op_traffic("two_kernel", wl, **(DIMS | dict(rank=r))).extra for r in (16, 32, 64, 128)]
    assert extra == sorted(set(extra))                     # strictly growing
    t16, t64 = (grad_op_traffic("two_kernel", wl, **(DIMS | dict(rank=r))).total for r in (16, 64))
    assert t64.part("t_read") == 4 * t16.part("t_read") and t64.part("dt_write") == 4 * t16.part("dt_write")


def test_workload_from_blocks_routing_and_counts_agree():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 5, (40, 3), generator=g, dtype=torch.int32)
    lora = torch.randint(-1, 3, (40,), generator=g, dtype=torch.int32)
    wl = GradWorkload.from_routing(ids, lora, 5, 3, 16)
    assert GradWorkload.from_blocks(block_list(ids, lora, 5, 3, 16)) == wl
    assert wl.pairs_with_adapter == 3 * int((lora >= 0).sum())
    naive = GradWorkload.from_blocks(naive_block_list(ids, lora, 5, 3, 16))
    assert naive.group_pairs == wl.group_pairs and naive.group_blocks == naive.group_pairs
    t = grad_op_traffic("one_shot", naive, **DIMS)            # a block per pair: n_g - 1 slab round trips per group
    rows = sum(p - 1 for p in wl.group_pairs if p)
    assert t.total.part("da_rmw_read") == 2 * rows * 16 * 64 * 4


def test_grad_tiles_follow_the_launcher(monkeypatch):
    M, k, L, E, R, K, N = 4, 2, 2, 3, 48, 40, 24
    ids, lora = torch.randint(0, E, (M, k), dtype=torch.int32), torch.zeros(M, dtype=torch.int32)
    a, b, blocks = [torch.zeros(L, E, R, K)] * 2, [torch.zeros(L, E, N, R)] * 2, block_list(ids, lora, E, L, 16)
    call = grad_paths.GradCall(torch.zeros(M, K), ids, None, lora, a, b, torch.zeros(M * k, 2 * N), blocks, None,
                               None, False, frozenset({"x", "lora_a", "lora_b"}), None)
    for module in (dispatch, grad_paths):                  # the interpreter's branch, whatever runs the test
        monkeypatch.setattr(module, "INTERPRET", True)
    cfg, block_r, *_ = grad_paths._launch_args(call)
    assert grad_tiles(R, interpreter=True) == (cfg.block_n, cfg.block_k, block_r)
    for module in (dispatch, grad_paths):                  # the GPU branch, reached on the CPU
        monkeypatch.setattr(module, "INTERPRET", False)
    cfg, block_r, *_ = grad_paths._launch_args(call)
    assert grad_tiles(R) == (cfg.block_n, cfg.block_k, block_r) == (64, 64, 64)
    assert grad_tiles(R, config=KernelConfig(block_n=32, max_block_r=16)) == (32, 64, 16)


def test_errors(wl):
    with pytest.raises(ValueError, match="^path: 'reference' .* not modelled"):
        grad_op_traffic("reference", wl, **DIMS)
    with pytest.raises(ValueError, match="^path: 'fused'"):
        grad_op_traffic("fused", wl, **DIMS)
    with pytest.raises(TypeError, match="^workload: expected a GradWorkload"):
        grad_op_traffic("one_shot", None, **DIMS)
    with pytest.raises(ValueError, match=r"^lora_ranks: expected 1 ranks"):
        grad_op_traffic("one_shot", wl, **DIMS, lora_ranks=[16, 16])
    with pytest.raises(ValueError, match="^x_rows"):
        grad_op_traffic("one_shot", wl, **DIMS, x_rows="row")
    with pytest.raises(ValueError, match=r"^workload: 3 pairs .* multiple of top_k"):
        grad_op_traffic("one_shot", GradWorkload.from_counts([[3]], num_tokens=2, top_k=2, block_size=16), **DIMS)
    with pytest.raises(ValueError, match=r"^pairs_per_group: expected \[L, E\] ints"):
        GradWorkload.from_counts([1, 2], num_tokens=2, top_k=1, block_size=16)
    with pytest.raises(ValueError, match=r"^group_blocks\[0\]: must be >= 2"):
        GradWorkload(16, 2, 1, 1, 16, (20,), (1,))
    with pytest.raises(TypeError, match="^blocks: expected a BlockList"):
        GradWorkload.from_blocks(None)


# ---- the model against the loads and stores of the kernels, under the interpreter

RANK_ARGS = ("x", "lora_a", "lora_a", "lora_b", "lora_b", "grad_out", "topk_weights", "t", "dx", "dw")
WEIGHT_ARGS = ("x", "grad_out", "topk_weights", "t", "da", "db")
ONE_SHOT_ARGS = ("x", "lora_a", "lora_a", "lora_b", "lora_b", "grad_out", "topk_weights", "dx", "dw", "da", "db")


def counted(kernel, names, books, mul):
    """``kernel`` whose every launch runs under its own count_memory, its tensor arguments named by position."""
    class Launch:
        def __getitem__(self, grid):
            def run(*args, **meta):
                named = {}
                for name, t in zip(names, args):
                    if name == "t":                        # [2, NS, P, r]: T, then dT
                        named |= dict(t=t[0], dt=t[1]) if t.dim() == 4 else {}
                    elif (name != "topk_weights" or mul) and not any(t is u for u in named.values()):
                        named[name + ".1" * (name in named)] = t     # a second slice's A or B: summed by tally
                with count_memory(**named) as mem:
                    kernel[grid](*args, **meta)
                books.append(mem)
            return run
    return Launch()


def tally(books) -> dict:
    """name:u distinct bytes loaded (summed over kernels), name:ld bytes loaded, name:st bytes stored."""
    out = {}
    for mem in books:
        for n in mem.names:
            base = n.split(".")[0]
            for kind, v in (("u", mem.unique_loaded(n)), ("ld", mem.loaded(n)), ("st", mem.stored(n))):
                out[f"{base}:{kind}"] = out.get(f"{base}:{kind}", 0) + v
    return out


def kernel_view(t, path) -> dict:
    """What the kernels must show of the model: inputs as distinct bytes per kernel (the caches serve repeats),
    the rest as asked. dx's zeroing and sum over k, dw's zeroing and the atomic path's zeroed dA, dB are the
    launcher's PyTorch ops (op/grad_paths.py ``_buffers``, ``_grads``), outside what the interpreter counts."""
    parts = dict(t.total.parts)
    want = {f"{n}:u": parts.get(n, 0) for n in ("x", "grad_out", "lora_a", "lora_b", "topk_weights")}
    for n in ("t", "dt", "dx", "dw", "da", "db"):
        want[f"{n}:ld"] = parts.get(f"{n}_read", 0) + parts.get(f"{n}_rmw_read", 0)
        kernel_writes = n in ("da", "db") and path != "one_shot_atomic"
        written = parts.get(f"{n}_write", 0) + parts.get(f"{n}_rmw_write", 0)
        want[f"{n}:st"] = written + (parts[n] if kernel_writes else 0)
    return want


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts the kernels' loads and stores under the interpreter "
                                                     "(CPU tensors); the GPU suite checks the kernels' results")
@pytest.mark.parametrize("path", GRAD_TRAFFIC_PATHS)
@pytest.mark.parametrize("pair_rows", [False, True], ids=["token_rows", "pair_rows"])
def test_model_matches_what_the_kernels_load_and_store(monkeypatch, path, pair_rows):
    # M 22, k 2, E 3, L 3 (ranks 32, 16, 0), R 32, K 48, N 32: tokens 0-17 on adapter 0 (experts 0, 1: groups of
    # 18 pairs, 2 blocks each), 18-19 on adapter 1, 20 on the rank-0 slot, 21 none; tiles 16 (2 rank tiles
    # for slot 0, one for slot 1 whose other rank tile the one-shot kernel zero-fills)
    M, k, E, L, R, K, N = 22, 2, 3, 3, 32, 48, 32
    S, mul = (1, True) if pair_rows else (2, False)
    g = torch.Generator().manual_seed(1)
    ids = torch.tensor([[0, 1]] * 18 + [[2, 1]] * 2 + [[0, 2], [1, 2]], dtype=torch.int32)
    lora = torch.tensor([0] * 18 + [1, 1, 2, -1], dtype=torch.int32)
    ranks = torch.tensor([32, 16, 0], dtype=torch.int32)
    x = torch.randn(M * k if pair_rows else M, K, generator=g)
    a = [torch.randn(L, E, R, K, generator=g) for _ in range(S)]
    b = [torch.randn(L, E, N, R, generator=g) for _ in range(S)]
    cfg = KernelConfig(block_m=16, block_n=16, block_k=16, max_block_r=16)
    books = []
    for name, args in (("grad_rank_kernel", RANK_ARGS), ("grad_weight_kernel", WEIGHT_ARGS),
                       ("grad_one_shot_kernel", ONE_SHOT_ARGS)):
        monkeypatch.setattr(grad_paths, name, counted(getattr(grad_paths, name), args, books, mul))
    blocks = block_list(ids, lora, E, L, 16)
    moe_lora_backward(x, ids, torch.rand(M, k, generator=g), lora, a, b, torch.randn(M, k, S * N, generator=g),
                      mul_routed_weight=mul, lora_ranks=ranks, path=path, blocks=blocks, config=cfg)
    model = grad_op_traffic(path, GradWorkload.from_blocks(blocks), in_features=K, out_features=N, num_slices=S,
                            rank=R, x_rows="pair" if pair_rows else "token", dtype_bytes=4,
                            mul_routed_weight=mul, lora_ranks=ranks, config=cfg)
    assert len(books) == (2 if path == "two_kernel" else 1)
    got, want = tally(books), kernel_view(model, path)
    assert {n: got.get(n, 0) for n in want} == want
    assert model.total.part("da_rmw_read") > 0 or path == "two_kernel"      # the case has extra blocks
    if path != "one_shot_atomic":                                            # every element of dA, dB stored
        assert [mem.unique_stored(n) for mem in books for n in ("da", "db") if n in mem.names] \
            == [S * L * E * R * K * 4, S * L * E * N * R * 4]
