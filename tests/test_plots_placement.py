"""plots.placement: every placement of the LoRA against the layer without it, from layer-sweep rows."""
import matplotlib

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402

import pytest  # noqa: E402

from moelora_lab.layer.table import SCHEDULES  # noqa: E402
from moelora_lab.plots.placement import PLACEMENT_LABELS, PLACEMENTS, draw_placements, placement_table  # noqa: E402

PRODUCT = [name for name, row in SCHEDULES.items() if row.status == "product"]
ONE, TWO = PRODUCT[0], PRODUCT[1]


def rows(M, times, *, ran=ONE, rank=16):
    """Layer-sweep rows of one M: variant -> us_median, an auto row that ran ``ran``, roofline floors."""
    base = dict(preset="p", rank=rank, M=M, loras=4, us_p20=1.0, us_p80=1.0)
    out = [dict(base, variant=v, us_median=us, roofline_us=(10.0 if v == "no_lora" else 12.0))
           for v, us in times.items()]
    out.append(dict(base, variant="auto", schedule=ran, us_median=times[ran], roofline_us=12.0))
    return out


def test_the_placements_are_the_product_rows_and_the_one_stream_experiments():
    assert set(PRODUCT) <= set(PLACEMENTS)
    assert all(SCHEDULES[n].status == "product" or SCHEDULES[n].streams == 1 for n in PLACEMENTS)
    assert set(SCHEDULES) - set(PLACEMENTS), "some two-stream experiment stays out of the lesson"
    assert all(label.startswith(f"{name}: ") for name, label in PLACEMENT_LABELS.items())


def test_placement_table_ratios_fastest_and_floor():
    data = rows(16, {"no_lora": 100.0, ONE: 130.0, TWO: 110.0}, ran=TWO) \
        + rows(64, {"no_lora": 200.0, ONE: 220.0, TWO: 240.0}) \
        + rows(128, {ONE: 5.0}, ran=ONE)[1:] + [dict(rows(128, {ONE: 5.0})[0], rank=64)]   # no no_lora at rank 16
    table = placement_table(data, preset="p", rank=16)
    assert [t["M"] for t in table] == [16, 64]
    first, second = table
    assert first[ONE] == pytest.approx(1.3) and first[TWO] == pytest.approx(1.1) and first["fastest"] == TWO
    assert first["auto_ran"] == TWO and first["auto"] == pytest.approx(1.1) and first["floor"] == pytest.approx(1.2)
    assert second["fastest"] == ONE and "base_gemms" not in second


def test_draw_placements_draws_each_placement_auto_and_the_floor():
    ax = Figure().add_subplot()
    table = draw_placements(ax, rows(16, {"no_lora": 100.0, ONE: 130.0, TWO: 110.0})
                            + rows(64, {"no_lora": 200.0, ONE: 220.0, TWO: 240.0}), preset="p", rank=16)
    labels = [line.get_label() for line in ax.get_lines()]
    assert PLACEMENT_LABELS[ONE] in labels and PLACEMENT_LABELS[TWO] in labels
    assert "auto, timed on its own" in labels and any(label.startswith("floor ratio") for label in labels)
    assert len(table) == 2 and ax.get_legend() is not None
    assert all(t.get_fontsize() >= 10 for t in ax.get_legend().get_texts())
