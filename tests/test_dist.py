"""moelora_lab.dist on the CPU: the distributed layers in 2 and 4 gloo processes against the
single-process layer and the spec, the partition, the sharding, the communication model, the launcher.

Each world size starts its processes once (``run_local`` of ``dist_workers.many``) and every test
reads its case's result; the kernels run in the Triton interpreter.
"""
from __future__ import annotations

import os
import moelora_lab  # noqa: F401  (must come before triton)

import pytest
import torch

import dist_workers
from moelora_lab.dist import ExpertPartition, ep_bytes, run_local, shard_tp, tp_bytes
from moelora_lab.dist.checks import default_case
from moelora_lab.dist.comm import META_BYTES, ep_bytes_uniform, pair_matrix, predict_us

FP32 = 1e-4

CASES_2 = {
    "ep": ("ep", default_case()),
    "ep_no_lora": ("ep", default_case(lora=False)),
    "ep_rank_without_tokens_other_gets_all": ("ep", default_case(tokens=[0, 7], hot_rank=1)),
    "ep_rank_receives_nothing": ("ep", default_case(tokens=[5, 5], hot_rank=0)),
    "ep_no_adapters": ("ep", default_case(no_adapter_fraction=1.0)),
    "ep_mixed_ranks_not_pow2": ("ep", default_case(rank=12, adapter_ranks=(12, 5))),
    "ep_two_micro_batches": ("ep", default_case(micro_batches=2, rank=12, adapter_ranks=(3, 12))),
    "tp_fully_sharded": ("tp", default_case(fully_sharded=True)),
    "tp_replicated_a": ("tp", default_case(fully_sharded=False)),
    "tp_fully_sharded_mixed_ranks": ("tp", default_case(fully_sharded=True, rank=12, adapter_ranks=(12, 5))),
    "tp_no_adapters": ("tp", default_case(fully_sharded=True, no_adapter_fraction=1.0)),
    "tp_no_lora": ("tp", default_case(lora=False)),
}
CASES_4 = {
    "ep": ("ep", default_case()),
    "ep_hot": ("ep", default_case(hot_rank=2, micro_batches=2)),
    "tp_fully_sharded": ("tp", default_case(fully_sharded=True, rank=8, adapter_ranks=(8, 3))),
    "tp_replicated_a": ("tp", default_case(fully_sharded=False)),
}


def _interpreter_only():
    if not moelora_lab.INTERPRET:
        pytest.skip("the gloo cases run the kernels on CPU tensors, under the Triton interpreter; on a GPU "
                    "python -m moelora_lab.dist.bench checks the NCCL layers")


@pytest.fixture(scope="module")
def results():
    _interpreter_only()
    return {2: _run(CASES_2, 2)}


@pytest.fixture(scope="module")
def results_4():
    """Four processes (make test-slow): on two cores they share them, the longest setup of the suite."""
    _interpreter_only()
    return _run(CASES_4, 4)


def _run(cases, world):
    per_rank = run_local(dist_workers.many, world, {name: case for name, case in cases.items()}, threads=1)
    return {name: [r[name] for r in per_rank] for name in cases}


def _assert_close(rows):
    for rank, r in enumerate(rows):
        assert r["finite"], f"rank {rank}: non-finite output"
        assert r["vs_layer"] <= FP32 and r["vs_spec"] <= FP32, f"rank {rank}: {r}"


@pytest.mark.parametrize("name", list(CASES_2))
def test_two_processes_match_the_single_process_layer(results, name):
    _assert_close(results[2][name])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES_4))
def test_four_processes_match_the_single_process_layer(results_4, name):
    _assert_close(results_4[name])


def test_uneven_loads_really_are_uneven(results):
    empty, full = results[2]["ep_rank_without_tokens_other_gets_all"]
    assert empty["rows"] == 0 and full["rows"] == 7
    assert empty["received"] == 0 and full["received"] == 7 * 2      # every pair goes to rank 1's experts
    home, idle = results[2]["ep_rank_receives_nothing"]
    assert idle["received"] == 0 and home["received"] == 10 * 2


@pytest.mark.slow
def test_a_hot_rank_of_four_receives_every_pair(results_4):
    assert [r["received"] for r in results_4["ep_hot"]] == [0, 0, 18 * 2, 0]


def test_tensor_parallel_ranks_agree_and_fully_sharded_holds_a_share(results):
    for name in ("tp_fully_sharded", "tp_replicated_a"):
        assert all(r["ranks_agree"] for r in results[2][name])
    full = results[2]["tp_fully_sharded"][0]["lora_bytes"]
    replicated = results[2]["tp_replicated_a"][0]["lora_bytes"]
    L, r, E, H, I = 2, 8, 8, 64, 32
    everything = L * E * r * (2 * H + 2 * I + I + H) * 4           # A and B of w13 (2 slices) and w2, fp32
    assert full == everything // 2
    assert replicated == everything // 2 + L * E * r * (2 * H + H) * 4 // 2   # w13 A and w2 B whole


def test_errors_are_named(results):   # (results: skips with the process cases)
    msgs = run_local(dist_workers.errors, 2)[0]
    assert "partition: made for 3 ranks" in msgs["partition"]
    assert "local: w13 holds" in msgs["local"]
    assert "counts: made for 1 micro-batch" in msgs["counts"]
    assert "local['w13_lora_a']" in msgs["tp_shards"]
    assert msgs["ids"].startswith("ranks 0, 1: topk_ids: value 107 is out of range; accepted values are 0 .. 7")


def test_partition_splits_unevenly_and_owns_every_expert():
    part = ExpertPartition(10, 4)
    assert part.bounds == [0, 2, 5, 7, 10]
    ids = torch.arange(10)
    assert part.owner(ids).tolist() == [0, 0, 1, 1, 1, 2, 2, 3, 3, 3]
    assert (ids - part.first(ids)).tolist() == [0, 1, 0, 1, 2, 0, 1, 0, 1, 2]
    w = dict(w13=torch.randn(10, 6, 4), w2=torch.randn(10, 4, 3), w13_lora_a=[torch.randn(2, 10, 2, 4)])
    local = part.shard(w, 1)
    assert local["w13"].shape[0] == 3 and torch.equal(local["w13_lora_a"][0], w["w13_lora_a"][0][:, 2:5])
    with pytest.raises(ValueError, match="world_size: 5 ranks for 4 experts"):
        ExpertPartition(4, 5)


def test_shard_tp_cuts_gate_and_up_and_keeps_b_packed():
    E, H, I, L, r = 2, 8, 6, 2, 4
    w13 = torch.arange(E * 2 * I * H, dtype=torch.float32).view(E, 2 * I, H)
    b = torch.randn(L, E, I, r).transpose(2, 3).contiguous().transpose(2, 3)        # N fastest
    weights = dict(w13=w13, w2=torch.randn(E, H, I), w13_lora_a=[torch.randn(L, E, r, H)] * 2,
                   w13_lora_b=[b, b], w2_lora_a=[torch.randn(L, E, r, I)], w2_lora_b=[torch.randn(L, E, H, r)])
    s = shard_tp(weights, 1, 2, fully_sharded=True)
    assert torch.equal(s["w13"], torch.cat([w13[:, 3:6], w13[:, 9:12]], 1))
    assert s["w13_lora_b"][0].stride(2) == 1 and torch.equal(s["w13_lora_b"][0], b[:, :, 3:6])
    assert torch.equal(s["w13_lora_a"][0], weights["w13_lora_a"][0][:, :, 2:4])
    with pytest.raises(ValueError, match="divide by 4"):
        shard_tp(weights, 0, 4, fully_sharded=True)


def test_pair_matrix_and_bytes_by_hand():
    part = ExpertPartition(4, 2)                       # rank 0: experts 0, 1; rank 1: 2, 3
    ids0 = torch.tensor([[0, 2], [3, 2]])              # 1 pair stays, 3 leave (token 1 twice to rank 1)
    ids1 = torch.tensor([[1, 3]])
    assert pair_matrix([ids0, ids1], part).tolist() == [[1, 3], [1, 1]]
    assert pair_matrix([ids0, ids1], part, dedup=True).tolist() == [[1, 2], [1, 1]]
    b = ep_bytes([ids0, ids1], part, hidden=8, dtype_bytes=2)
    assert b["dispatch"] == [3 * (16 + META_BYTES), 1 * (16 + META_BYTES)]
    assert b["combine"] == [1 * 16, 3 * 16]


def test_uniform_model_is_the_mean_of_random_routing():
    part = ExpertPartition(128, 4)
    gen = torch.Generator().manual_seed(0)
    ids = [torch.stack([torch.randperm(128, generator=gen)[:8] for _ in range(512)]) for _ in range(4)]
    rows = ep_bytes(ids, part, hidden=2048)["combine"]
    expected = ep_bytes_uniform(512, 8, 2048, 4)
    assert all(abs(v - expected) / expected < 0.05 for v in rows)


def test_tp_bytes_ring_formulas():
    t = tp_bytes(10, 8, 64, 16, 4, fully_sharded=True, dtype_bytes=2)
    assert t["all_reduce_y"] == (10 * 64 * 2, 2 * 0.75 * 10 * 64 * 2)
    assert t["all_gather_T13"] == (2 * 80 * 16 * 2, 0.75 * 2 * 80 * 16 * 2)
    assert t["all_reduce_T2"] == (80 * 16 * 2, 2 * 0.75 * 80 * 16 * 2)
    assert set(tp_bytes(10, 8, 64, 16, 4, fully_sharded=False)) == {"all_reduce_y"}
    assert predict_us(1e6, alpha_us=10, gbps=100) == pytest.approx(20.0)


def test_run_local_results_travel_as_bytes_and_come_back_on_the_cpu():
    """A tensor put on the queue as itself is shared through the process that made it, which may be gone
    when the parent reads it; the results travel as bytes instead."""
    from moelora_lab.dist.launch import decode_result, encode_result
    value = dict(y=torch.arange(6.0).view(2, 3), n=3, name="ep")
    payload = encode_result(value)
    assert isinstance(payload, bytes)
    back = decode_result(payload)
    assert back["n"] == 3 and back["name"] == "ep" and back["y"].device.type == "cpu"
    assert torch.equal(back["y"], value["y"])


def test_run_local_reports_the_failing_rank_and_rejects_local_functions(monkeypatch):
    import moelora_lab.dist.launch as launch
    monkeypatch.setattr(launch, "interpreter_breaks", lambda: "")     # the workers run no kernel
    with pytest.raises(RuntimeError, match="rank 1:(.|\n)*ValueError: rank one fails"):
        run_local(dist_workers.fail_on_one, 2, timeout_s=120)
    with pytest.raises(TypeError, match="module-level function"):
        run_local(lambda rank, world: rank, 2)
    with pytest.raises(ValueError, match="backend"):
        run_local(dist_workers.fail_on_one, 2, backend="mpi")


def test_gloo_processes_run_the_kernels_on_the_interpreter_whatever_the_parent_says(monkeypatch):
    """gloo works on CPU tensors: its processes use the interpreter even where a GPU is visible (a notebook
    on a one-GPU machine), and the parent's environment is left as it was."""
    from moelora_lab._backend import interpreter_breaks
    if interpreter_breaks():
        pytest.skip(f"the interpreter cannot run here ({interpreter_breaks()}); the refusal has its own test")
    monkeypatch.setenv("MOELORA_INTERPRET", "0")
    assert run_local(dist_workers.interpreter_state, 2, threads=1) == [(True, "1"), (True, "1")]
    assert os.environ["MOELORA_INTERPRET"] == "0"
