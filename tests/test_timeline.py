import json
import shlex

import pytest

from moelora_lab.config import MoEShape
from moelora_lab.plots.traffic import sweep_workload
from moelora_lab.profile.timeline import achieved_gbps, bench_workload, overlap_metrics, save_traces, stage_model
from moelora_lab.profile.traffic import layer_traffic
from moelora_lab.results import load_traces, stamp

REC = [
    dict(stream="main", name="base_w13", start_us=0.0, end_us=10.0),
    dict(stream="lora", name="lora_w13", start_us=2.0, end_us=8.0),
    dict(stream="main", name="act", start_us=10.0, end_us=12.0),
    dict(stream="main", name="base_w2", start_us=12.0, end_us=20.0),
    dict(stream="lora", name="lora_w2", start_us=18.0, end_us=26.0),
    dict(stream="main", name="sum", start_us=26.0, end_us=27.0),
]


def test_overlap_metrics_by_hand():
    m = overlap_metrics(REC)
    # main busy: [0,20] + [26,27] = 21; lora busy: 6 + 8 = 14; both: [2,8] + [18,20] = 8
    assert (m["main_busy_us"], m["side_busy_us"], m["both_busy_us"]) == (21.0, 14.0, 8.0)
    assert m["overlap"] == pytest.approx(8 / 14, abs=1e-4)
    assert m["critical_path_us"] == 27.0 and m["serial_sum_us"] == 35.0


def test_overlap_metrics_sequential_and_errors():
    seq = [dict(stream="main", name="a", start_us=0, end_us=5), dict(stream="lora", name="b", start_us=5, end_us=9)]
    assert overlap_metrics(seq)["overlap"] == 0.0
    with pytest.raises(ValueError, match="records: empty timeline"):
        overlap_metrics([])
    with pytest.raises(ValueError, match="ends before it starts"):
        overlap_metrics([dict(stream="main", name="a", start_us=3, end_us=1)])


def test_traces_round_trip(tmp_path):
    path = tmp_path / "t.json"
    save_traces({"case": dict(meta={"M": 16, **stamp()}, records=REC)}, path)
    assert load_traces("t", tmp_path)["case"]["records"][1]["name"] == "lora_w13"
    path.write_text(json.dumps({"bad": {"records": []}}))
    with pytest.raises(ValueError, match="case 'bad' lacks 'meta' or 'records'"):
        load_traces("t", tmp_path)


def test_committed_h200_traces():
    """The committed layer timelines: every case of layer.csv inside the trace grid of the command that
    took them, once per schedule that fits; sequential never overlaps; two streams do; metrics recompute."""
    from moelora_lab.bench.cli import parse_args
    from moelora_lab.layer import fused_fits
    from moelora_lab.plots.layer import trace_name
    from moelora_lab.results import load

    traces = load_traces()
    commands = {t["meta"]["command"] for t in traces.values()}
    rows = load("layer")
    assert commands == {r["command"] for r in rows}, "the traces and layer.csv come from one run"
    argv = shlex.split(commands.pop())
    assert argv[:4] == ["python", "-m", "moelora_lab.bench", "layer"]
    args = parse_args(argv[3:])
    cases = {(r["preset"], r["M"], r["rank"], r["loras"]) for r in rows if r["variant"] == "sequential"
             and r["M"] in args.trace_tokens and r["rank"] in args.trace_ranks}
    expected = {trace_name(preset, M, rank, s) for preset, M, rank, L in cases
                for s in ("sequential", "dual_stream") + (("fused", "epilogue") if fused_fits(L, rank) else ())}
    assert len(cases) >= 4 and set(traces) == expected
    assert {t["meta"]["rank"] for t in traces.values() if t["meta"]["schedule"] == "fused"} == {
        rank for _, _, rank, L in cases if fused_fits(L, rank)}
    for name, t in traces.items():
        meta = t["meta"]
        assert name == trace_name(meta["preset"], meta["M"], meta["rank"], meta["schedule"])
        assert meta["gpu"] == "NVIDIA H200" and meta["triton"] and meta["torch"] and meta["floor_us"] > 0
        m = overlap_metrics(t["records"])
        assert m == t["metrics"]
        if meta["schedule"] == "fused":             # the LoRA rides in the GEMMs: one lane, four stages
            assert {r["stream"] for r in t["records"]} == {"main"}
            assert [r["name"] for r in t["records"]] == ["w13+lora", "act", "w2+lora", "sum"]
            assert m["side_busy_us"] == 0 and m["critical_path_us"] >= 0.99 * m["serial_sum_us"]
            continue
        if meta["schedule"] == "epilogue":          # one lane: each op's shrink, then the GEMM that expands it
            assert {r["stream"] for r in t["records"]} == {"main"}
            assert [r["name"] for r in t["records"]] == ["shrink_w13", "w13+lora", "act", "shrink_w2", "w2+lora", "sum"]
            assert m["side_busy_us"] == 0 and m["critical_path_us"] >= 0.99 * m["serial_sum_us"]
            continue
        assert {r["stream"] for r in t["records"]} == {"main", "lora"}
        assert [r["name"] for r in t["records"]] == ["base_w13", "lora_w13", "act", "base_w2", "lora_w2", "sum"]
        if meta["schedule"] == "sequential":
            assert m["overlap"] == 0.0 and m["critical_path_us"] >= 0.99 * m["serial_sum_us"]
        else:
            assert m["overlap"] > 0.5 and m["critical_path_us"] < m["serial_sum_us"]


def test_stage_model_tiles_by_hand():
    """M = 1, r = 16 on 132 SMs: 8 pairs in 8 (adapter, expert) groups, one pair each: decode tiles, narrow
    rank (2 warps; at most 16 pairs: BLOCK_K 512). On one stream 8 blocks x 2 slices want ceil(528 / 16) = 33
    programs each, more than the 6 128-wide tiles of N = 768, so BLOCK_N 64 and min(33, 12) = 12 chunks; w2
    (N = 2048, one slice): ceil(528 / 8) = 66 wanted, min(66, 32) = 32 chunks. On the side stream (at most 32
    pairs) 64 programs per op: w13 ceil(64 / 16) = 4 chunks, w2 ceil(64 / 8) = 8, both of 128 columns.
    Base GEMMs: 8/128 pairs per expert, 16 x 128 x 128."""
    meta = dict(preset="qwen3-30b-a3b", M=1, rank=16, loras=4, schedule="dual_stream", lora_path="one_shot")
    model = stage_model(meta)
    alone = stage_model(dict(meta, schedule="sequential"))
    assert list(model) == ["base_w13", "lora_w13", "act", "base_w2", "lora_w2", "sum"]
    lora = dict(block_m=16, block_n=64, block_k=512, max_block_r=128, num_warps=2, num_stages=3, BLOCK_R=16,
                RANK_TILES=1)
    assert alone["lora_w13"]["tiles"] == dict(lora, n_chunks=12) and model["lora_w13"]["kernel"] == "one_shot_kernel"
    assert alone["lora_w2"]["tiles"] == dict(lora, n_chunks=32)
    assert model["lora_w13"]["tiles"] == dict(lora, block_n=128, n_chunks=4)
    assert model["lora_w2"]["tiles"] == dict(lora, block_n=128, n_chunks=8)
    assert model["base_w2"]["tiles"] == dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3,
                                             W_TMA="auto")
    assert model["act"]["tiles"] == {} and model["sum"]["kernel"] == "topk_sum_kernel"
    # one token, 8 experts: x 2048*2 B, 8 experts' w13 8*2*768*2048*2 B, c1 8*1536*2 B
    assert model["base_w13"]["bytes"] == 2048 * 2 + 8 * 2 * 768 * 2048 * 2 + 8 * 1536 * 2
    fused = stage_model(dict(meta, schedule="fused", lora_path="in_gemm"))
    assert list(fused) == ["w13+lora", "act", "w2+lora", "sum"]
    assert fused["w13+lora"]["tiles"] == dict(model["base_w13"]["tiles"], BLOCK_LR=64)
    # the fused GEMM moves the base GEMM's bytes and 8 (adapter, expert) LoRA weights (2 slices of r x H and I x r)
    lora_w13 = 8 * 2 * (16 * 2048 + 768 * 16) * 2
    assert fused["w13+lora"]["bytes"] == model["base_w13"]["bytes"] + lora_w13
    assert fused["act"]["bytes"] == model["act"]["bytes"] - 8 * 1536 * 2          # no LoRA delta d13 to read


def test_stage_model_bytes_add_up_and_errors():
    meta = dict(preset="qwen3-30b-a3b", M=512, rank=64, loras=4, schedule="sequential", lora_path="two_kernel")
    shape = MoEShape.from_name("qwen3-30b-a3b")
    work = sweep_workload(shape, 512)
    assert bench_workload(shape, 512, 4) == work == bench_workload(shape, 512, 4, 0)
    model = stage_model(meta)
    total = layer_traffic(shape, 64, work, lora_path="two_kernel")["total"]
    assert sum(s["bytes"] for s in model.values()) == total.bytes
    assert all(s["bytes"] == s["bytes_read"] + s["bytes_written"] for s in model.values())
    assert model["lora_w13"]["kernel"] == "shrink_kernel, expand_kernel"
    with pytest.raises(ValueError, match="meta: loras, lora_path missing"):
        stage_model({k: v for k, v in meta.items() if k not in ("loras", "lora_path")})
    with pytest.raises(ValueError, match="sms: expected a positive int"):
        stage_model(meta, sms=0)
    with pytest.raises(TypeError, match="meta: expected a dict"):
        stage_model([meta])
    with pytest.raises(ValueError, match="lora_path"):
        stage_model(dict(meta, lora_path="in_gemm"))           # in_gemm is the fused schedule's, not a LoRA op's
    assert achieved_gbps(4_800_000, 1000.0) == 4.8 and achieved_gbps(10, 0) is None
