"""The table of the layer's schedules: every other module, the README and ``--help`` read it."""
import ast
import re
from pathlib import Path

import pytest

from moelora_lab.layer.table import AUTO, SCHEDULES
from moelora_lab.profile.timeline import STAGE_KINDS, bench_workload, recorded_lora_path, stage_model
from moelora_lab.summary import VLLM_JOIN_ROWS, schedules_markdown, vllm_join_variant

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moelora_lab"
TABLE = PACKAGE / "layer" / "table.py"
README = ROOT / "README.md"
META = dict(preset="qwen3-30b-a3b", M=512, rank=16, loras=4)


def _spelled(path: Path) -> list[tuple[int, str]]:
    """(line, name) of every string constant of ``path`` (f-string parts included) that is a row's name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in SCHEDULES]


def test_no_module_but_the_table_spells_a_schedule_name():
    modules = sorted(p for p in PACKAGE.rglob("*.py") if p != TABLE)
    assert len(modules) > 50                                     # the whole package was walked
    spelled = [f"{path.relative_to(ROOT)}:{line}: {name!r}" for path in modules for line, name in _spelled(path)]
    assert not spelled, "read these names from moelora_lab.layer.table:\n" + "\n".join(spelled)


def test_the_check_sees_plain_strings_and_f_string_parts(tmp_path):
    name = next(iter(SCHEDULES))
    probe = tmp_path / "probe.py"
    probe.write_text(f"A = {name!r}\nB = f'{name}{{A}}'\nC = {name + '_x'!r}\n")
    assert _spelled(probe) == [(1, name), (2, name)]


def test_readme_table_is_the_table():
    block = re.search(r"<!-- schedules-table -->\n(.*?)\n<!-- /schedules-table -->", README.read_text(), re.S)
    assert block, "README.md lacks the <!-- schedules-table --> ... <!-- /schedules-table --> markers"
    assert block.group(1).strip() == schedules_markdown(), \
        "README's schedule table is stale: paste moelora_lab.summary.schedules_markdown()"
    for name, row in SCHEDULES.items():
        assert f"| `{name}` | {row.status} |" in block.group(1)


def test_layer_help_lists_every_row(capsys):
    from moelora_lab.bench import cli

    with pytest.raises(SystemExit) as done:
        cli.parse_args(["layer", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for name, row in SCHEDULES.items():
        assert re.search(rf"^  {name} +{row.status}: ", text, re.M), f"--help lacks the row {name!r}"
        assert " ".join(row.summary.split()) in " ".join(text.split())


def test_layer_variants_are_built_from_the_rows():
    from moelora_lab.bench import layer_sweep
    from moelora_lab.plots.layer import VARIANT_STYLE

    assert set(SCHEDULES) <= set(layer_sweep.VARIANTS) and AUTO in layer_sweep.VARIANTS
    assert {vllm_join_variant(n) for n, row in SCHEDULES.items() if "vllm" in row.joins} == \
        {v for v in layer_sweep.VARIANTS if v.endswith("_vllm_join")} == set(map(vllm_join_variant, VLLM_JOIN_ROWS))
    assert all(layer_sweep.SCHEDULE_OF[v] in SCHEDULES for v in layer_sweep.VARIANTS
               if v in layer_sweep.SCHEDULE_OF and layer_sweep.SCHEDULE_OF[v] != AUTO)
    for name, row in SCHEDULES.items():
        assert VARIANT_STYLE[name] == row.style                # the plots draw a row as it says


def test_every_rows_stages_have_a_kind_and_a_known_lane():
    from moelora_lab.profile.trace_import import THREADS

    for name, row in SCHEDULES.items():
        assert set(row.stage_names) <= set(STAGE_KINDS), name
        assert {lane for _, lane in row.stages} <= set(THREADS), name      # the lanes the trace export names


def test_stage_model_follows_each_row_or_says_it_cannot():
    for name, row in SCHEDULES.items():
        meta = dict(META, schedule=name, lora_path=recorded_lora_path(name, "two_kernel"))
        try:
            model = stage_model(meta)
        except ValueError as exc:                               # a row the byte model lacks says so
            assert repr(name) in str(exc) and "byte model" in str(exc)
            continue
        assert tuple(model) == row.stage_names, name           # the row's stages, in launch order
        assert all(s["bytes"] == s["bytes_read"] + s["bytes_written"] > 0 for s in model.values())


def test_in_k_stage_model():
    """``in_k`` as the epilogue's model allows: the same shrink reads and joins; T written for every pair
    (L*r columns), and each GEMM reads the base GEMM's bytes, every slot's packed B of each touched
    expert and that T."""
    from moelora_lab.config import MoEShape
    from moelora_lab.profile.traffic import layer_traffic

    [in_k] = [n for n, row in SCHEDULES.items() if row.needs_pack and row.status == "product"]
    [epilogue] = [n for n, row in SCHEDULES.items() if row.max_columns and not row.gemm_lora_tiles]
    shape = MoEShape.from_name(META["preset"])
    M, r, L = META["M"], META["rank"], META["loras"]
    P, H, I = M * shape.top_k, shape.hidden, shape.intermediate
    work = bench_workload(shape, M, L)
    base = layer_traffic(shape, r, work, with_lora=False)
    lora = layer_traffic(shape, r, work, lora_path="two_kernel")
    model = stage_model(dict(META, schedule=in_k, lora_path=recorded_lora_path(in_k, "one_shot")))
    other = stage_model(dict(META, schedule=epilogue, lora_path=recorded_lora_path(epilogue, "two_kernel")))
    assert tuple(model) == SCHEDULES[in_k].stage_names
    assert model["act"]["bytes"] == other["act"]["bytes"] == base["act"].bytes
    assert model["sum"]["bytes"] == other["sum"]["bytes"] == base["sum"].bytes
    for op, n_out, slices in (("w13", I, 2), ("w2", H, 1)):
        t, tail = lora[f"lora_{op}"], slices * P * L * r * 2
        shrink, gemm = model[f"shrink_{op}"], model[f"{op}+lora"]
        assert shrink["bytes_read"] == t.part("x") + t.part("lora_a") == other[f"shrink_{op}"]["bytes_read"]
        assert shrink["bytes_written"] == tail > other[f"shrink_{op}"]["bytes_written"]
        assert gemm["bytes_written"] == base[f"base_{op}"].bytes_written
        assert gemm["bytes_read"] == (base[f"base_{op}"].bytes_read + tail
                                      + work.touched_experts * slices * n_out * L * r * 2)
        assert shrink["kernel"] == "shrink_tail_kernel" and "K widened" in gemm["kernel"]
        assert "BLOCK_LR" not in gemm["tiles"] and shrink["tiles"] == other[f"shrink_{op}"]["tiles"]


def test_recorded_lora_path_keeps_the_data_values():
    """The benchmarks record what the committed data holds: ``in_gemm`` for the LoRA inside the GEMMs, the
    schedule's name where its GEMMs expand after its own shrink, else the plan's path."""
    from moelora_lab.results import load, load_traces

    seen = {(r["schedule"], r["lora_path"]) for r in load("layer") if r["schedule"] in SCHEDULES}
    seen |= {(t["meta"]["schedule"], t["meta"]["lora_path"]) for t in load_traces().values()}
    for schedule, path in seen:
        row = SCHEDULES[schedule]
        plan_path = None if row.gemm_lora_tiles else (row.plan_path or path)
        assert recorded_lora_path(schedule, plan_path) == path, (schedule, path)


def test_trace_export_and_timelines_read_the_streams():
    pytest.importorskip("IPython")
    pytest.importorskip("plotly")
    from moelora_lab.plots import timeline_interactive as ti
    from moelora_lab.profile.trace_events import ONE_STREAM

    assert set(ONE_STREAM) == {n for n, row in SCHEDULES.items() if row.streams == 1}
    assert {n: s for n, (_, s) in ti.SCHEDULES.items()} == {n: row.streams for n, row in SCHEDULES.items()}
    assert set(ti.DEFAULT_SCHEDULES) <= set(SCHEDULES)
