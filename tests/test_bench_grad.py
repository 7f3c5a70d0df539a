"""The backward benchmark without a GPU: its parser, the rows its pipeline writes (every path checked against the
spec first, auto's pick recorded, the byte model's count of the path that ran; wall-clock times on the CPU,
labelled ``device=cpu``, never a GPU's), and a path with a wrong gradient stopping the sweep by name."""
import dataclasses

import pytest
import torch

from moelora_lab.bench import cli, common, grad_sweep
from moelora_lab.config import MoEShape
from moelora_lab.op import grad_paths
from moelora_lab.profile import timing
from moelora_lab.profile.grad_traffic import GradWorkload, grad_op_traffic
from moelora_lab.plots.training import grad_time_lines
from moelora_lab.results import label, read_csv

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="runs the kernels on CPU tensors (interpreter)")
CASE = ["grad", "--presets", "tiny", "--tokens", "3", "40", "--ranks", "4", "--dtype", "float32"]


@pytest.fixture
def cpu_grad(monkeypatch):
    monkeypatch.setattr(common, "DEVICE", "cpu")
    monkeypatch.setattr(grad_sweep, "ROUNDS", 1)
    monkeypatch.setattr(timing, "copy_bandwidth", lambda *a, **k: 4.0e12)


def test_parser_defaults_and_choices():
    args = cli.parse_args(["grad"])
    assert (args.presets, args.tokens, args.ranks, args.ops) == (["qwen3-30b-a3b"], [16, 128, 512, 2048, 8192],
                                                                 [16, 64], ["w13", "w2"])
    assert args.paths == ["two_kernel", "one_shot", "one_shot_atomic", "auto"] and args.name == "grad"
    with pytest.raises(SystemExit):
        cli.parse_args(["grad", "--paths", "reference"])          # the spec is the check, not a timed path


@cpu_only
def test_pipeline_rows_on_the_cpu(cpu_grad, tmp_path):
    assert cli.main(CASE + ["--ops", "w2", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "grad.csv")
    assert len(rows) == 2 * 4                                      # M x paths
    assert {r["device"] for r in rows} == {"cpu"} and all(r["us_median"] > 0 for r in rows)
    for r in rows:
        assert r["ran"] == r["path"] if r["path"] != "auto" else r["ran"] in ("two_kernel", "one_shot")
    shape = MoEShape.from_name("tiny")
    row = next(r for r in rows if (r["op"], r["M"], r["path"]) == ("w2", 40, "two_kernel"))
    ids, _, lora = common.sweep_routing(shape, 4, 40, 0)          # the sweep's own routing of M = 40
    work = GradWorkload.from_routing(ids, lora, shape.num_experts, 4, row["block_m"])
    want = grad_op_traffic("two_kernel", work, in_features=shape.intermediate, out_features=shape.hidden,
                           num_slices=1, rank=4, x_rows="pair", dtype_bytes=4, mul_routed_weight=True)
    assert (row["bytes"], row["floor_bytes"]) == (want.total.bytes, want.floor.bytes)
    assert row["floor_us"] == round(want.floor.bytes / 4.0e12 * 1e6, 2)
    # what notebook 09 prints of such data: its label and one line per (op, r, M)
    lines = grad_time_lines(rows)
    assert label(rows) and len(lines) == 3 and all(line.split()[-1] in ("two_kernel", "one_shot") for line in lines[1:])


@cpu_only
def test_a_wrong_path_stops_the_sweep_by_name(cpu_grad, tmp_path, monkeypatch):
    real = grad_paths.GRAD_PATHS["one_shot"]

    def off(call):
        got = real.launch(call)
        got.lora_b[0].mul_(1.5)
        return got
    monkeypatch.setitem(grad_paths.GRAD_PATHS, "one_shot", dataclasses.replace(real, launcher=off))
    with pytest.raises(RuntimeError, match=r"tiny w13 M=3 r=4: path 'one_shot': gradient 4 .* off by up to"):
        cli.main(CASE + ["--ops", "w13", "--tokens", "3", "--out", str(tmp_path), "--paths", "two_kernel", "one_shot"])
