"""Training plots: the backward's byte table and its groups against hand counts, and the artists each drawing
function makes."""
import matplotlib

matplotlib.use("Agg")

import pytest
import torch
from matplotlib.figure import Figure

import moelora_lab  # noqa: F401  (first: it decides whether Triton kernels run on the interpreter)
from moelora_lab import MoEShape
from moelora_lab.op.dispatch import gpu_config
from moelora_lab.plots.training import (EXTRA_GROUPS, draw_extra_breakdown, draw_grad_traffic, draw_loss_curves,
                                        extra_groups, grad_traffic_table)
from moelora_lab.profile import GRAD_TRAFFIC_PATHS, GradWorkload, grad_op_traffic

SMALL = MoEShape(64, 32, 8, 2, "small")      # H 64, I 32, E 8, k 2
DIMS = dict(in_features=64, out_features=32, num_slices=2, rank=16)


def axes():
    return Figure().add_subplot()


def test_extra_groups_hand_counted():
    # 16 tokens, k 2, all on adapter 0: group (0, 0) 20 pairs in 2 blocks, (0, 1) 12 in 1 (test_profile_grad_traffic)
    wl = GradWorkload.from_counts([[20, 12]], num_tokens=16, top_k=2, block_size=16)
    two, one = (extra_groups(grad_op_traffic(p, wl, **DIMS)) for p in ("two_kernel", "one_shot"))
    dx = 4 * 32 * 64 * 4                                       # [P, K] fp32 rows: zeroed, read, written, summed
    assert two == {"x and dY read again": 2048 + 4096, "T and dT through HBM": 4 * 2048, "dx pair rows": dx,
                   "dA, dB slabs again": 0, "dw read and written again": 0, "other": 0}
    assert one["dA, dB slabs again"] == 2 * (8192 + 4096) and one["T and dT through HBM"] == 0
    with pytest.raises(TypeError, match="GradTraffic"):
        extra_groups(42)


def test_grad_traffic_table_rows_and_hand_counted_intermediate():
    rows = grad_traffic_table(SMALL, 4, [3, 40], num_loras=2)
    assert [(r["M"], r["path"]) for r in rows] == [(m, p) for m in (3, 40) for p in GRAD_TRAFFIC_PATHS]
    for r in rows:
        assert r["ratio"] == r["bytes"] / r["floor"] and r["extra"] == r["bytes"] - r["floor"]
        assert sum(r[g] for g, _ in EXTRA_GROUPS) + r["other"] == r["extra"]
        assert r["block_m"] == gpu_config("two_kernel", r["M"] * 2, min(r["M"] * 2, 16), 32, 2, 132, rank=4).block_m
    assert len({r["floor"] for r in rows if r["M"] == 40}) == 1          # one floor for every path
    # every token has an adapter: T, dT [S=2, P, r=4] bf16, written once, read once per 64-wide tile of N = 32
    # and of K = 64 (one each): 4 passes
    two = next(r for r in rows if (r["M"], r["path"]) == (40, "two_kernel"))
    assert two["T and dT through HBM"] == 4 * 2 * 80 * 4 * 2
    w2 = grad_traffic_table(SMALL, 4, [8], op="w2", paths=("one_shot",))
    assert w2[0]["traffic"].floor.part("dw") == 16 * 4                   # w2 takes the routing weights: dw [P]


def test_grad_traffic_table_rejects_bad_arguments():
    with pytest.raises(TypeError, match="tokens"):
        grad_traffic_table(SMALL, 4, 16)
    with pytest.raises(ValueError, match="path"):
        grad_traffic_table(SMALL, 4, [16], paths=("reference",))
    with pytest.raises(ValueError, match="op"):
        grad_traffic_table(SMALL, 4, [16], op="w3")
    with pytest.raises(ValueError, match="rank"):
        grad_traffic_table(SMALL, 0, [16])


def test_draw_grad_traffic_and_breakdown():
    rows = grad_traffic_table(SMALL, 4, [4, 64, 512], num_loras=2)
    ax = axes()
    draw_grad_traffic(ax, rows, title="small")
    lines = ax.get_lines()
    assert len(lines) == len(GRAD_TRAFFIC_PATHS) + 1                    # a line per path, then the floor
    assert list(lines[0].get_xdata()) == [4, 64, 512] and list(lines[-1].get_ydata()) == [1.0, 1.0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["4", "64", "512"]
    ax = axes()
    draw_extra_breakdown(ax, rows, M=512)
    assert len(ax.patches) % 3 == 0 and len(ax.patches) >= 6            # the floor and at least one group
    notes = [t.get_text() for t in ax.texts]
    assert len(notes) == 3 and all(n.endswith("x") for n in notes)
    assert ax.get_legend() is not None and "the floor" in [t.get_text() for t in ax.get_legend().get_texts()]
    with pytest.raises(ValueError, match="M = 7"):
        draw_extra_breakdown(axes(), rows, M=7)
    with pytest.raises(TypeError, match="Axes"):
        draw_grad_traffic(None, rows)


def test_draw_loss_curves():
    alone = torch.tensor([[1.0, 0.5, 0.25, 0.1], [2.0, 1.0, 0.8, 0.4]])
    ax = axes()
    draw_loss_curves(ax, alone, {"together, spec": alone * 1.01, "together, kernels": alone[:, :2]})
    lines = ax.get_lines()
    assert len(lines) == 2 + 2 * 2 and ax.get_yscale() == "log"
    assert [line.get_linestyle() for line in lines[:2]] == ["-", "-"]
    assert all(line.get_linestyle() == "None" for line in lines[2:]) and len(lines[-1].get_xdata()) == 2
    assert "adapter 1: together, kernels" in [t.get_text() for t in ax.get_legend().get_texts()]
    with pytest.raises(ValueError, match="expected \\[2, at most 4\\]"):
        draw_loss_curves(axes(), alone, {"long": torch.ones(2, 5)})
    with pytest.raises(ValueError, match="alone"):
        draw_loss_curves(axes(), torch.ones(4), {"x": torch.ones(1, 4)})
    with pytest.raises(TypeError, match="together"):
        draw_loss_curves(axes(), alone, {})


def test_grad_time_lines():
    from moelora_lab.plots.training import grad_time_lines
    rows = [dict(op="w13", rank=16, M=128, path=p, ran=r, us_median=t)
            for p, r, t in (("two_kernel", "two_kernel", 50.0), ("one_shot", "one_shot", 40.25),
                            ("auto", "one_shot", 41.0))]
    rows.append(dict(op="w2", rank=16, M=128, path="two_kernel", ran="two_kernel", us_median=30.0))
    lines = grad_time_lines(rows)
    assert "one_shot_atomic" not in lines[0] and lines[0].split()[3:6] == ["two_kernel", "µs", "one_shot"]
    assert lines[1].split() == ["w13", "16", "128", "50.0", "40.2", "41.0", "one_shot"]
    assert lines[2].split() == ["w2", "16", "128", "30.0", "-"]


def test_train_time_lines():
    from moelora_lab.plots.training import train_time_lines
    rows = [dict(rank=16, M=512, variant="lab_lora", us_median=1500.0, peak_mib=100.4, error=""),
            dict(rank=16, M=512, variant="hf_peft", us_median=6000.0, peak_mib=900.0, error=""),
            dict(rank=64, M=512, variant="lab_lora", us_median=2000.0, peak_mib="", error=""),
            dict(rank=64, M=512, variant="hf_peft", us_median=1.0, peak_mib=1.0, error="RuntimeError: boom")]
    lines = train_time_lines(rows)
    assert lines[1].split() == ["16", "512", "1.50", "6.00", "0.25", "100", "900"]
    assert lines[2].split() == ["64", "512", "2.00", "-", "-", "-", "-"]           # a failed row is no data


def test_grad_reading_names_where_auto_missed():
    from moelora_lab.plots.training import grad_reading
    rows = [dict(op="w13", rank=16, M=m, path=p, ran=r, us_median=t)
            for m, cases in ((128, (("two_kernel", "two_kernel", 50.0), ("one_shot", "one_shot", 40.0),
                                    ("auto", "one_shot", 41.0))),
                             (8192, (("two_kernel", "two_kernel", 100.0), ("one_shot", "one_shot", 150.0),
                                     ("auto", "one_shot", 151.0))))
            for p, r, t in cases]
    assert grad_reading(rows) == "auto ran the fastest path in 1 of 2 cases: w13 r 16 M 8192: one_shot for " \
                                 "two_kernel, 1.51x its time"
    assert grad_reading(rows[:3]) == "auto ran the fastest path in 1 of 1 cases"
    assert grad_reading(rows[:2]) == "no case times auto beside the paths"


def test_train_reading_gives_the_ranges():
    from moelora_lab.plots.training import train_reading
    rows = [dict(rank=16, M=512, variant="lab_lora", us_median=1500.0, peak_mib=100.0, error=""),
            dict(rank=16, M=512, variant="hf_peft", us_median=6000.0, peak_mib=1000.0, error=""),
            dict(rank=16, M=2048, variant="lab_lora", us_median=3000.0, peak_mib=300.0, error=""),
            dict(rank=16, M=2048, variant="hf_peft", us_median=6000.0, peak_mib=1000.0, error=""),
            dict(rank=64, M=512, variant="hf_peft", us_median=1.0, peak_mib=1.0, error="RuntimeError: boom")]
    assert train_reading(rows) == ("over 2 cases the lab's step takes 0.25-0.50x HF + PEFT's time and 0.10-0.30x its "
                                   "peak memory")
    assert train_reading(rows[-1:]) == "no case has both the lab's step with LoRA and HF + PEFT's"
