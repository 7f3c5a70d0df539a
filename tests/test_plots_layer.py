import matplotlib

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402

import pytest  # noqa: E402

from moelora_lab.plots.layer import draw_layer_times, draw_lora_overhead, lora_overhead, save_layer_plots  # noqa: E402
from moelora_lab.plots.timeline import draw_timeline  # noqa: E402
from test_timeline import REC  # noqa: E402


def rows():
    out = []
    for M, base, dual in ((1, 100.0, 110.0), (16, 120.0, 150.0), (256, 200.0, 300.0)):
        for variant, t in (("no_lora", base), ("dual_stream", dual), ("sequential", dual + 10)):
            out.append(dict(preset="p", M=M, rank=16, variant=variant, us_median=t, us_p20=t - 1, us_p80=t + 1,
                            gpu="GPU", loras=4))
    out.append(dict(preset="p", M=512, rank=16, variant="grouped_mm", us_median="", us_p20="", us_p80="",
                    gpu="GPU", loras=4))
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
    draw_lora_overhead(ax, rows(), preset="p", ranks=[16])
    labels = [line.get_label() for line in ax.get_lines()]
    assert "r=16: LoRA, two streams (folded join)" in labels and "1.15x of no LoRA" in labels


def test_save_layer_plots(tmp_path):
    paths = save_layer_plots(rows(), tmp_path)
    assert [p.name for p in paths] == ["layer_p.png"] and paths[0].stat().st_size > 10_000


def test_draw_timeline_lanes():
    ax = Figure().add_subplot()
    draw_timeline(ax, REC, title="case", metrics=dict(overlap=0.5, critical_path_us=27.0, serial_sum_us=35.0))
    assert len(ax.collections) == len(REC)
    assert "overlap 50% of LoRA time" in ax.get_title()
    assert [t.get_text() for t in ax.get_yticklabels()] == ["main stream (base)", "side stream (LoRA)"]
    with pytest.raises(ValueError, match="records: empty timeline"):
        draw_timeline(ax, [])
