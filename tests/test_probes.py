"""The probes of ``scripts/probes`` replace the package's functions by name: they must keep up with it.

A probe runs only on a GPU, so nothing else would notice a rule that gained an argument the probe's
stand-in does not take until the probe fails on the device."""
import importlib.util
import inspect
from pathlib import Path

import pytest
import torch

from moelora_lab import rules
from moelora_lab.op import dispatch

PROBES = Path(__file__).parent.parent / "scripts" / "probes"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"probe_{name}", PROBES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(p.stem for p in PROBES.glob("*.py")))
def test_every_probe_imports(name):
    assert load(name).__doc__.startswith("Probe: ")


def test_side_tiles_stand_in_takes_what_the_rule_takes():
    probe = load("side_tiles")
    params = [list(inspect.signature(f).parameters) for f in (probe._gpu_config, dispatch.gpu_config)]
    assert params[0] == params[1]
    w13, w2 = ("one_shot", 16, 16, 768, 2, 132), ("one_shot", 16, 16, 2048, 1, 132)
    rule = dispatch.gpu_config(*w13, rank=64, side_stream=True)
    assert probe._gpu_config(*w13, rank=64, side_stream=True) == rule          # no variant: the rule's tiles
    probe._override.update(w13=dict(n_chunks=3, block_n=128))
    try:
        assert probe._gpu_config(*w13, rank=64, side_stream=True) == rule.replace(n_chunks=3, block_n=128)
        assert probe._gpu_config(*w2, rank=64, side_stream=True) == dispatch.gpu_config(*w2, rank=64, side_stream=True)
    finally:
        probe._override.clear()


def test_one_shot_block_m_replaces_names_the_sweep_has():
    import moelora_lab.bench.kernels_sweep as sweep

    assert callable(sweep._variants) and callable(sweep.save_plots)



def test_gemm_rows_finds_the_timing_it_borrows():
    # gemm_rows imports plan_knobs' timed_rows by name when it runs (from its own folder)
    assert "from plan_knobs import timed_rows" in (PROBES / "gemm_rows.py").read_text()
    assert callable(load("plan_knobs").timed_rows)


@pytest.mark.parametrize("flatten", [True, False])
def test_persistent_gemm_matches_the_grouped_gemm(device, flatten):
    """The persistent probe kernel: every pair's row written (the output is poisoned) and equal to ``moe_gemm``'s,
    for w13 (token rows) and w2 (pair rows, routing weights), with fewer programs than tiles."""
    import moelora_lab as ml
    from moelora_lab.routing.device import make_blocks
    from moelora_lab.base_moe import gemm_tiles, moe_gemm
    from utils import assert_close, poisoned
    probe = load("gemm_persistent")
    shape = ml.MoEShape(64, 32, 5, 2, "persistent-test")          # K a multiple of BLOCK_K, N not of BLOCK_N
    p = ml.make_problem(shape, ml.LoRAShape(2, 4), 23, dtype=torch.float32, device=device, seed=5)
    M, k = p.topk_ids.shape
    tiles = dict(gemm_tiles(M * k, shape.num_experts), BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=2)
    blocks = make_blocks(p.topk_ids, None, shape.num_experts, 1, 16)
    h = torch.randn(M * k, shape.intermediate, device=device)
    weights = p.topk_weights.reshape(-1).float().contiguous()
    for x, w, wt in ((p.x, p.w13, None), (h, p.w2, weights)):
        want = moe_gemm(x, w, blocks, poisoned((M * k, w.shape[1]), x.dtype, device), top_k=k, topk_weights=wt,
                        tiles=dict(tiles, HALF_TAIL=False))
        got = probe.persistent_gemm(x, w, blocks, poisoned((M * k, w.shape[1]), x.dtype, device), top_k=k,
                                    topk_weights=wt, tiles=tiles, used=probe.used_blocks(blocks), flatten=flatten,
                                    programs=3)
        assert_close(got, want, torch.float32)


def test_join_border_runs_each_form_and_restores_the_border():
    from moelora_lab import base_moe as moe

    probe = load("join_border")
    kept = rules.SUM_TILE_MAX_PAIRS
    many = 1 << 20                                   # pairs on the loop's side of the rule's border
    assert not moe.rows_as_tile(many)
    assert {form: probe.in_form(form, lambda: moe.rows_as_tile(many))() for form in probe.FORMS} == \
        {"tile": True, "loop": False}
    assert probe.in_form("loop", lambda: moe.rows_as_tile(1))() is False
    assert rules.SUM_TILE_MAX_PAIRS == kept


def test_plan_knobs_set_what_the_construction_reads_and_restore_it():
    """Each knob names a function of the construction or a rule, where the plan reads it (a rule set on another
    module would change nothing), and a plan built with it leaves the knob as it was."""
    import moelora_lab as ml
    from moelora_lab.routing import device as align

    probe = load("plan_knobs")
    shape = ml.PRESETS["tiny"]
    p = ml.make_problem(shape, ml.LoRAShape(2, 4), 8, seed=0)
    for name, knob in probe.KNOBS.items():
        module, attribute, _ = knob
        assert module is (rules if attribute.isupper() else align) and hasattr(module, attribute), name
        kept = getattr(module, attribute)
        plan = probe._plan(p.topk_ids, p.token_lora, shape.num_experts, 2, 4, shape.intermediate, knob)()
        assert plan.lora_blocks is not None and getattr(module, attribute) is kept, name

