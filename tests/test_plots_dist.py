"""The distributed-layer pictures: the numbers they draw from hand-made rows and traces, and their errors."""
import matplotlib

matplotlib.use("Agg")

import pytest
from matplotlib.figure import Figure

import moelora_lab  # noqa: F401  (first: it decides whether Triton kernels run on the interpreter)
from moelora_lab.plots.dist import (KIND_COLORS, draw_collective_model, draw_gpu_timeline, draw_parallel_dataflow,
                                    draw_stage_bars, fit_link, gpu_lanes, kernel_kind, overlap_us, split_time,
                                    stage_times, timeline_legend)


def axes():
    return Figure().add_subplot()


def step(layer, stage, us, *, lora="r16", M=64, mb=1, rank=0):
    return dict(layer=layer, lora=lora, micro_batches=mb, M_per_rank=M, stage=stage, us_median=us, rank=rank)


STEPS = [step("ep", "total", 100.0), step("ep", "dispatch", 30.0), step("ep", "experts", 50.0),
         step("ep", "combine", 15.0), step("ep", "total", 999.0, rank=1), step("ep", "total", 70.0, mb=2),
         step("single_gpu", "total", 40.0), step("single_gpu", "base_w13", 25.0), step("single_gpu", "base_w2", 12.0),
         step("tp_fully_sharded", "total", 60.0), step("tp_fully_sharded", "all_gather_T13", 9.0),
         step("tp_fully_sharded", "shrink_w13", 5.0), step("tp_fully_sharded", "all_reduce_y", 6.0)]


def test_stage_times_picks_one_run():
    assert stage_times(STEPS, "ep", lora="r16", M_per_rank=64) == {"total": 100.0, "dispatch": 30.0, "experts": 50.0,
                                                                    "combine": 15.0}
    assert stage_times(STEPS, "ep", lora="r16", M_per_rank=64, rank=1) == {"total": 999.0}
    assert stage_times(STEPS, "ep", lora="r16", M_per_rank=64, micro_batches=2) == {"total": 70.0}
    with pytest.raises(ValueError, match="no rows for layer='tp'"):
        stage_times(STEPS, "tp", lora="r16", M_per_rank=64)
    with pytest.raises(ValueError, match="lacks the columns"):
        stage_times([{"layer": "ep"}], "ep", lora="r16", M_per_rank=64)


def test_split_time_counts_collectives_as_communication():
    assert split_time(stage_times(STEPS, "ep", lora="r16", M_per_rank=64)) == {"communication": 45.0, "compute": 50.0}
    assert split_time(stage_times(STEPS, "tp_fully_sharded", lora="r16", M_per_rank=64)) == \
        {"communication": 15.0, "compute": 5.0}
    with pytest.raises(TypeError, match="stages"):
        split_time([1, 2])


def test_draw_stage_bars_draws_every_stage_in_order():
    ax = axes()
    draw_stage_bars(ax, STEPS, lora="r16", M_per_rank=64, layers=("single_gpu", "ep"))
    widths = [round(p.get_width(), 6) for p in ax.patches]
    assert widths == [25.0, 12.0, 30.0, 50.0, 15.0]                 # single_gpu, then ep: dispatch, experts, combine
    assert [p.get_x() for p in ax.patches[2:]] == [0.0, 30.0, 80.0]
    with pytest.raises(ValueError, match="layers"):
        draw_stage_bars(axes(), STEPS, lora="r16", M_per_rank=64, layers=("pipeline",))
    with pytest.raises(TypeError, match="ax"):
        draw_stage_bars(None, STEPS, lora="r16", M_per_rank=64)


COLL = [dict(op="all_to_all", bytes_per_rank=b, us_median=us, us_min=us - 1, rank=0)
        for b, us in ((4096, 11.0), (1 << 20, 30.0), (1 << 28, 10.0 + (1 << 28) / 500e3))]


def test_fit_link_recovers_latency_and_rate():
    alpha, gbps = fit_link(COLL)
    assert alpha == 10.0
    assert gbps == pytest.approx(500.0)          # alpha = the smallest size's us_min, taken off the largest
    with pytest.raises(ValueError, match="'all_gather' is not in the rows"):
        fit_link(COLL, op="all_gather")
    flat = [dict(r, us_median=5.0) for r in COLL]
    with pytest.raises(ValueError, match="cannot fit"):
        fit_link(flat)


def test_draw_collective_model_checks_its_numbers():
    ax = axes()
    draw_collective_model(ax, COLL, alpha_us=10.0, gbps=500.0, stages=[("dispatch", 1 << 20, 900.0)])
    model = ax.lines[1]
    assert list(model.get_ydata()) == pytest.approx([10.0 + b / 500e3 for b in (4096, 1 << 20, 1 << 28)])
    with pytest.raises(ValueError, match="gbps"):
        draw_collective_model(axes(), COLL, alpha_us=10.0, gbps=0)
    with pytest.raises(ValueError, match="non-empty list"):
        draw_collective_model(axes(), [], alpha_us=10.0, gbps=1.0)


def rec(name, start, end, stream="main"):
    return dict(stream=stream, name=name, start_us=start, end_us=end)


TRACES = {
    "GPU 0, 1 micro-batch": dict(meta={"lanes": {"main": "stream 7"}}, records=[
        rec("spin_kernel(long)", -100, 0), rec("moe_gemm_kernel", 0, 10), rec("ncclDevKernel_SendRecv", 10, 20)]),
    "GPU 0, 2 micro-batches": dict(meta={"lanes": {"main": "stream 7", "lora": "stream 17"}}, records=[
        rec("moe_gemm_kernel", 0, 10), rec("one_shot_kernel", 12, 20), rec("ncclDevKernel_SendRecv", 5, 15, "lora"),
        rec("index_elementwise_kernel", 15, 30)]),
    "GPU 1, 2 micro-batches": dict(meta={"lanes": {"main": "stream 7", "lora": "stream 17"}}, records=[
        rec("topk_sum_kernel", 100, 104), rec("ncclDevKernel_SendRecv", 102, 110, "lora")]),
}


def test_kernel_kind():
    assert [kernel_kind(n) for n in ("ncclDevKernel_SendRecv(x)", "moe_gemm_kernel", "one_shot_kernel",
                                     "void at::native::index_elementwise_kernel")] == \
        ["communication", "experts", "experts", "other"]
    with pytest.raises(TypeError, match="name"):
        kernel_kind(3)


def test_gpu_lanes_and_overlap():
    one = gpu_lanes(TRACES, 1)
    assert [label for label, _ in one] == ["GPU 0, stream 7"]
    assert [r["name"] for r in one[0][1]] == ["moe_gemm_kernel", "ncclDevKernel_SendRecv"]     # the sleep left out
    two = gpu_lanes(TRACES, 2)
    assert [label for label, _ in two] == ["GPU 0, stream 7", "GPU 0, stream 17", "GPU 1, stream 7", "GPU 1, stream 17"]
    assert overlap_us(one) == 0.0
    # GPU 0: NCCL [5, 15) beside moe_gemm [0, 10) -> 5 and one_shot [12, 20) -> 3 (glue does not count);
    # GPU 1: NCCL [102, 110) beside topk_sum [100, 104) -> 2
    assert overlap_us(two) == 10.0
    with pytest.raises(ValueError, match="no case ending in ', 3 micro-batches'"):
        gpu_lanes(TRACES, 3)


def test_draw_gpu_timeline_rows_and_window():
    ax = axes()
    lanes = gpu_lanes(TRACES, 2)
    draw_gpu_timeline(ax, lanes, from_last_start=True)
    assert [t.get_text() for t in ax.get_yticklabels()] == [label for label, _ in lanes]
    lo, hi = ax.get_xlim()
    assert lo < 0 < 10 <= hi < 100                     # time counts from GPU 1's first kernel (at 100)
    assert "last GPU" in ax.get_xlabel()
    starts = sorted(bar.get_paths()[0].vertices[:, 0].min() for bar in ax.collections)
    assert starts[0] == pytest.approx(-100)            # GPU 0's kernels began 100 µs before, out of view
    with pytest.raises(ValueError, match="lanes"):
        draw_gpu_timeline(axes(), [])


def texts_pt(ax):
    """Font sizes (points) of every non-empty text an Axes draws: titles, labels, tick labels, texts."""
    ax.figure.canvas.draw()
    items = [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.texts, *ax.get_xticklabels(), *ax.get_yticklabels()]
    return [t.get_fontsize() for t in items if t.get_text() and t.get_visible()]


def test_timeline_text_size_and_key():
    ax = axes()
    draw_gpu_timeline(ax, gpu_lanes(TRACES, 2), title="2 micro-batches", from_last_start=True)
    assert min(texts_pt(ax)) >= 10
    assert ax.get_legend() is None                     # the key sits outside the axes: it covers no bar
    key = timeline_legend(gpu_lanes(TRACES, 1))        # NCCL and expert kernels only: no "other" entry
    assert [h.get_facecolor() for h in key["handles"]] == \
        [matplotlib.colors.to_rgba(KIND_COLORS[k]) for k in ("communication", "experts")]
    assert key["labels"] == ["communication (NCCL)", "expert kernels (the lab's Triton)"] and key["fontsize"] >= 10
    both = timeline_legend(gpu_lanes(TRACES, 1), gpu_lanes(TRACES, 2))
    assert len(both["labels"]) == 3 and both["labels"][2].startswith("other")
    bar = ax.collections[0]
    assert both["handles"][0].get_linewidth() == bar.get_linewidth()[0]   # the key's outline is the bars'
    with pytest.raises(ValueError, match="lane_lists"):
        timeline_legend()
    with pytest.raises(ValueError, match="no kernel records"):
        timeline_legend([("GPU 0, stream 7", [])])


def test_draw_parallel_dataflow():
    for kind in ("ep", "tp"):
        ax = axes()
        draw_parallel_dataflow(ax, kind, experts=4, tokens=2)
        texts = [t.get_text() for t in ax.texts]
        assert "GPU 0" in texts and "GPU 1" in texts
        assert min(texts_pt(ax)) >= 10
    ep = axes()
    draw_parallel_dataflow(ep, "ep", experts=4, tokens=2)
    assert sum(t.get_text().startswith("expert ") for t in ep.texts) == 4           # each expert once, on its owner
    with pytest.raises(ValueError, match="kind"):
        draw_parallel_dataflow(axes(), "pp")
    with pytest.raises(ValueError, match="experts"):
        draw_parallel_dataflow(axes(), "ep", experts=3)
