"""The distributed layers' inputs, on the CPU (gloo processes, kernels under the Triton interpreter).

* Bad inputs: ``ep_layer`` and ``tp_layer`` check every input on every rank before their first
  collective, and every rank raises the same named error, whichever rank holds the bad input.
* Fuzz: both layers against the spec (``moe_layer_reference``) over a fixed list of small cases (2 and
  3 ranks): ranks without tokens or with one, E divisible by W or not, top-k up to E, fp16, per-slot
  ranks (a slot of rank 0), strided / transposed / int64 views of every input (``lora_ranks`` and
  the packed LoRA B included), and NaN wherever the layer must not read (the weights of an adapter
  slot no token uses, A rows and B columns past a slot's rank, the memory between the elements of a
  strided x or topk_weights).
* ``run_local`` ends at once, naming the rank, when a process dies without a report.

Each world size starts its processes once per group of cases; the worker loops over the cases.
"""
from __future__ import annotations

import moelora_lab  # noqa: F401  (must come before triton)

import os
import random
import re
import time

import pytest

import dist_workers
from moelora_lab.dist import run_local

TOLERANCE = {"float32": 1e-4, "float16": 2e-2}


def _interpreter_only():
    if not moelora_lab.INTERPRET:
        pytest.skip("the gloo cases run the kernels on CPU tensors, under the Triton interpreter")


# ---- bad inputs --------------------------------------------------------------------------------

ONE = r"^rank 1: "
ALL_2 = r"^ranks 0, 1: "
# name: (world, layer, change (dist_workers.CHANGES), ranks holding the bad input, error type, message pattern)
ERRORS = {
    # tensor parallelism: x is checked (before, extra columns were dropped, missing rows read out of bounds
    # and fp16 x with fp32 weights failed inside a kernel)
    "tp_x_extra_columns": (2, "tp", "x_columns", [0, 1], ValueError,
                           ALL_2 + r"x: has 17 features but w13 expects H=16"),
    "tp_x_too_few_rows": (2, "tp", "x_rows", [0, 1], ValueError, ALL_2 + r"topk_ids: has 4 rows but x has M=3"),
    "tp_x_fp16_weights_fp32": (2, "tp", "x_fp16", [0, 1], TypeError, ALL_2 + r"x: dtype torch.float16 differs from "
                               r"the local weights' torch.float32"),
    "tp_x_not_2d": (2, "tp", "x_3d", [1], ValueError, ONE + r"x: expected a 2-D tensor"),
    "tp_x_not_a_tensor": (2, "tp", "x_list", [1], TypeError, ONE + r"x: expected a torch.Tensor"),
    "tp_fully_sharded_string": (2, "tp", "fully_sharded_str", [0, 1], TypeError,
                                ALL_2 + r"fully_sharded: expected True or False, got str 'yes'"),
    "tp_fully_sharded_int": (2, "tp", "fully_sharded_int", [1], TypeError, ONE + r"fully_sharded: expected True or "
                             r"False, got int 1"),
    "tp_fully_sharded_differs": (2, "tp", "fully_sharded_differs", [1], ValueError,
                                 r"^fully_sharded: the flag differs between the ranks \(rank 0: True, rank 1: False\)"),
    "tp_tokens_differ": (2, "tp", "fewer_tokens", [1], ValueError, r"^x: the number of tokens M .* differs between the "
                         r"ranks \(rank 0: 4, rank 1: 3\)"),
    "tp_lora_path_unknown": (2, "tp", "lora_path_unknown", [1], ValueError,
                             ONE + r"lora_path: 'fastest' is not one of"),
    "tp_token_lora_out_of_range": (2, "tp", "token_lora_range", [1], ValueError, ONE + r"token_lora: value 2 is out of "
                                   r"range; accepted values are -1 \.\. 1"),
    "tp_token_lora_shape": (2, "tp", "token_lora_shape", [1], ValueError, ONE + r"token_lora: expected shape \(4,\)"),
    "tp_token_lora_dtype": (2, "tp", "token_lora_dtype", [1], TypeError, ONE + r"token_lora: dtype torch.float32"),
    "tp_topk_weights_shape": (2, "tp", "topk_weights_shape", [1], ValueError, ONE + r"topk_weights: expected shape "
                              r"\(4, 2\)"),
    "tp_topk_weights_missing": (2, "tp", "topk_weights_missing", [1], ValueError, ONE + r"topk_weights: required"),
    "tp_topk_ids_out_of_range": (2, "tp", "topk_ids_range", [1], ValueError, ONE + r"topk_ids: value 4 is out of "
                                 r"range"),
    "tp_lora_ranks_out_of_range": (2, "tp", "lora_ranks_range", [1], ValueError, ONE + r"lora_ranks: value 5 is out "
                                   r"of range; accepted values are 0 \.\. 4"),
    "tp_lora_ranks_shape": (2, "tp", "lora_ranks_shape", [1], ValueError, ONE + r"lora_ranks: expected shape \(2,\)"),
    "tp_lora_ranks_float": (2, "tp", "lora_ranks_float", [1], TypeError, ONE + r"lora_ranks: dtype torch.float32"),
    "tp_lora_dtype": (2, "tp", "lora_fp16", [1], TypeError, ONE + r"local\['w13_lora_b'\]\[0\]: dtype torch.float16 "
                      r"differs from x's torch.float32"),
    "tp_lora_slice_layouts": (2, "tp", "slice_layouts_differ", [1], ValueError, ONE + r"local\['w13_lora_b'\]: the "
                              r"slices have different memory layouts"),
    "tp_no_lora_on_one_rank": (2, "tp", "no_lora_here", [1], ValueError, r"^local: the number of adapter slots L .* "
                               r"differs between the ranks \(rank 0: 2, rank 1: -1\)"),
    "tp_validate_string": (2, "tp", "validate_str", [1], TypeError, ONE + r"validate: expected True or False"),
    "tp_validate_off_still_checks_shapes": (2, "tp", "validate_off_token_lora_shape", [1], ValueError,
                                            ONE + r"token_lora: expected shape \(4,\)"),
    "tp_local_not_a_dict": (2, "tp", "local_not_a_dict", [1], TypeError, ONE + r"local: expected this rank's shard_tp"),
    # expert parallelism: every input, before the first all-to-all
    "ep_token_lora_out_of_range": (2, "ep", "token_lora_range", [1], ValueError, ONE + r"token_lora: value 2 is out of "
                                   r"range; accepted values are -1 \.\. 1"),
    "ep_token_lora_shape": (2, "ep", "token_lora_shape", [1], ValueError, ONE + r"token_lora: expected shape \(3,\)"),
    "ep_token_lora_dtype": (2, "ep", "token_lora_dtype", [1], TypeError, ONE + r"token_lora: dtype torch.float32"),
    "ep_topk_weights_shape": (2, "ep", "topk_weights_shape", [1], ValueError, ONE + r"topk_weights: expected shape "
                              r"\(3, 2\)"),
    "ep_topk_weights_rows": (2, "ep", "topk_weights_rows", [1], ValueError, ONE + r"topk_weights: expected shape "
                             r"\(3, 2\) .*got \(2, 2\)"),
    "ep_topk_weights_missing": (2, "ep", "topk_weights_missing", [1], ValueError, ONE + r"topk_weights: required"),
    "ep_topk_ids_out_of_range": (2, "ep", "topk_ids_range", [1], ValueError, ONE + r"topk_ids: value 4 is out of "
                                 r"range; accepted values are 0 \.\. 3"),
    "ep_topk_ids_negative": (2, "ep", "topk_ids_negative", [1], ValueError,
                             ONE + r"topk_ids: value -1 is out of range"),
    "ep_topk_ids_float": (2, "ep", "topk_ids_float", [1], TypeError, ONE + r"topk_ids: dtype torch.float32"),
    "ep_x_extra_columns": (2, "ep", "x_columns", [1], ValueError, ONE + r"x: has 17 features but w13 expects H=16"),
    "ep_x_too_few_rows": (2, "ep", "x_rows", [1], ValueError, ONE + r"topk_ids: has 3 rows but x has M=2"),
    "ep_x_fp16_weights_fp32": (2, "ep", "x_fp16", [1], TypeError, ONE + r"x: dtype torch.float16 differs"),
    "ep_x_not_a_tensor": (2, "ep", "x_list", [1], TypeError, ONE + r"x: expected a torch.Tensor"),
    "ep_lora_ranks_out_of_range": (2, "ep", "lora_ranks_range", [1], ValueError, ONE + r"lora_ranks: value 5 is out "
                                   r"of range"),
    "ep_lora_ranks_shape": (2, "ep", "lora_ranks_shape", [1], ValueError, ONE + r"lora_ranks: expected shape \(2,\)"),
    "ep_lora_dtype": (2, "ep", "lora_fp16", [1], TypeError, ONE + r"w13_lora_a\[0\]: dtype torch.float16"),
    "ep_lora_slice_layouts": (2, "ep", "slice_layouts_differ", [1], ValueError, ONE + r"w13_lora_b: the slices have "
                              r"different memory layouts"),
    "ep_no_lora_on_one_rank": (2, "ep", "no_lora_here", [1], ValueError, r"^local: the number of adapter slots L .* "
                               r"differs between the ranks"),
    "ep_micro_batches_differ": (2, "ep", "micro_batches_differ", [1], ValueError, r"^micro_batches: the number of "
                                r"micro-batches differs between the ranks \(rank 0: 1, rank 1: 2\)"),
    "ep_micro_batches_zero": (2, "ep", "micro_batches_zero", [1], ValueError, ONE + r"micro_batches: must be >= 1"),
    "ep_schedule_in_k": (2, "ep", "schedule_in_k", [1], ValueError, ONE + r"schedule: 'in_k' is not one of"),
    "ep_lora_path_unknown": (2, "ep", "lora_path_unknown", [1], ValueError, ONE + r"lora_path: 'fastest'"),
    "ep_counts_of_other_ids": (2, "ep", "counts_wrong_pairs", [1], ValueError, ONE + r"counts: micro-batch 0 sends 5 "
                               r"pairs, but this call's topk_ids has 6"),
    "ep_counts_on_one_rank": (2, "ep", "counts_only_here", [1], ValueError, r"^counts: whether counts is passed .* "
                              r"differs between the ranks"),
    "ep_validate_string": (2, "ep", "validate_str", [1], TypeError, ONE + r"validate: expected True or False"),
    "ep_validate_off_still_checks_shapes": (2, "ep", "validate_off_token_lora_shape", [1], ValueError,
                                            ONE + r"token_lora: expected shape \(3,\)"),
    "ep_local_not_a_dict": (2, "ep", "local_not_a_dict", [1], TypeError, ONE + r"local: expected this rank's experts"),
    "ep_whole_weights_as_local": (2, "ep", "full_weights_as_local", [1], ValueError, ONE + r"local: w13 holds 4 "
                                  r"experts, but rank 1 owns 2"),
    # three ranks: the rank that holds the bad input is named, on every rank
    "ep3_token_lora_on_rank_2": (3, "ep", "token_lora_range", [2], ValueError, r"^rank 2: token_lora: value 2"),
    "ep3_topk_ids_on_ranks_0_2": (3, "ep", "topk_ids_range", [0, 2], ValueError, r"^ranks 0, 2: topk_ids: value 4"),
    "ep3_mixed_errors": (3, "ep", "x_fp16_or_token_lora", [0, 2], TypeError, r"^rank 0: x: dtype torch.float16 "
                         r"differs.*\(also rank 2: token_lora: value 2 is out of range"),
    "tp3_x_columns_on_rank_0": (3, "tp", "x_columns", [0], ValueError, r"^rank 0: x: has 13 features but w13 expects "
                                r"H=12"),
    "tp3_token_lora_shape_on_rank_2": (3, "tp", "token_lora_shape", [2], ValueError, r"^rank 2: token_lora: expected "
                                       r"shape \(4,\)"),
}


@pytest.fixture(scope="module")
def raised():
    """What every rank raised in every case of ERRORS (one process group per world size)."""
    _interpreter_only()
    out = {}
    for world in (2, 3):
        cases = {name: (layer, change, bad) for name, (w, layer, change, bad, _, _) in ERRORS.items() if w == world}
        per_rank = run_local(dist_workers.bad_inputs, world, cases, threads=1, timeout_s=240)
        out[world] = {name: [r[name] for r in per_rank] for name in list(cases) + ["after_ep", "after_tp"]}
    return out


@pytest.mark.parametrize("name", list(ERRORS))
def test_every_rank_raises_the_same_named_error(raised, name):
    world, _, _, _, kind, pattern = ERRORS[name]
    got = raised[world][name]
    assert all(g == got[0] for g in got), f"the ranks did not raise the same: {got}"
    assert got[0][0] == kind.__name__, got[0]
    assert re.search(pattern, got[0][1], re.S), got[0][1]


@pytest.mark.parametrize("world", [2, 3])
def test_the_group_still_works_after_the_errors(raised, world):
    for layer in ("ep", "tp"):
        for r in raised[world][f"after_{layer}"]:
            assert "error" not in r, r.get("error")
            assert r["finite"] and r["rel_err"] <= TOLERANCE["float32"], r


# ---- fuzz against the spec -----------------------------------------------------------------------

def _hand_picked(world: int) -> dict:
    """Cases chosen for their edges."""
    lora = dict(L=4, r=8, lora_ranks=[8, 3, 0, 8], used_slots=[0, 1, 2])        # slot 3 unused, slot 2 rank 0
    if world == 2:
        return {
            "ep_rank_without_tokens": dict(layer="ep", E=4, k=2, H=32, I=16, tokens=[0, 5], dtype="float32",
                                           strided=True, grad=True, **lora),
            "ep_topk_is_E_uneven_fp16_micro_batches": dict(layer="ep", E=5, k=5, H=16, I=8, L=2, r=4,
                                                           lora_ranks=[4, 1], tokens=[1, 3], dtype="float16",
                                                           micro_batches=2, strided=True, packed=True),
            "ep_no_lora": dict(layer="ep", E=3, k=1, H=16, I=16, tokens=[4, 2], dtype="float32", strided=True),
            "ep_no_tokens_anywhere": dict(layer="ep", E=2, k=2, H=16, I=8, L=2, r=4, tokens=[0, 0],
                                          dtype="float32", strided=True),
            "ep_rank_0_weights": dict(layer="ep", E=4, k=2, H=16, I=8, L=2, r=0, tokens=[3, 2], dtype="float32"),
            "tp_fully_sharded": dict(layer="tp", fully_sharded=True, E=4, k=2, H=32, I=16, tokens=[6],
                                     dtype="float32", strided=True, grad=True,
                                     **dict(lora, lora_ranks=[8, 4, 0, 8])),
            "tp_replicated_one_token_fp16": dict(layer="tp", fully_sharded=False, E=3, k=2, H=16, I=8, L=2, r=4,
                                                 tokens=[1], dtype="float16", strided=True, packed=True),
            "tp_no_tokens": dict(layer="tp", fully_sharded=True, E=2, k=1, H=16, I=8, L=2, r=4, tokens=[0],
                                 dtype="float32", strided=True),
            "tp_no_lora": dict(layer="tp", fully_sharded=False, E=3, k=3, H=16, I=8, tokens=[5], dtype="float32",
                               strided=True),
            "tp_one_shot": dict(layer="tp", fully_sharded=False, E=4, k=2, H=16, I=16, tokens=[5], dtype="float32",
                                strided=True, lora_path="one_shot", **lora),
            "tp_small_batch": dict(layer="tp", fully_sharded=False, E=4, k=2, H=16, I=16, tokens=[3],
                                   dtype="float16", strided=True, lora_path="small_batch", **lora),
        }
    return {
        "ep_E_not_divisible_topk_is_E": dict(layer="ep", E=4, k=4, H=16, I=8, L=3, r=4, lora_ranks=[4, 0, 2],
                                             used_slots=[0, 1], tokens=[2, 0, 3], dtype="float32", strided=True),
        "ep_E_divisible_fp16_three_micro_batches": dict(layer="ep", E=6, k=3, H=16, I=16, L=2, r=8,
                                                        tokens=[1, 8, 0], dtype="float16", micro_batches=3,
                                                        strided=True, packed=True),
        "tp_fully_sharded": dict(layer="tp", fully_sharded=True, E=3, k=2, H=24, I=12, L=3, r=6,
                                 lora_ranks=[6, 3, 0], used_slots=[0, 2], tokens=[5], dtype="float32", strided=True),
        "tp_replicated_fp16": dict(layer="tp", fully_sharded=False, E=5, k=2, H=12, I=6, L=2, r=4, tokens=[7],
                                   dtype="float16", strided=True),
    }


def _drawn(world: int, n: int) -> dict:
    """``n`` cases drawn from a fixed seed (the same on every run)."""
    rng = random.Random(1000 + world)
    cases = {}
    for i in range(n):
        layer = ("ep", "tp")[i % 2]
        spec = dict(layer=layer, dtype=rng.choice(["float32", "float16"]), strided=rng.random() < 0.75,
                    packed=rng.random() < 0.3)
        if layer == "ep":
            E = rng.randint(world, 6)
            spec.update(H=rng.choice([8, 16, 32]), I=rng.choice([8, 16, 32]), micro_batches=rng.randint(1, 3),
                        tokens=[rng.choice([0, 1, rng.randint(2, 8)]) for _ in range(world)])
            fully_sharded = False
        else:
            E = rng.randint(1, 6)
            fully_sharded = rng.random() < 0.5
            spec.update(H=world * rng.choice([4, 8]), I=world * rng.choice([2, 4, 8]), fully_sharded=fully_sharded,
                        tokens=[rng.choice([1, rng.randint(2, 8)])])
        spec.update(E=E, k=rng.randint(1, E))
        if rng.random() < 0.85:
            L = rng.randint(1, 4)
            r = world * rng.randint(1, 3) if fully_sharded else rng.randint(1, 8)
            spec.update(L=L, r=r, used_slots=sorted(rng.sample(range(L), rng.randint(1, L))),
                        lora_ranks=[rng.randint(0, r) for _ in range(L)] if rng.random() < 0.6 else None)
            if not fully_sharded:
                spec["lora_path"] = rng.choice(["auto", "one_shot", "two_kernel", "small_batch"])
        cases[f"drawn_{i}_{layer}"] = spec
    return cases


def fuzz_cases(world: int) -> dict:
    cases = {**_hand_picked(world), **_drawn(world, 8 if world == 2 else 6)}
    for i, spec in enumerate(cases.values()):
        spec.setdefault("seed", 100 * world + i)
    return cases


FUZZ = {world: fuzz_cases(world) for world in (2, 3)}


@pytest.fixture(scope="module")
def fuzzed():
    _interpreter_only()
    return {world: _fuzz_run(world) for world in (2, 3)}


def _fuzz_run(world):
    per_rank = run_local(dist_workers.fuzz, world, FUZZ[world], threads=1, timeout_s=240)
    return {name: [r[name] for r in per_rank] for name in FUZZ[world]}


@pytest.mark.parametrize("world, name", [(w, n) for w in (2, 3) for n in FUZZ[w]])
def test_layers_match_the_spec(fuzzed, world, name):
    spec = FUZZ[world][name]
    for rank, r in enumerate(fuzzed[world][name]):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        assert r["shape"] == r["want"] and r["dtype"] == spec["dtype"], (rank, r)
        assert r["finite"], f"rank {rank}: non-finite output (read memory it must not read?)"
        assert r["rel_err"] <= TOLERANCE[spec["dtype"]], (rank, r)
        if spec.get("grad"):                   # inputs require grad: same output, and a backward refuses by name
            assert r["refusal"] and f"{spec['layer']}_layer: has no backward" in r["refusal"], (rank, r)
        else:
            assert r["refusal"] is None


def test_the_fuzz_covers_its_edges():
    """The list really holds what it claims (a guard against edits that drop an edge)."""
    specs = [(w, s) for w in (2, 3) for s in FUZZ[w].values()]
    ep = [(w, s) for w, s in specs if s["layer"] == "ep"]
    assert any(0 in s["tokens"] for _, s in ep) and any(1 in s["tokens"] for _, s in ep)
    assert any(s["E"] % w for w, s in ep) and any(s["E"] % w == 0 for w, s in ep)
    assert any(s["k"] == s["E"] for _, s in specs)
    assert any(s["tokens"] == [0] for _, s in specs if s["layer"] == "tp")
    assert any(s["dtype"] == "float16" for _, s in specs) and any(s.get("strided") for _, s in specs)
    assert any(0 in (s.get("lora_ranks") or []) for _, s in specs)
    assert any(len(s.get("used_slots", [])) < s.get("L", 0) for _, s in specs)
    assert {s.get("fully_sharded") for _, s in specs if s["layer"] == "tp"} == {True, False}


# ---- run_local and processes that die -------------------------------------------------------------

@pytest.fixture
def no_kernels(monkeypatch):
    """The workers below run no kernel: the gloo refusal of an interpreter that cannot run (numpy >= 2.4
    under triton 3.6, as on some GPU machines) does not concern them, and these tests run there too."""
    import moelora_lab.dist.launch as launch
    monkeypatch.setattr(launch, "interpreter_breaks", lambda: "")


def test_run_local_raises_at_once_when_a_process_exits_without_a_report(no_kernels):
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1: the process exited with code 3 without reporting"):
        run_local(dist_workers.exit_on_one, 2, timeout_s=60)
    assert time.monotonic() - start < 30


def test_run_local_names_a_process_killed_by_a_signal_before_the_errors_it_causes(no_kernels):
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"failed\nrank 1: the process was killed by signal SIGKILL(.|\n)*rank 0:"):
        run_local(dist_workers.killed_on_one, 2, timeout_s=60)
    assert time.monotonic() - start < 30


DIES_ON_IMPORT = """
import os
if os.getpid() != {parent}:                   # a spawned process: gone before it joins the group
    raise SystemExit(5)


def work(rank, world):
    return rank
"""


def test_run_local_raises_at_once_when_the_processes_die_before_joining(tmp_path, monkeypatch, no_kernels):
    """As a script without a ``__main__`` guard does: the processes die while they start."""
    (tmp_path / "dies_in_children.py").write_text(DIES_ON_IMPORT.format(parent=os.getpid()))
    monkeypatch.syspath_prepend(str(tmp_path))
    import dies_in_children
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank [01]: the process exited with code 5"):     # whichever dies first
        run_local(dies_in_children.work, 2, timeout_s=60)
    assert time.monotonic() - start < 30


def test_gloo_processes_refuse_an_interpreter_that_cannot_run(monkeypatch):
    """Where the Triton interpreter cannot run (numpy >= 2.4 under triton 3.6), the CPU processes say so at once."""
    import moelora_lab.dist.launch as launch
    monkeypatch.setattr(launch, "interpreter_breaks", lambda: "numpy 9.9 breaks it")
    with pytest.raises(RuntimeError, match=r"backend='gloo'.*numpy 9.9 breaks it"):
        launch.run_local(divmod, 2)
