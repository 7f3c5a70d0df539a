"""Notebook 10's tables and figures: the byte-model rows against layer_traffic, the measured ratios from hand-made
rows, and every figure drawn without error."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from moelora_lab.config import MoEShape  # noqa: E402
from moelora_lab.plots.quant import (draw_block_scales, draw_lora_share, draw_measured, lora_share_rows,  # noqa: E402
                                     measured_ratios)
from moelora_lab.plots.traffic import sweep_workload  # noqa: E402
from moelora_lab.profile.traffic import layer_traffic  # noqa: E402
from moelora_lab.quant import quantize_weight  # noqa: E402


def test_lora_share_rows_are_the_byte_model():
    rows = lora_share_rows("qwen3-30b-a3b", [1, 512], ranks=(16,))
    assert [(r["base"], r["M"]) for r in rows] == [("dtype", 1), ("dtype", 512), ("fp8", 1), ("fp8", 512)]
    s = MoEShape.from_name("qwen3-30b-a3b")
    st = layer_traffic(s, 16, sweep_workload(s, 512), base="fp8")
    row = rows[3]
    assert row["lora"] == st["lora_w13"].bytes + st["lora_w2"].bytes and row["total"] == st["total"].bytes
    assert row["share"] == row["lora"] / row["total"] and row["ratio"] == row["total"] / row["plain"]
    # the LoRA's bytes do not depend on the base; the base's do
    assert rows[1]["lora"] == rows[3]["lora"] and rows[3]["plain"] < rows[1]["plain"]
    with pytest.raises(ValueError, match="^rank: must be >= 1"):
        lora_share_rows("qwen3-30b-a3b", [1], ranks=(0,))


def _row(rank, m, variant, us, error=""):
    return dict(rank=rank, M=m, variant=variant, us_median=us, error=error)


def test_measured_ratios_pair_the_two_runs():
    bf16 = [_row(16, 64, "no_lora", 40.0), _row(16, 64, "sequential", 50.0), _row(16, 8, "no_lora", 30.0)]
    fp8 = [_row(16, 64, "no_lora", 25.0), _row(16, 64, "sequential", 35.0), _row(16, 8, "sequential", 9.0),
           _row(16, 8, "no_lora", 1.0, error="failed")]
    ratios = measured_ratios(bf16, fp8)
    assert ratios == [dict(rank=16, M=64, bf16_us=40.0, fp8_us=25.0, speedup=1.6, lora_cost=1.4,
                           lora_cost_bf16=1.25)]           # M = 8: no bf16 sequential, and an FP8 row that failed


def test_the_figures_draw():
    fig, axs = plt.subplots(1, 3)
    draw_lora_share(axs[0], lora_share_rows("qwen3-30b-a3b", [1, 64], ranks=(16, 64)), title="t")
    assert len(axs[0].get_lines()) == 4
    draw_measured(axs[1], [dict(rank=16, M=m, lora_cost=1.2, lora_cost_bf16=1.1) for m in (1, 64)])
    assert len(axs[1].get_lines()) == 3                    # two series and the line at 1
    w = quantize_weight(torch.randn(2, 64, 96), (32, 32))
    draw_block_scales(axs[2], w, expert=1)
    assert axs[2].images[0].get_array().shape == (2, 3) and "2 x 3 scales, 24 bytes" in axs[2].get_title()
    plt.close(fig)
