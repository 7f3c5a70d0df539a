import matplotlib

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402

import pytest  # noqa: E402

from moelora_lab.plots.layer import draw_layer_times, draw_lora_overhead, lora_overhead, save_layer_plots  # noqa: E402
from moelora_lab.plots.timeline import draw_timeline  # noqa: E402
from test_timeline import REC  # noqa: E402


PROV = dict(gpu="GPU", torch="2.0", triton="3.0", date="2026-01-01", loras=4)


def rows():
    out = []
    for M, base, dual in ((1, 100.0, 110.0), (16, 120.0, 150.0), (256, 200.0, 300.0)):
        for variant, t in (("no_lora", base), ("dual_stream", dual), ("sequential", dual + 10)):
            out.append(dict(preset="p", M=M, rank=16, variant=variant, us_median=t, us_p20=t - 1, us_p80=t + 1,
                            **PROV))
    out.append(dict(preset="p", M=256, rank=16, variant="auto", us_median=dual, us_p20=dual, us_p80=dual, **PROV))
    out.append(dict(preset="p", M=512, rank=16, variant="grouped_mm", us_median="", us_p20="", us_p80="", **PROV))
    return out


def test_lora_overhead_ratios():
    assert lora_overhead(rows(), preset="p", rank=16) == [(1, 1.1), (16, 1.25), (256, 1.5)]
    assert lora_overhead(rows(), preset="p", rank=64) == []


def test_draw_layer_times_and_overhead():
    ax = Figure().add_subplot()
    draw_layer_times(ax, rows(), preset="p", rank=16)
    assert [line.get_label() for line in ax.get_lines()] == ["no LoRA", "LoRA, one stream",
                                                             "LoRA, two streams (folded join)"]
    assert list(ax.get_lines()[0].get_ydata()) == [100.0, 120.0, 200.0]
    ax = Figure().add_subplot()
    assert draw_lora_overhead(ax, rows(), preset="p", ranks=[16]) == 3
    lines = {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
    assert set(lines) == {"LoRA, one stream", "LoRA, two streams (folded join)", "LoRA, schedule='auto'"}
    two = lines["LoRA, two streams (folded join)"]
    assert list(two.get_xdata()) == [1, 16, 256] and list(two.get_ydata()) == pytest.approx([1.1, 1.25, 1.5])
    assert list(lines["LoRA, schedule='auto'"].get_xdata()) == [256]       # rings only where auto was timed
    assert lines["LoRA, schedule='auto'"].get_linestyle() == "None"
    assert ax.get_yscale() == "linear" and ax.get_xscale() == "log"
    assert len(ax.collections) == 2                                     # p20-p80 bands, not for auto
    assert all(t.get_fontsize() >= 9 for t in ax.get_legend().get_texts())
    ax = Figure().add_subplot()
    draw_lora_overhead(ax, rows(), preset="p", ranks=[16, 64], variants=("dual_stream",), band=False, legend=False)
    assert [line.get_label() for line in ax.get_lines()][:1] == ["r=16: LoRA, two streams (folded join)"]
    assert not ax.collections and ax.get_legend() is None


def test_save_layer_plots(tmp_path):
    paths = save_layer_plots(rows(), tmp_path)
    assert [p.name for p in paths] == ["layer_p.png"] and paths[0].stat().st_size > 10_000


def test_draw_timeline_lanes():
    ax = Figure().add_subplot()
    m = draw_timeline(ax, REC, title="case", alone_us=35.0)
    assert len(ax.collections) == len(REC) and m["overlap"] == pytest.approx(8 / 14, abs=1e-4)
    assert ax.get_title(loc="left").startswith("case\ncritical path 27 µs; LoRA beside the base work for 57%")
    assert ax.get_title(loc="left").endswith("the same kernels alone, back to back: 35 µs")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["main stream (base)", "side stream (LoRA)"]
    lanes = {c.get_label(): c.get_paths()[0].get_extents().y0 for c in ax.collections}
    assert lanes["lora_w13"] > lanes["base_w13"] + 0.5                  # its own lane
    assert all(t.get_fontsize() >= 9 for t in ax.get_legend().get_texts())
    ax = Figure().add_subplot()
    draw_timeline(ax, REC, title="one", streams=1, alone_us=35.0)       # a one-stream run: one lane
    assert [t.get_text() for t in ax.get_yticklabels()] == ["one stream"]
    ys = {round(c.get_paths()[0].get_extents().y0, 3) for c in ax.collections}
    assert len(ys) == 1 and ax.get_title(loc="left") == "one\ncritical path 27 µs"
    with pytest.raises(ValueError, match="records: empty timeline"):
        draw_timeline(ax, [])
    with pytest.raises(ValueError, match="streams: expected 1 or 2"):
        draw_timeline(ax, REC, streams=3)
    with pytest.raises(ValueError, match="alone_us"):
        draw_timeline(ax, REC, alone_us=0)
