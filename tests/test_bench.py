"""The benchmark pipeline end to end on the CPU: every subcommand runs its real code paths (kernels
under the interpreter), with the GPU timer replaced by a stub, and writes its CSV and plots.

The stub only stands in for CUDA events; the numbers it returns are never committed anywhere."""
import pytest
import torch

import moelora_lab.profile.timing as timing
from moelora_lab import lesson
from moelora_lab.bench import cli, common, eager_sweep, gemm_sweep, tune_sweep
from moelora_lab.results import DATA_SCHEMA, config_fingerprint, read_csv


@pytest.fixture
def cpu_bench(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU run of the pipeline")
    calls = []

    def fake_time(fn, **kw):
        fn()                                  # the op itself runs, so its code path is exercised
        calls.append(fn)
        return timing.Timing(10.0, 9.0, 11.0)

    monkeypatch.setattr(common, "DEVICE", "cpu")
    monkeypatch.setattr(timing, "time_cuda", fake_time)
    def fake_interleaved(fns, **kw):        # records each case's names: the layer sweep times them together
        calls.append(tuple(fns))
        return {n: fake_time(f) for n, f in fns.items()}

    monkeypatch.setattr(timing, "time_cuda_interleaved", fake_interleaved)
    monkeypatch.setattr(timing, "copy_bandwidth", lambda *a, **k: 4.0e12)
    monkeypatch.setattr(timing, "matmul_rate", lambda *a, **k: 7.0e14)
    monkeypatch.setattr(timing, "fp8_matmul_rate", lambda *a, **k: 1.4e15)
    return calls


@pytest.mark.slow
def test_kernels_and_align_pipeline(cpu_bench, tmp_path):
    assert cli.main(["kernels", "--presets", "tiny", "--tokens", "1", "6", "--ranks", "16", "--out",
                       str(tmp_path), "--time-alignment"]) == 0
    rows = read_csv(tmp_path / "kernels.csv")
    assert {r["path"] for r in rows} == {"two_kernel", "one_shot", "small_batch", "auto", "align"}
    assert len(rows) == 2 * 2 * 5 and all(r["us_median"] == 10.0 for r in rows)
    together = [c for c in cpu_bench if isinstance(c, tuple)]
    assert len(together) == 2 * 2 and all(len(c) == 4 for c in together)   # per (op, M): the four paths at once
    one = [r for r in rows if r["path"] == "one_shot"][0]
    assert one["bytes"] > 0 and one["achieved_tbps"] > 0 and one["command"].startswith("python -m moelora_lab.bench")
    assert (tmp_path / "kernels_tiny.png").exists() and (tmp_path / "kernels_roofline.png").exists()
    # every path is checked against the reference before it is timed: a wrong result stops the sweep
    from moelora_lab.bench import kernels_sweep
    real_reference = kernels_sweep.moe_lora_reference
    off = lambda *a, **kw: real_reference(*a, **kw) * 1.1
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels_sweep, "moe_lora_reference", off)
        with pytest.raises(RuntimeError, match=r"tiny w13 M=1 r=16: path 'two_kernel' .* differs from the reference"):
            cli.main(["kernels", "--presets", "tiny", "--tokens", "1", "--ranks", "16", "--out", str(tmp_path / "x")])
    assert cli.main(["align", "--presets", "tiny", "--tokens", "3", "200", "1000", "--out", str(tmp_path)]) == 0
    methods = {(r["M"], r["method"]) for r in read_csv(tmp_path / "align.csv")}
    # the rule's construction (triton_kernels) and the others where they compete: few pairs sort (3 x 2), a
    # few hundred recount (200 x 2), more run three launches (1000 x 2)
    assert {m for M, m in methods if M == 3} == {"torch_ops", "triton_kernels", "triton_recount", "triton_three"}
    assert {m for M, m in methods if M == 200} == {"torch_ops", "triton_kernels", "triton_sort", "triton_three"}
    assert {m for M, m in methods if M == 1000} == {"torch_ops", "triton_kernels", "triton_sort", "triton_recount",
                                                   "triton_unchained"}


def test_layer_side_path_variant(cpu_bench, tmp_path):
    """``dual_stream_side`` runs two streams from a plan made for them: at 40 pairs and r 8 the side
    stream's rule takes two kernels where the shared one-stream plan runs one-shot."""
    with pytest.warns(RuntimeWarning, match="on the CPU the layer runs 'sequential'"):
        assert cli.main(["layer", "--presets", "tiny", "--tokens", "20", "--ranks", "8", "--dtype", "float32",
                         "--variants", "no_lora", "dual_stream", "dual_stream_side", "--trace-tokens", "0",
                         "--name", "side", "--out", str(tmp_path)]) == 0
    rows = {r["variant"]: r for r in read_csv(tmp_path / "side.csv")}
    assert set(rows) == {"no_lora", "dual_stream", "dual_stream_side"}
    assert rows["dual_stream"]["lora_path"] == "one_shot" and rows["dual_stream_side"]["lora_path"] == "two_kernel"
    assert rows["dual_stream_side"]["schedule"] == "sequential"                        # CPU: one stream


def test_layer_ceiling_at_each_cases_clock(cpu_bench, tmp_path, monkeypatch):
    """The matmul ceiling is read with the clock it ran at and scaled to each case's clock (here both 1500)."""
    from moelora_lab.profile import gpu_state
    monkeypatch.setattr(gpu_state, "default_reader", lambda: lambda: (1500.0, 400.0, 50.0))
    assert cli.main(["layer", "--presets", "tiny", "--tokens", "3", "--ranks", "8", "--dtype", "float32",
                     "--variants", "no_lora", "sequential", "in_k_act", "--trace-tokens", "0",
                     "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "layer.csv")
    ran = ["no_lora", "sequential", "in_k_act"]
    assert [r["variant"] for r in rows] == [r["schedule"] or "no_lora" for r in rows] == ran
    assert {r["matmul_sm_mhz"] for r in rows} == {1500} and {r["matmul_tflops_at_clock"] for r in rows} == {700.0}
    assert all(r["roofline_clock_us"] == r["roofline_us"] for r in rows)


def test_layer_pipeline(cpu_bench, tmp_path):
    with pytest.warns(RuntimeWarning, match="on the CPU the layer runs 'sequential'"):   # the dual_stream rows
        assert cli.main(["layer", "--presets", "tiny", "--tokens", "3", "--ranks", "8", "--dtype", "float32",
                           "--trace-tokens", "3", "--trace-ranks", "8", "--trace-events", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "layer.csv")
    together = [c for c in cpu_bench if isinstance(c, tuple)]
    assert len(together) == 1 and set(together[0]) == {r["variant"] for r in rows}   # one case: all variants at once
    timed = {r["variant"] for r in rows if r["us_median"] != ""}
    assert {"no_lora", "sequential", "dual_stream", "fused", "auto", "sequential_vllm_join",
            "dual_stream_vllm_join", "base_gemms", "plan"} <= timed
    assert {r["lora_path"] for r in rows if r["variant"] == "fused"} == {"in_gemm"}
    ran = {r["variant"]: r["schedule"] for r in rows}
    assert ran["auto"] == ran["dual_stream_vllm_join"] == "sequential" and ran["fused"] == "fused"   # CPU: one stream
    assert ran["no_lora"] == ""
    assert {r["side_priority"] for r in rows if r["schedule"] != "dual_stream"} == {""}   # CPU: no side stream
    assert all(r["roofline_us"] >= r["floor_us"] > 0 for r in rows) and (tmp_path / "layer_tiny.png").exists()
    assert {(r["matmul_sm_mhz"], r["matmul_tflops_at_clock"], r["roofline_clock_us"]) for r in rows} == {("", "", "")}
    assert not (tmp_path / "layer_traces.json").exists()      # timelines need CUDA events: none on the CPU
    assert not list(tmp_path.glob("*.trace.json"))


def test_gemm_tile_grid_pipeline(cpu_bench, tmp_path, monkeypatch):
    monkeypatch.setattr(gemm_sweep, "TILE_GRID", ((64, 128, 2, 4),))
    assert cli.main(["gemm", "--presets", "tiny", "--tokens", "2", "--dtype", "float32", "--lora-rank", "8",
                       "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "gemm_tune.csv")
    # w13 and w2, without and with the in-GEMM LoRA, the default tiles and the one grid entry
    assert len(rows) == 2 * 2 * 2 and all(r["error"] == "" and r["us_median"] == 10.0 for r in rows)
    assert {(r["op"], r["lora_rank"], r["rule_at_run"]) for r in rows} == {
        (op, rank, d) for op in ("w13", "w2") for rank in (0, 8) for d in ("True", "False")}


def test_gemm_rule_tiles_with_and_without_tma(cpu_bench, tmp_path):
    assert cli.main(["gemm", "--presets", "tiny", "--tokens", "2", "--dtype", "float32", "--lora-rank", "8",
                     "--rule-only", "--w-tma", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "gemm_tune.csv")
    # w13 and w2, without and with the in-GEMM LoRA, the rule's tiles with pointer and with TMA loads of W
    assert len(rows) == 2 * 2 * 2 and all(r["error"] == "" and r["rule_at_run"] == "True" for r in rows)
    assert sorted(r["w_tma"] for r in rows) == ["False"] * 4 + ["True"] * 4


def test_registers_on_cpu_records_the_reason(cpu_bench, tmp_path):
    assert cli.main(["registers", "--ranks", "16", "--block-m", "16", "--max-block-r", "128",
                       "--out", str(tmp_path)]) == 0
    (row,) = read_csv(tmp_path / "registers.csv")
    assert "needs a CUDA GPU" in row["error"]


def test_lora_tile_walk_pipeline(cpu_bench, tmp_path, monkeypatch):
    monkeypatch.setattr(tune_sweep, "AXES", {"block_k": (32, 64), "n_chunks": (1, 2), "block_m": (16,)})
    assert cli.main(["tune", "--presets", "tiny", "--tokens", "3", "--ranks", "8", "--ops", "w2",
                       "--dtype", "float32", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "lora_tune.csv")
    for path in ("one_shot", "two_kernel"):
        mine = [r for r in rows if r["path"] == path]
        assert sum(r["rule"] == "True" for r in mine) == 1 and sum(r["best"] == "True" for r in mine) >= 1
        assert all(r["error"] == "" and r["us_median"] == 10.0 for r in mine)
        keys = [tuple(r[f] for f in tune_sweep.TILE_FIELDS) for r in mine]
        assert len(keys) == len(set(keys))                     # every config is timed once
    # the walk tries each value of each axis once (n_chunks only for the one-shot kernel)
    assert {r["block_k"] for r in rows} >= {32, 64}
    assert {r["n_chunks"] for r in rows if r["path"] == "one_shot"} >= {1, 2}


def test_lora_tile_walk_keeps_the_fastest(monkeypatch):
    from moelora_lab.op.dispatch import KernelConfig

    cost = {64: 5.0, 128: 3.0, 256: None}             # None: the tile failed (never chosen)

    def measure(cfg):
        us = cost.get(cfg.block_k, 9.0)
        return None if us is None else us + (0.5 if cfg.num_warps == 8 else 1.0)

    monkeypatch.setattr(tune_sweep, "AXES", {"block_k": (64, 128, 256), "num_warps": (4, 8)})
    best, us = tune_sweep._walk(KernelConfig(block_k=64, num_warps=4), "one_shot", 1, measure)
    assert (best.block_k, best.num_warps, us) == (128, 8, 3.5)


def test_b_layout_pipeline(cpu_bench, tmp_path):
    assert cli.main(["layout", "--presets", "tiny", "--tokens", "3", "--ranks", "8", "--dtype", "float32",
                       "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "b_layout.csv")
    assert {(r["op"], r["b_layout"]) for r in rows} == {(op, lay) for op in ("w13", "w2")
                                                       for lay in ("r_fastest", "n_fastest")}


def test_expand_pipeline(cpu_bench, tmp_path):
    """bench expand: every build of the one-shot kernel is checked, then timed with the others of its case
    (both_slices only where there are two slices), with B as given and packed."""
    from moelora_lab.bench import expand_sweep
    assert cli.main(["expand", "--presets", "tiny", "--tokens", "3", "--packed-tokens", "3", "--ranks", "8",
                     "--dtype", "float32", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "one_shot_build.csv")
    w13 = list(expand_sweep.VARIANTS)
    w2 = [v for v in w13 if not expand_sweep.VARIANTS[v][1]]
    assert [r["variant"] for r in rows] == (w13 + w13 + w2 + w2)
    assert {r["b_layout"] for r in rows} == {"r_fastest", "n_fastest"}
    before = next(r for r in rows if r["variant"] == "before")
    assert (before["clamp_ranks"], before["prefetch_out"]) == ("True", "False")      # CSV text
    assert [c for c in cpu_bench if isinstance(c, tuple)] == [tuple(w13)] * 2 + [tuple(w2)] * 2


def test_expand_refuses_a_wrong_build(cpu_bench, tmp_path, monkeypatch):
    """A build that computes a wrong result stops the sweep before anything is timed."""
    from moelora_lab.bench import expand_sweep
    monkeypatch.setattr(expand_sweep, "close", lambda got, want: False)
    with pytest.raises(RuntimeError, match="the before build computes a wrong result"):
        cli.main(["expand", "--presets", "tiny", "--tokens", "3", "--ranks", "8", "--dtype", "float32",
                  "--out", str(tmp_path)])


def test_in_k_pipeline(cpu_bench, tmp_path):
    """bench in_k: w2's LoRA in K checked against two streams, then timed with the others of its case."""
    from moelora_lab.bench import in_k_sweep
    with pytest.warns(RuntimeWarning, match="on the CPU the layer runs 'sequential'"):   # the dual_stream rows
        assert cli.main(["in_k", "--presets", "tiny", "--tokens", "3", "--ranks", "4", "--dtype", "float32",
                           "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "layer_in_k.csv")
    assert [r["variant"] for r in rows] == list(in_k_sweep.VARIANTS)
    assert [c for c in cpu_bench if isinstance(c, tuple)] == [tuple(in_k_sweep.VARIANTS)]


def test_eager_pipeline(cpu_bench, tmp_path, monkeypatch):
    """bench eager: every way of calling the op and the layer runs (GPU clock and sync counter stubbed)."""
    monkeypatch.setattr(eager_sweep, "eager_us", lambda fn, calls: [fn(), 99.0][1])
    monkeypatch.setattr(eager_sweep, "syncs_per_call", lambda fn: [fn(), 0][1])
    assert cli.main(["eager", "--presets", "tiny", "--tokens", "3", "--ranks", "4", "--dtype", "float32",
                       "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "eager.csv")
    assert {(r["what"], r["way"]) for r in rows} == {(w, v) for w in ("op", "layer") for v in eager_sweep.WAYS}


def test_recorded_command_leaves_out_the_output_folder(cpu_bench, tmp_path):
    assert common.command_line(["layer", "--out", "/x", "--ranks", "16"]) == "python -m moelora_lab.bench layer --ranks 16"
    assert common.command_line(["align", f"--out={tmp_path}"]) == "python -m moelora_lab.bench align"
    assert cli.main(["align", "--presets", "tiny", "--tokens", "4", "--out", str(tmp_path)]) == 0
    row = read_csv(tmp_path / "align.csv")[0]
    assert row["command"] == "python -m moelora_lab.bench align --presets tiny --tokens 4"
    assert (row["schema"], row["config"]) == (DATA_SCHEMA, config_fingerprint()) and row["code"]


def test_adapter_assignment_reaches_the_routing_and_every_row(cpu_bench, tmp_path, monkeypatch):
    seen = []
    real = common.benchmark_routing

    def spy(*a, **kw):
        seen.append(a[4] if len(a) > 4 else kw.get("adapters", "uniform"))
        return real(*a, **kw)

    monkeypatch.setattr(common, "benchmark_routing", spy)
    for how in ("distinct", "uniform"):
        args = ["align", "--presets", "tiny", "--tokens", "8", "--out", str(tmp_path / how)]
        assert cli.main(args + (["--adapters", how] if how == "distinct" else [])) == 0   # uniform: the default
        assert set(seen) == {how} and {r["adapters"] for r in read_csv(tmp_path / how / "align.csv")} == {how}
        seen.clear()
    with pytest.raises(SystemExit):
        cli.parse_args(["layer", "--adapters", "round_robin"])


def test_every_subcommand_parses_its_defaults():
    from moelora_lab.bench import layer_sweep
    assert list(cli.SUBCOMMANDS) == ["kernels", "registers", "layer", "align", "gemm", "eager", "tune", "layout",
                                    "expand", "profiler", "in_k", "dram", "train", "grad"]
    for what, module in cli.SUBCOMMANDS.items():
        args = cli.parse_args([what])
        assert args.what == module.NAME == what and args.command == f"python -m moelora_lab.bench {what}"
        assert args.out == common.DEFAULT_OUT and callable(module.run)
    assert cli.parse_args(["layer"]).variants == [v for v in layer_sweep.VARIANTS if v not in layer_sweep.BY_NAME]
    assert {"dual_stream_side", "in_join", "in_k_act"} <= set(layer_sweep.BY_NAME)       # asked for by name
    assert cli.parse_args(["layer", "--variants", "plan", "no_lora"]).variants == ["plan", "no_lora"]
    with pytest.raises(SystemExit):
        cli.parse_args(["layer", "--variants", "no_such_variant"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the benchmark's answer on a machine without CUDA")
def test_live_data_runs_the_benchmark_command(tmp_path, capsys):
    """lesson.data(live=True) runs `python -m moelora_lab.bench` as its own process and reports its failure."""
    with pytest.raises(RuntimeError, match=r"bench align --presets tiny failed \(exit 2\):\n.*needs a GPU"):
        lesson.data("align", live=True, bench=["align", "--presets", "tiny"])
    assert "needs a GPU" in capsys.readouterr().err       # its messages are printed as they come


def test_layer_base_option_and_fp8_refusals():
    """--base parses (default: x's dtype), and on an FP8 base only the variants whose schedule serves it run."""
    from moelora_lab.bench import layer_sweep
    from moelora_lab.layer.table import SCHEDULES
    args = cli.parse_args(["layer"])
    assert args.base == "dtype" and layer_sweep.output_name(args) == "layer"
    fp8 = cli.parse_args(["layer", "--base", "fp8"])
    assert fp8.base == "fp8" and layer_sweep.output_name(fp8) == "layer_fp8"          # never over the bf16 file
    assert layer_sweep.output_name(cli.parse_args(["layer", "--base", "fp8", "--name", "mine"])) == "mine"
    with pytest.raises(SystemExit):
        cli.parse_args(["layer", "--base", "int8"])
    serving = {v for v in layer_sweep.VARIANTS if layer_sweep.fp8_refusal(v) is None}
    assert serving == {"no_lora", "sequential", "dual_stream", "dual_stream_side", "sequential_vllm_join",
                       "dual_stream_vllm_join", "plan", "no_lora_plan"}
    assert layer_sweep.fp8_refusal("in_k") == SCHEDULES["in_k"].refuses_fp8()
    assert "in_k pack" in layer_sweep.fp8_refusal("auto") and "bf16" in layer_sweep.fp8_refusal("base_gemms")


def test_layer_fp8_pipeline(cpu_bench, tmp_path, monkeypatch, capsys):
    """bench layer --base fp8 on the CPU: the FP8 GEMM runs in the timed callables, the refusing variants are
    skipped with one line each, rows record their base, and the FP8 floor reads fewer weight bytes."""
    from moelora_lab.bench import layer_sweep
    from moelora_lab.quant import gemm
    launched = []
    real = gemm.moe_gemm_fp8
    monkeypatch.setattr(gemm, "moe_gemm_fp8", lambda *a, **kw: [launched.append(1), real(*a, **kw)][1])
    case = ["layer", "--presets", "tiny", "--tokens", "3", "--ranks", "8", "--dtype", "float32", "--trace-tokens",
            "0", "--out", str(tmp_path)]
    with pytest.warns(RuntimeWarning, match="on the CPU the layer runs 'sequential'"):
        assert cli.main(case + ["--base", "fp8"]) == 0
    skipped = [line for line in capsys.readouterr().err.splitlines() if line.startswith("--base fp8: skipping")]
    refused = [v for v in layer_sweep.DEFAULT_VARIANTS if layer_sweep.fp8_refusal(v)]
    assert [line.split()[3].rstrip(":") for line in skipped] == refused and "in_k" in refused
    assert launched                                     # the layer's base GEMMs ran in FP8
    rows = read_csv(tmp_path / "layer_fp8.csv")
    assert not (tmp_path / "layer.csv").exists()
    assert [r["variant"] for r in rows] == [v for v in layer_sweep.DEFAULT_VARIANTS if v not in refused]
    assert {r["base"] for r in rows} == {"fp8"} and all(r["us_median"] == 10.0 for r in rows)
    assert {r["matmul_tflops"] for r in rows} == {1400.0}          # the FP8 rate is an FP8 row's ceiling
    with pytest.warns(RuntimeWarning, match="on the CPU the layer runs 'sequential'"):
        assert cli.main(case + ["--variants", "no_lora", "sequential", "dual_stream"]) == 0
    bf = {r["variant"]: r for r in read_csv(tmp_path / "layer.csv")}
    assert {r["base"] for r in bf.values()} == {"float32"} and {r["matmul_tflops"] for r in bf.values()} == {700.0}
    for r in rows:
        if r["variant"] in bf:                            # 1 byte a weight (+ scales) against 4
            assert 0 < r["floor_bytes"] < bf[r["variant"]]["floor_bytes"]


def test_layer_fp8_ceiling_falls_back_to_bf16_by_name(monkeypatch, capsys):
    from moelora_lab.bench import layer_sweep
    monkeypatch.setattr(timing, "matmul_rate", lambda dtype=None, **k: {torch.bfloat16: 7.0e14}.get(dtype, 3.0e14))

    def no_fp8(*a, **k):
        raise RuntimeError("no FP8 matmul on this GPU\nmore detail")
    monkeypatch.setattr(timing, "fp8_matmul_rate", no_fp8)
    assert layer_sweep.matmul_ceiling(torch.float16, fp8=True) == 7.0e14
    assert "no FP8 matmul rate (no FP8 matmul on this GPU); the roofline uses the bf16 rate" in capsys.readouterr().err
    assert layer_sweep.matmul_ceiling(torch.float16, fp8=False) == 3.0e14


def test_fp8_matmul_rate_runs_on_a_gpu_and_says_so_on_the_cpu():
    if torch.cuda.is_available():                      # the GPU suite: torch._scaled_mm as the rate calls it
        assert timing.fp8_matmul_rate(n=512) > 0
    else:
        with pytest.raises(RuntimeError, match="^fp8_matmul_rate needs a CUDA GPU"):
            timing.fp8_matmul_rate(n=16)
