"""Nsight Compute's CSV report, parsed, and the ``dram`` sweep's rows built from it (no GPU needed)."""
import json

import pytest
import torch

from moelora_lab.bench import cli, dram_sweep
from moelora_lab.bench.ncu import METRICS, ncu_command, parse_ncu_csv
from moelora_lab.results import read_csv

HEADER = ["ID", "Process ID", "Kernel Name", "Grid Size", *METRICS]
UNITS = ["", "", "", "", "nsecond", "byte", "byte", "byte", "cycle/second"]


def report(kernels) -> str:
    """An ncu raw-page CSV: its own ==PROF== lines, header, units, then (range, grid, ns, read, write, l2, hz)."""
    q = lambda cells: ",".join(f'"{c}"' for c in cells)
    lines = ["==PROF== Connected to process 1", q(HEADER), q(UNITS)]
    for i, (name, grid, *values) in enumerate(kernels):
        lines.append(q([i, 1, name, grid, *(f"{v:,}" for v in values)]))
    return "\n".join(lines + ["==PROF== Disconnected from process 1"])


COPY = ("copy", "(1024, 1, 1)", 500_000, 1_073_741_824, 1_073_741_824, 2_200_000_000, 1_980_000_000)


def test_the_report_is_parsed_in_launch_order_with_units_and_thousands_separators():
    c0 = ("c0/one_shot_kernel", "(64, 2, 1)", 12_000, 30_000_000, 10_000_000, 90_000_000, 1_900_000_000)
    text = report([COPY, c0])
    copy, c0 = parse_ncu_csv(text)
    assert copy["range"] == "copy" and c0["range"] == "c0" and c0["kernel"] == "one_shot_kernel"
    assert c0["grid"] == "64x2x1"
    assert c0["duration_ns"] == 12_000 and c0["dram_read_bytes"] == 30_000_000 and c0["sm_hz"] == 1.9e9
    scaled = text.replace('"nsecond"', '"usecond"').replace('"byte"', '"mbyte"', 1)
    c0 = parse_ncu_csv(scaled)[1]
    assert c0["duration_ns"] == 12_000_000 and c0["dram_read_bytes"] == 30_000_000e6


def test_launch_statistics_give_waves_and_occupancy_where_the_report_has_them():
    launch = ["launch__waves_per_multiprocessor", "launch__occupancy_limit_blocks", "launch__occupancy_limit_registers",
              "launch__occupancy_limit_shared_mem", "launch__occupancy_limit_warps"]
    q = lambda cells: ",".join(f'"{c}"' for c in cells)
    text = "\n".join([q(HEADER + launch), q(UNITS + [""] * 5),
                      q([0, 1, "c0/k", "(8, 1, 1)", 10, 1, 1, 1, 1e9, "1.45", 32, 8, 9, 32]),
                      q([1, 1, "c0/k", "(8, 1, 1)", 30, 1, 1, 1, 1e9, "0.5", 32, 12, 6, 16])])
    one, two = parse_ncu_csv(text)
    assert one["waves"] == 1.45 and one["occupancy"] == 8 / 32 and two["occupancy"] == 6 / 16
    case = [dict(model_bytes=1, model_read_bytes=1)]
    [row] = dram_sweep.rows_from(parse_ncu_csv(report([COPY])) + [one, two], case, {})
    assert row["waves"] == round((1.45 * 10 + 0.5 * 30) / 40, 3)                 # weighted by duration
    assert row["occupancy"] == round((0.25 * 10 + 0.375 * 30) / 40, 3)
    # a report without launch statistics: the columns stay empty
    [row] = dram_sweep.rows_from(parse_ncu_csv(report([COPY, ("c0", *COPY[1:])])), case, {})
    assert row["occupancy"] == row["waves"] == ""


def test_a_report_without_the_metrics_or_with_an_unknown_unit_is_refused():
    with pytest.raises(ValueError, match="header"):
        parse_ncu_csv("==PROF== nothing profiled")
    with pytest.raises(ValueError, match="missing"):
        parse_ncu_csv(report([COPY]).replace("dram__bytes_read.sum", "dram__other"))
    with pytest.raises(ValueError, match="unit"):
        parse_ncu_csv(report([COPY]).replace('"byte"', '"furlong"', 1))


def test_the_command_profiles_only_the_ranges_and_leaves_the_clocks_alone():
    cmd = ncu_command("ncu", "/tmp/log.csv")
    assert cmd[cmd.index("--clock-control") + 1] == "none" and cmd[cmd.index("--profile-from-start") + 1] == "off"
    assert set(cmd[cmd.index("--metrics") + 1].split(",")) == set(METRICS)


def test_rows_split_the_gap_into_extra_bytes_and_rate():
    cases = [dict(op="w2", M=512, path="two_kernel", model_bytes=20_000_000, model_read_bytes=12_500_000)]
    kernels = parse_ncu_csv(report([COPY, ("c0", "(8, 1, 1)", 6_000, 15_000_000, 5_000_000, 0, 2e9),
                                    ("c0", "(16, 1, 1)", 4_000, 4_000_000, 6_000_000, 0, 1e9)]))
    [row] = dram_sweep.rows_from(kernels, cases, {"gpu": "test"})
    copy_tbps = 2 * 1_073_741_824 / 500_000 / 1e3                     # TB/s = bytes per ns / 1e3
    assert row["kernels"] == 2 and row["grids"] == "8x1x1;16x1x1" and row["duration_us"] == 10.0
    assert row["dram_over_model"] == 1.5 and row["dram_tbps"] == 3.0    # 30 MB in 10 us
    assert row["read_over_model"] == round(19 / 12.5, 4)
    assert row["rate_share"] == round(3.0 / copy_tbps, 4) and row["copy_dram_tbps"] == round(copy_tbps, 4)
    assert row["model_share"] == round(2.0 / copy_tbps, 4)              # the product of the two ratios
    assert row["sm_mhz"] == 1600 and row["gpu"] == "test"               # clock weighted by duration
    with pytest.raises(RuntimeError, match="case c1"):
        dram_sweep.rows_from(kernels, cases * 2, {})
    with pytest.raises(RuntimeError, match="copy"):
        dram_sweep.rows_from(kernels[1:], cases, {})


def test_a_saved_report_is_parsed_again_without_a_gpu(tmp_path):
    saved = dict(prov={"gpu": "NVIDIA H200", "command": "python -m moelora_lab.bench dram"},
                 cases=[dict(op="w13", M=2048, path="auto", model_bytes=1_000_000)],
                 ncu=report([COPY, ("c0", "(4, 1, 1)", 1_000, 600_000, 400_000, 0, 1.98e9)]))
    path = tmp_path / "lora_dram_report.json"
    path.write_text(json.dumps(saved))
    assert cli.main(["dram", "--from-report", str(path), "--out", str(tmp_path)]) == 0
    [row] = read_csv(tmp_path / "lora_dram.csv")
    assert row["dram_over_model"] == 1.0 and row["gpu"] == "NVIDIA H200" and row["duration_us"] == 1.0


def test_a_missing_ncu_names_the_option(monkeypatch):
    with pytest.raises(FileNotFoundError, match="--ncu"):
        dram_sweep.find_ncu("/nonexistent/ncu")
    monkeypatch.setattr(dram_sweep.shutil, "which", lambda *a, **k: None)
    monkeypatch.setattr(dram_sweep, "glob", lambda pattern: [])
    with pytest.raises(FileNotFoundError, match="--ncu PATH"):
        dram_sweep.find_ncu()


FAKE_NCU = '''#!{python}
"""Stands in for ncu: runs the program it is given (on the CPU, in this process) and writes a report
with one kernel for the copy and for each case the program recorded."""
import json, os, sys
os.environ.setdefault("TRITON_INTERPRET", "1")
args = sys.argv[1:]
log = args[args.index("--log-file") + 1]
program = args[args.index("--log-file") + 2:]
assert program[1:3] == ["-m", "moelora_lab.bench"], program
from moelora_lab.bench import cli, common
common.DEVICE = "cpu"
try:
    cli.main(program[3:])
except SystemExit as exc:
    assert exc.code == 0, exc.code
cases = json.load(open(program[program.index("--inner") + 1]))
q = lambda cells: ",".join('"%s"' % c for c in cells)
lines = [q({header}), q({units}), q([0, 1, "copy", "(9, 1, 1)", 1000, 2000000, 2000000, 0, 2e9])]
for i, case in enumerate(cases):
    lines.append(q([i + 1, 1, "c%d" % i, "(1, 1, 1)", 100, case["model_bytes"], 0, 0, 2e9]))
open(log, "w").write("\\n".join(lines))
'''


def test_the_sweep_runs_its_cases_under_ncu_and_keeps_the_raw_report(tmp_path):
    import sys
    if torch.cuda.is_available():
        pytest.skip("checks the CPU run of the pipeline (the stand-in runs the cases under the interpreter)")
    fake = tmp_path / "ncu"
    fake.write_text(FAKE_NCU.format(python=sys.executable, header=HEADER, units=UNITS))
    fake.chmod(0o755)
    from moelora_lab.bench import common
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(common, "DEVICE", "cpu")
        assert cli.main(["dram", "--ncu", str(fake), "--presets", "tiny", "--tokens", "6", "--ranks", "16",
                         "--ops", "w2", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "lora_dram.csv")
    assert [r["path"] for r in rows] == ["auto", "one_shot", "two_kernel"]
    assert all(r["op"] == "w2" and r["M"] == 6 and r["dram_over_model"] == 1.0 for r in rows)
    assert rows[0]["command"].startswith("python -m moelora_lab.bench dram") and "--ncu" in rows[0]["command"]
    saved = json.loads((tmp_path / "lora_dram_report.json").read_text())
    assert len(saved["cases"]) == 3 and '"copy"' in saved["ncu"]
