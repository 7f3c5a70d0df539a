"""The schedule table: a schedule is a runner plus a row; ``auto`` picks product rows; experiments stay apart."""
import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import moelora_lab as ml
from moelora_lab.layer import SCHEDULES, Schedule, choices, get_schedule, schedule_names
from moelora_lab.layer import table
from moelora_lab.layer.two_kernel import buffers
from moelora_lab.base_moe import moe_gemm, silu_and_mul, topk_sum
from utils import assert_close

PACKAGE = Path(ml.__file__).parent
SHAPE = ml.MoEShape(40, 24, 5, 2, "table-test")


def toy_runner(call):
    """A schedule written for this test: the plain layer, then the spec's LoRA delta added on the host."""
    M, k, E, H, I, L, r = call.dims
    c1, h, c3, y = buffers(call.x, M, k, H, I)
    moe_gemm(call.x, call.w13, call.plan.base_blocks, c1, top_k=k, tiles=call.plan.tiles)
    silu_and_mul(c1, h, top_k=k)
    moe_gemm(h, call.w2, call.plan.base_blocks, c3, top_k=k, topk_weights=call.weights, tiles=call.plan.tiles)
    topk_sum(c3, y, top_k=k)
    a13, b13, a2, b2 = call.lora
    return ml.moe_layer_reference(call.x, call.topk_ids, call.topk_weights, call.token_lora, call.w13, call.w2,
                                  a13, b13, a2, b2)


def test_a_new_schedule_is_a_runner_plus_a_row(monkeypatch, device):
    """The face runs a row it has never seen, refuses its ignored arguments and its limits, and ``auto`` does not
    pick it unless told to."""
    row = Schedule("toy", toy_runner, "experiment", 1, (("layer", "main"),), "the spec, for a test",
                   lora_inside="the host", lora_blocks=False, max_columns=32)
    monkeypatch.setitem(SCHEDULES, "toy", row)
    p = ml.make_problem(SHAPE, ml.LoRAShape(3, 8), 7, seed=3, device=device)
    want = ml.moe_layer_reference(**p.layer_inputs())
    assert "toy" in choices()
    assert_close(ml.moe_lora_layer(**p.layer_inputs(), schedule="toy"), want, torch.float32)
    plan = ml.plan_layer(p.topk_ids, p.token_lora, SHAPE.num_experts, 3, 8, schedule="toy")
    assert plan.schedule == "toy" and plan.lora_blocks is None
    assert_close(ml.moe_lora_layer(**p.layer_inputs(), schedule="toy", plan=plan), want, torch.float32)
    with pytest.raises(ValueError, match="join: 'vllm' has no meaning with schedule='toy'"):
        ml.moe_lora_layer(**p.layer_inputs(), schedule="toy", join="vllm")
    with pytest.raises(ValueError, match="lora_path: 'one_shot' has no meaning with schedule='toy'"):
        ml.moe_lora_layer(**p.layer_inputs(), schedule="toy", lora_path="one_shot")
    wide = ml.make_problem(SHAPE, ml.LoRAShape(3, 16), 7, seed=3, device=device)
    with pytest.raises(ValueError, match="schedule='toy': its LoRA needs L\\*r <= 32"):
        ml.moe_lora_layer(**wide.layer_inputs(), schedule="toy")
    with pytest.raises(TypeError, match="plan: made for another schedule"):
        ml.moe_lora_layer(**p.layer_inputs(), schedule="sequential", plan=plan)
    assert "toy" not in schedule_names("product")


def test_rows_say_what_they_are():
    for name, row in SCHEDULES.items():
        assert row.name == name and row.status in table.STATUSES and row.streams in (1, 2)
        assert row.summary and row.stages and all(lane in ("main", "lora") for _, lane in row.stages)
        assert row.streams == 1 or any(lane == "lora" for _, lane in row.stages), f"{name}: nothing on a side stream"
        assert callable(row.run), name                            # the runner's import path resolves
        assert row.lora_paths is None or row.lora_inside, f"{name}: say where its LoRA runs"
        assert set(row.joins) <= set(table.JOINS)
        assert row.cpu_runs is None or SCHEDULES[row.cpu_runs].streams == 1
        assert row.style and {"color", "marker", "label"} <= set(row.style)
    for name in (table.AUTO_CPU, table.AUTO_GPU, table.AUTO_LARGE):
        assert SCHEDULES[name].status == "product"
    with pytest.raises(ValueError, match="status must be one of"):
        Schedule("x", toy_runner, "winner", 1, (("a", "main"),), "x")
    with pytest.raises(ValueError, match="cannot name a schedule"):
        Schedule("auto", toy_runner, "product", 1, (("a", "main"),), "x")
    for name in ("NO_SUCH_RULE", "KernelConfig"):                   # a limit by name names a rule of ``rules``
        with pytest.raises(ValueError, match=f"max_columns={name!r} names no rule"):
            Schedule("x", toy_runner, "experiment", 1, (("a", "main"),), "x", max_columns=name)
    with pytest.raises(ValueError, match="schedule: 'nope' is not one of"):
        get_schedule("nope")
    with pytest.raises(TypeError, match="schedule: expected a str"):
        get_schedule(3)


def test_auto_picks_only_product_rows_that_honour_the_call():
    from moelora_lab.layer import gpu_schedule
    E = 8
    picked = {gpu_schedule(p, E, in_k_columns=c, join=j, lora_path=path)
              for p in (0, 1, 64, 128 * E, 10**6) for c in (None, 16, 256, 257) for j in table.JOINS
              for path in ("auto", "one_shot", "two_kernel")}
    assert picked and all(SCHEDULES[s].status == "product" for s in picked)
    for s in picked:
        for j in table.JOINS:
            for path in ("one_shot",):
                if gpu_schedule(10**6, E, in_k_columns=16, join=j, lora_path=path) == s:
                    assert SCHEDULES[s].ignored(j, path) is None


def _imports(path: Path) -> set:
    """The moelora_lab modules ``path`` imports, as dotted names (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[:len(parts) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.startswith("moelora_lab")}


def test_no_product_module_imports_an_experiment():
    """The experiments package may use the product; the product never imports it (rows name runners by path)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in ("experiments", "bench", "exercises", "plots", "profile"):
            continue                          # the experiments themselves and the lab floors that time/show them
        bad = [m for m in _imports(path) if m.startswith("moelora_lab.experiments")]
        if bad:
            offenders.append(f"{rel}: {bad}")
    assert not offenders, offenders


def test_the_plan_carries_what_it_computed():
    """Runners read tiles and the LoRA config from the plan: the face computes them once."""
    p = ml.make_problem(SHAPE, ml.LoRAShape(3, 8), 7, seed=4)
    for name, row in SCHEDULES.items():
        if row.needs_pack:
            continue
        plan = ml.plan_layer(p.topk_ids, p.token_lora, SHAPE.num_experts, 3, 8, schedule=name,
                             intermediate=SHAPE.intermediate)
        assert plan.schedule == name and plan.tiles["BLOCK_M"] == plan.base_blocks.block_size
        assert (plan.lora_blocks is not None) == row.lora_blocks == (plan.lora_config is not None)
        if row.plan_path:
            assert plan.lora_path == row.plan_path
        if plan.lora_config is not None:
            assert plan.lora_config.block_m == plan.lora_blocks.block_size
    frozen = dataclasses.fields(ml.LayerPlan)
    assert {"tiles", "schedule", "lora_config"} <= {f.name for f in frozen}


class RecordingTracer:
    """Records (stage, lane) as the layer enters them (the interface of ``profile.timeline.Tracer``)."""

    def __init__(self):
        self.seen = []

    def stage(self, name, lane):
        import contextlib
        self.seen.append((name, lane))
        return contextlib.nullcontext()


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_each_row_lists_the_stages_its_runner_records(name, device):
    import warnings
    p = ml.make_problem(SHAPE, ml.LoRAShape(3, 8), 7, seed=5, device=device)
    inputs = p.layer_inputs()
    kw = {}
    if SCHEDULES[name].needs_pack:
        pack = ml.pack_in_k(inputs["w13"], inputs["w2"], inputs["w13_lora_b"], inputs["w2_lora_b"])
        inputs.update(w13=pack.w13, w2=pack.w2)
        kw["in_k"] = pack
    tracer = RecordingTracer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)          # a two-stream row on the CPU
        ml.moe_lora_layer(**inputs, schedule=name, tracer=tracer, **kw)
    ran = name if device == "cuda" else SCHEDULES[name].cpu_runs or name    # CUDA streams: the row itself
    assert tuple(tracer.seen) == SCHEDULES[ran].stages
