"""The training benchmark without a GPU: its parser, the floor model checked by hand, every variant's gradients
against the reference and hf_peft's against lab_lora's, and the rows the pipeline writes (wall-clock times on
the CPU, labelled ``device=cpu``; never a GPU's)."""
import math

import pytest
import torch

from moelora_lab import MoEShape
from moelora_lab.bench import cli, common, train_models, train_sweep
from moelora_lab.bench.train_models import VARIANTS, train_floor
from moelora_lab.config import benchmark_routing
from moelora_lab.profile.traffic import Workload, count_workload, layer_traffic
from moelora_lab.plots.training import train_time_lines
from moelora_lab.results import read_csv
from moelora_lab.train.peft_grads import relative_error

TINY = ["--presets", "tiny", "--ranks", "4", "--dtype", "float32"]
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="runs the lab's kernels on CPU tensors (interpreter)")


@pytest.fixture
def cpu_train(monkeypatch):
    monkeypatch.setattr(common, "DEVICE", "cpu")
    monkeypatch.setattr(train_sweep, "ROUNDS", 1)


def test_parser_defaults_and_choices():
    args = cli.parse_args(["train"])
    assert (args.presets, args.tokens, args.ranks, args.loras) == (["qwen3-30b-a3b"], [512, 2048, 4096, 8192],
                                                                   [16, 64], 1)
    assert args.variants == list(VARIANTS) and args.dtype == "bfloat16" and args.max_seconds == 1e9
    args = cli.parse_args(["train", "--tokens", "64", "--ranks", "8", "--loras", "3", "--variants", "hf_peft",
                           "lab_lora", "--max-seconds", "5"])
    assert (args.tokens, args.ranks, args.loras, args.variants, args.max_seconds) == ([64], [8], 3,
                                                                                     ["hf_peft", "lab_lora"], 5.0)
    with pytest.raises(SystemExit):
        cli.parse_args(["train", "--variants", "peft"])
    sub = next(a for a in cli.build_parser()._actions if a.dest == "what").choices["train"]
    assert "(default: 1)" in " ".join(sub.format_help().split())


def test_train_floor_by_hand():
    # H 4, I 3, E 2, k 1; 2 tokens on both experts, each with an adapter; r 1, 2 bytes per element
    shape = MoEShape(hidden=4, intermediate=3, num_experts=2, top_k=1)
    work = Workload(num_tokens=2, top_k=1, tokens_with_adapter=2, pairs_with_adapter=2, touched_adapter_experts=2,
                    touched_experts=2)
    f = train_floor(shape, 1, work, dtype_bytes=2)
    # rows M*H*b = 16; base 2 experts * 3*3*4 * 2 = 144; LoRA 2 * 3*1*(4+3) * 2 = 84
    assert (f.part("fwd_x"), f.part("fwd_base_weights"), f.part("fwd_lora_weights")) == (16, 144, 84)
    assert f.bytes_read == (16 + 144 + 84) + (16 + 16 + 144 + 84) and f.bytes_written == 16 + 16 + 84
    assert f.flops == 12 * 2 * 3 * 4 + 18 * 2 * 1 * 7 == 540            # base 12 P I H, LoRA 18 P_a r (H + I)
    base = train_floor(shape, 1, work, dtype_bytes=2, with_lora=False)
    assert (base.bytes_read, base.bytes_written, base.flops) == (16 + 144 + 16 + 16 + 144, 32, 288)
    # top-2 with one of two tokens on an adapter: FLOPs count P = 4 pairs and P_a = 2; the bytes do not change
    shape2 = MoEShape(hidden=4, intermediate=3, num_experts=2, top_k=2)
    work2 = Workload(num_tokens=2, top_k=2, tokens_with_adapter=1, pairs_with_adapter=2, touched_adapter_experts=2,
                     touched_experts=2)
    f2 = train_floor(shape2, 1, work2, dtype_bytes=2)
    assert f2.flops == 12 * 4 * 3 * 4 + 18 * 2 * 7 and f2.bytes == f.bytes
    with pytest.raises(ValueError, match="top_k"):
        train_floor(shape2, 1, work, dtype_bytes=2)


def test_train_floor_forward_half_is_the_layer_floor():
    shape = MoEShape.from_name("qwen3-30b-a3b")
    r = benchmark_routing(shape, 2, 512, 0)
    work = count_workload(r["topk_ids"], r["token_lora"], shape.num_experts, 2)
    for with_lora in (True, False):
        f = train_floor(shape, 16, work, with_lora=with_lora)
        layer = layer_traffic(shape, 16, work, with_lora=with_lora)["floor"]
        assert sum(n for name, n in f.parts if name.startswith("fwd_")) == layer.bytes
        assert f.flops == 12 * 512 * 8 * 768 * 2048 + with_lora * 18 * 512 * 8 * 16 * (2048 + 768)


@pytest.fixture(scope="module")
def two_adapter_case():
    """tiny, M 16, two adapters of rank 4 (both with tokens), float32 on the CPU."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(common, "DEVICE", "cpu")
        shape, gen = MoEShape.from_name("tiny"), common.seeded_generator(0)
        base = train_models.build_base(shape, torch.float32, 0, gen)
        adapters = train_models.build_adapters(base, 2, 4, 0, gen, torch.float32)
        yield train_models.build_case(base, adapters, 16, 2, 0, gen, torch.float32)


@cpu_only
def test_variants_give_the_reference_gradients(two_adapter_case):
    case = two_adapter_case
    assert set(case.token_lora.tolist()) == {0, 1}
    assert "experts=grouped_mm" in case.base.hf and case.adapters.model is not None
    ref = {"lora": train_models.reference_grads(case, True), "base": train_models.reference_grads(case, False)}
    got = {}
    for name in VARIANTS:
        v = train_models.build_variant(name, case)
        got[name] = v.step()
        want = v.want(ref)
        assert len(got[name]) == len(want) == {"lab_lora": 7, "hf_peft": 10}.get(name, 1), name
        assert all(torch.isfinite(g).all() for g in got[name]), name
        errors = [relative_error(g, w) for g, w in zip(got[name], want)]
        assert max(errors) < 1e-4, (name, errors)
    # hf_peft against lab_lora itself, in PEFT's layout (dx rows and both factors of each adapter)
    hf = train_models.build_variant("hf_peft", case)
    assert max(relative_error(g, w) for g, w in zip(got["hf_peft"], hf.want({"lora": got["lab_lora"]}))) < 1e-4


def test_grouped_mm_layer_says_when_torch_lacks_it(monkeypatch):
    shape = MoEShape.from_name("tiny")
    r = benchmark_routing(shape, 1, 6, 0)
    w13, w2 = torch.randn(8, 64, 64) / 8, torch.randn(8, 64, 32) / 6
    x = torch.randn(6, 64)
    y = train_models.grouped_mm_layer(x, r["topk_ids"], r["topk_weights"], w13, w2)
    from moelora_lab import moe_layer_reference
    no = torch.full((6,), -1, dtype=torch.int32)
    empty = [torch.zeros(1, 8, 1, 64)] * 2, [torch.zeros(1, 8, 32, 1)] * 2, [torch.zeros(1, 8, 1, 32)], \
        [torch.zeros(1, 8, 64, 1)]
    want = moe_layer_reference(x, r["topk_ids"], r["topk_weights"], no, w13, w2, *empty)
    assert relative_error(y, want) < 1e-5
    monkeypatch.delattr(torch, "_grouped_mm")
    with pytest.raises(RuntimeError, match=r"torch._grouped_mm is missing in torch .*; it needs torch >= 2.8"):
        train_models.grouped_mm_layer(x, r["topk_ids"], r["topk_weights"], w13, w2)


@cpu_only
def test_pipeline_rows_on_the_cpu(cpu_train, tmp_path):
    assert cli.main(["train", *TINY, "--tokens", "16", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "train.csv")
    assert [r["variant"] for r in rows] == list(VARIANTS)
    assert list(rows[0]) == [
        "preset", "M", "rank", "loras", "adapters", "variant", "impl", "grads", "us_median", "us_p20", "us_p80", "peak_mib",
        "floor_bytes", "floor_flops", "floor_us", "roofline_us", "lora_share_time", "lora_share_bytes",
        "lora_share_flops", "grad_rel_err", "error", "sm_mhz_min", "sm_mhz_mean", "power_w_mean", "power_w_max",
        "temp_c_max", "device", "dtype", "copy_tbps", "matmul_tflops", "gpu", "torch", "triton", "python", "date",
        "command", "schema", "config", "code"]
    by = {r["variant"]: r for r in rows}
    shape = MoEShape.from_name("tiny")
    r = benchmark_routing(shape, 1, 16, 0)
    work = count_workload(r["topk_ids"], r["token_lora"], shape.num_experts, 1)
    for row in rows:
        assert (row["preset"], row["M"], row["rank"], row["loras"], row["error"]) == ("tiny", 16, 4, 1, "")
        assert (row["device"], row["gpu"], row["peak_mib"], row["floor_us"], row["copy_tbps"]) == \
            ("cpu", "none (CPU)", "", "", "")                     # a CPU run says so and invents no GPU numbers
        assert 0 < row["us_p20"] <= row["us_median"] <= row["us_p80"] and row["grad_rel_err"] < 1e-4
        lora = row["variant"] in ("lab_lora", "hf_peft")
        fl = train_floor(shape, 4, work, dtype_bytes=4, with_lora=lora)
        assert (row["floor_bytes"], row["floor_flops"]) == (fl.bytes, fl.flops)
        assert row["grads"] == ("x+lora" if lora else "x") and (row["lora_share_time"] == "") != lora
    base_fl = train_floor(shape, 4, work, dtype_bytes=4, with_lora=False)
    assert by["lab_lora"]["lora_share_bytes"] == round(1 - base_fl.bytes / by["lab_lora"]["floor_bytes"], 4)
    assert by["hf_peft"]["lora_share_flops"] == round(1 - base_fl.flops / by["hf_peft"]["floor_flops"], 4)
    # what notebook 09 prints of such data: the lab's step against HF + PEFT's, no memory invented on the CPU
    line = train_time_lines(rows)[1].split()
    assert line[:2] == ["4", "16"] and line[4] == f"{by['lab_lora']['us_median'] / by['hf_peft']['us_median']:.2f}"
    assert line[5:] == ["-", "-"]
    lab, lab_base = by["lab_lora"]["us_median"], by["lab_base"]["us_median"]
    assert math.isclose(by["lab_lora"]["lora_share_time"], (lab - lab_base) / lab, abs_tol=1e-4)
    assert by["lab_lora"]["impl"] == "moe_lora_layer schedule=sequential" and by["grouped_mm_base"]["impl"] == \
        "torch._grouped_mm"
    assert "experts=grouped_mm" in by["hf_base"]["impl"] and "peft" in by["hf_peft"]["impl"]
    assert rows[0]["command"] == "python -m moelora_lab.bench train " + " ".join(TINY) + " --tokens 16"


@cpu_only
def test_rows_record_wrong_gradients_and_missing_grouped_mm(cpu_train, tmp_path, monkeypatch, capsys):
    """A backward off by 10% is flagged in its row (its time kept); a missing torch._grouped_mm is a row error;
    a spent budget stops after the first case."""
    real = train_sweep.reference_grads
    monkeypatch.setattr(train_sweep, "reference_grads", lambda case, lora: [g * 1.1 for g in real(case, lora)])

    def missing(*args):
        raise RuntimeError("torch._grouped_mm is missing in torch 0.0; it needs torch >= 2.8")

    monkeypatch.setattr(train_models, "grouped_mm_layer", missing)
    assert cli.main(["train", *TINY, "--tokens", "8", "16", "--variants", "grouped_mm_base", "hf_base",
                     "--max-seconds", "0", "--out", str(tmp_path)]) == 0
    assert "time budget of 0.0 s spent" in capsys.readouterr().err
    rows = {r["variant"]: r for r in read_csv(tmp_path / "train.csv")}
    assert set(rows) == {"grouped_mm_base", "hf_base"} and {r["M"] for r in rows.values()} == {8}
    hf, gmm = rows["hf_base"], rows["grouped_mm_base"]
    assert hf["us_median"] > 0 and math.isclose(hf["grad_rel_err"], 0.1 / 1.1, rel_tol=1e-2)
    assert hf["error"].startswith("gradients differ from the reference: relative error 0.0909 > 0.001")
    assert gmm["error"] == "RuntimeError: torch._grouped_mm is missing in torch 0.0; it needs torch >= 2.8"
    assert gmm["us_median"] == "" and gmm["floor_bytes"] > 0
