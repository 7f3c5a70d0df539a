"""Register pictures: hand-computed register counts, the artists each draw function makes, the errors."""
import matplotlib

matplotlib.use("Agg")

from pathlib import Path

import pytest
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from moelora_lab.results import read_csv
from moelora_lab.op.dispatch import choose_path
from moelora_lab.plots.registers import (
    REGISTER_CAP,
    accumulator_registers,
    auto_path,
    draw_occupancy_vs_rank,
    draw_register_tile,
    draw_registers_vs_rank,
    draw_time_vs_rank,
    rank_tile,
    register_rows,
)

DATA = Path(__file__).resolve().parent.parent / "moelora_lab" / "data" / "h200"


def axes():
    return Figure().add_subplot()


def reg_row(rank, max_block_r, n_regs, n_spills=0, blocks=2, block_m=64):
    return dict(rank=rank, block_m=block_m, max_block_r=max_block_r, n_regs=n_regs, n_spills=n_spills,
                blocks_per_sm=blocks, num_warps=4, occupancy=blocks * 4 / 64, error="")


# two ranks x {tiling on, off} at BLOCK_M = 64, plus one BLOCK_M = 16 row that must be ignored
REG_ROWS = [reg_row(64, 128, 200, blocks=2), reg_row(64, 512, 200, blocks=2),
            reg_row(256, 128, 250, blocks=2), reg_row(256, 512, 255, 100, blocks=1),
            reg_row(64, 128, 90, blocks=5, block_m=16)]


def time_row(path, rank, us, ran=None, M=32):
    return dict(preset=QWEN, op="w13", path=path, ran=ran or path, M=M, rank=rank, loras=4, us_median=us,
                us_p20=us - 1, us_p80=us + 1, gpu="GPU X")


QWEN = "qwen3-30b-a3b"     # top-k 8, 128 experts: M = 32 tokens are 256 pairs
# the stored auto rows claim the opposite of the rule: the rings must not read them
TIME_ROWS = [time_row("one_shot", 16, 10.0), time_row("one_shot", 128, 50.0),
             time_row("two_kernel", 16, 12.0), time_row("two_kernel", 128, 30.0),
             time_row("auto", 16, 12.5, "two_kernel"), time_row("auto", 128, 50.5, "one_shot"),
             time_row("one_shot", 16, 99.0, M=8)]


@pytest.mark.parametrize("block_m, block_r, warps, regs", [
    (64, 128, 4, 64), (64, 256, 4, 128), (64, 512, 4, 256), (16, 128, 4, 16),
    (16, 16, 4, 2), (64, 128, 8, 32), (1, 1, 4, 1), (3, 50, 1, 5),     # 150 / 32 rounds up to 5
])
def test_accumulator_registers_hand_computed(block_m, block_r, warps, regs):
    assert accumulator_registers(block_m, block_r, warps) == regs


@pytest.mark.parametrize("args, err, msg", [
    ((0, 128), ValueError, "block_m: must be >= 1"),
    ((64, "128"), TypeError, "block_r: expected an int"),
    ((64, 128, 3), ValueError, "num_warps: must be a power of two, got 3"),
    ((64, 128, 64), ValueError, "num_warps: must be <= 32"),
])
def test_accumulator_registers_rejects(args, err, msg):
    with pytest.raises(err, match=msg):
        accumulator_registers(*args)


@pytest.mark.parametrize("rank, max_block_r, expected", [
    (16, 128, (16, 1)), (100, 128, (128, 1)), (192, 128, (128, 2)), (512, 128, (128, 4)),
    (192, 512, (256, 1)), (512, 512, (512, 1)), (192, 64, (64, 3)), (4, 128, (16, 1)),
])
def test_rank_tile_matches_the_launcher(rank, max_block_r, expected):
    assert rank_tile(rank, max_block_r) == expected


def test_rank_tile_rejects():
    with pytest.raises(ValueError, match="max_block_r: must be a power of two, got 100"):
        rank_tile(64, 100)
    with pytest.raises(ValueError, match="rank: must be >= 1"):
        rank_tile(0, 128)


def test_register_rows_selects_sorts_and_drops_failed_compiles():
    rows = [reg_row(256, 128, 250), reg_row(64, 128, 200), dict(reg_row(512, 128, 0), n_regs="")]
    assert [r["rank"] for r in register_rows(rows, block_m=64, max_block_r=128)] == [64, 256]


@pytest.mark.parametrize("rows, kw, err, msg", [
    (REG_ROWS, dict(block_m=32, max_block_r=128), ValueError, "block_m: 32 is not in the rows; available: 16, 64"),
    (REG_ROWS, dict(block_m=64, max_block_r=256), ValueError,
     "max_block_r: 256 is not in the rows; available: 128, 512"),
    ([dict(rank=16)], dict(block_m=64, max_block_r=128), ValueError, r"rows\[0\]: missing block_m"),
    ([], dict(block_m=64, max_block_r=128), TypeError, "rows: expected a non-empty list"),
    ("registers.csv", dict(block_m=64, max_block_r=128), TypeError, "rows: expected a non-empty list"),
])
def test_register_rows_rejects(rows, kw, err, msg):
    with pytest.raises(err, match=msg):
        register_rows(rows, **kw)


def test_draw_registers_vs_rank_bars_spills_cap_and_prediction():
    ax = axes()
    draw_registers_vs_rank(ax, REG_ROWS, block_m=64)
    bars = [p for p in ax.patches if isinstance(p, Rectangle)]
    # 4 register bars + 1 spill bar (r=256 without tiling), BLOCK_M=16 ignored
    assert sorted(round(b.get_height()) for b in bars) == [100, 200, 200, 250, 255]
    spill = next(b for b in bars if b.get_hatch())
    assert (spill.get_y(), spill.get_height()) == (255, 100)                  # stacked on the 255 registers
    assert [t.get_text() for t in ax.texts] == ["+100"]
    ys = sorted({round(ln.get_ydata()[0]) for ln in ax.lines})
    # predictions 64*BLOCK_R/128: r=64 -> 32 (both), r=256 tiled -> BLOCK_R 128 -> 64, untiled -> 256 -> 128
    assert ys == [32, 64, 128, REGISTER_CAP]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["64", "256"]
    labels = ax.get_legend_handles_labels()[1]
    assert len(labels) == len(set(labels)) == 5
    assert "LoRA rank" in ax.get_xlabel() and "registers per thread" in ax.get_ylabel()


def test_draw_registers_vs_rank_without_prediction():
    ax = axes()
    draw_registers_vs_rank(ax, REG_ROWS, block_m=16, show_prediction=False)
    assert [round(p.get_height()) for p in ax.patches] == [90]
    assert [round(ln.get_ydata()[0]) for ln in ax.lines] == [REGISTER_CAP]


def test_draw_occupancy_vs_rank_lines_and_percent_axis():
    ax = axes()
    draw_occupancy_vs_rank(ax, REG_ROWS, block_m=64)
    lines = {ln.get_label(): list(ln.get_ydata()) for ln in ax.lines}
    assert lines == {"rank tiling (BLOCK_R <= 128)": [2, 2], "no tiling (one BLOCK_R up to 512)": [2, 1]}
    assert "blocks per SM" in ax.get_ylabel()
    sec = [c for c in ax.child_axes]
    assert len(sec) == 1 and "% of 64 warp slots" in sec[0].get_ylabel()


def test_auto_path_is_the_current_rule():
    for M, rank in ((1, 16), (1, 128), (4, 64), (32, 16), (32, 128), (512, 64), (8192, 256)):
        assert auto_path(QWEN, "w13", M, rank, 4) == choose_path(M * 8, 128, 4, rank, 768)
        assert auto_path(QWEN, "w2", M, rank, 4) == choose_path(M * 8, 128, 4, rank, 2048)
    assert auto_path(QWEN, "w2", 32, 16, 4) == "one_shot"            # r 16: one-shot at any width
    assert auto_path(QWEN, "w13", 32, 128, 4) == "two_kernel"
    assert auto_path(QWEN, "w2", 1, 256, 4) == "two_kernel"           # past r 128 from one pair
    assert auto_path(QWEN, "w2", 8192, 256, 4) == "one_shot"          # 65536 pairs: past the two-kernel range
    assert auto_path("deepseek-v2-lite", "w13", 32, 64, 4) == choose_path(32 * 6, 64, 4, 64)


@pytest.mark.parametrize("args, err, msg", [
    ((QWEN, "w3", 32, 16, 4), ValueError, "op: 'w3' is not one of"),
    (("p", "w13", 32, 16, 4), ValueError, "preset 'p' is unknown"),
    ((QWEN, "w13", 0, 16, 4), ValueError, "M: must be >= 1"),
    ((QWEN, "w13", 32, 16, 0), ValueError, "num_loras: must be >= 1"),
])
def test_auto_path_rejects(args, err, msg):
    with pytest.raises(err, match=msg):
        auto_path(*args)


def test_register_plots_legend_outside_or_left_to_the_caller():
    for draw in (draw_registers_vs_rank, draw_occupancy_vs_rank):
        ax = axes()
        draw(ax, REG_ROWS, block_m=64)
        legend = ax.get_legend()
        assert legend is not None and legend.get_bbox_to_anchor().x0 > ax.bbox.x1      # right of the axes
        assert all(t.get_fontsize() >= 9 for t in legend.get_texts())
        ax = axes()
        draw(ax, REG_ROWS, block_m=64, legend=False)
        assert ax.get_legend() is None


def test_draw_time_vs_rank_lines_band_and_rule_rings():
    ax = axes()
    draw_time_vs_rank(ax, TIME_ROWS, preset=QWEN, op="w13", M=32)
    ys = {ln.get_label(): list(ln.get_ydata()) for ln in ax.lines}
    assert ys["one-shot (T in registers)"] == [10.0, 50.0]
    assert ys["two-kernel (T in HBM)"] == [12.0, 30.0]
    rings = [c for c in ax.collections if c.get_label().startswith('path="auto"')]
    # the rule: r 16 -> one_shot (10.0), r 128 with 256 pairs -> two_kernel (30.0); not the stored auto rows
    assert len(rings) == 1 and rings[0].get_offsets().tolist() == [[16, 10.0], [128, 30.0]]
    assert len(ax.collections) == 3                     # two p20-p80 bands and the rings
    assert ax.get_legend() is not None and "µs" in ax.get_ylabel() and "M = 32" in ax.get_title()


def test_draw_time_vs_rank_without_rings_or_legend():
    ax = axes()
    draw_time_vs_rank(ax, TIME_ROWS, preset=QWEN, op="w13", M=32, show_auto=False, legend=False)
    assert len(ax.collections) == 2 and ax.get_legend() is None


@pytest.mark.parametrize("kw, err, msg", [
    (dict(preset="q", op="w13", M=32), ValueError, "preset: 'q' is not in the rows; available: qwen3-30b-a3b"),
    (dict(preset=QWEN, op="w3", M=32), ValueError, "op: 'w3' is not one of 'w13', 'w2'"),
    (dict(preset=QWEN, op="w13", M=64), ValueError, "M: 64 is not in the rows; available: 8, 32"),
    (dict(preset=QWEN, op="w13", M=8), ValueError, "paths: no rows for path 'two_kernel'"),
    (dict(preset=QWEN, op="w13", M=32.0), TypeError, "M: expected an int"),
])
def test_draw_time_vs_rank_rejects(kw, err, msg):
    with pytest.raises(err, match=msg):
        draw_time_vs_rank(axes(), TIME_ROWS, **kw)


def _texts(ax):
    return " | ".join(t.get_text() for t in ax.texts)


def _gauge(ax):
    (g,) = ax.child_axes
    return g, {round(p.get_y() + p.get_height() / 2): p for p in g.patches if not p.get_hatch()}


def _hatched(ax):
    return [p for p in ax.patches if p.get_hatch()]


def test_draw_register_tile_warps_arithmetic_and_numbered_gauge():
    ax = axes()
    draw_register_tile(ax, 64, 128)
    warps = [p for p in ax.patches if p.get_fill() and p.get_height() == pytest.approx(0.3 / 4)]
    assert len(warps) == 4                                              # 4 slabs of 16 rows
    assert "T tile: 64×128 fp32 = 8,192 values / 128 threads = 64 registers per thread" in _texts(ax)
    assert "1 rank tile of BLOCK_R = 128 columns" in _texts(ax)
    assert not _hatched(ax)                                             # no padding, no later tiles
    g, bars = _gauge(ax)
    assert list(bars) == [1] and bars[1].get_width() == 64             # the T tile alone, at 64
    ticks = [int(t) for t in g.get_xticks()]
    assert REGISTER_CAP in ticks and 64 in ticks and 256 not in ticks  # numbered axis, the cap at its value
    cap = next(t for t in g.get_xticklabels() if t.get_text() == "255")
    assert cap.get_color() == "#d62728"
    assert [t.get_text() for t in g.get_yticklabels()] == ["T tile alone"]
    assert "registers per thread" in g.get_xlabel()


def test_draw_register_tile_draws_the_rank_tiles_of_the_toggle():
    tiled, one = axes(), axes()
    draw_register_tile(tiled, 64, 512, max_block_r=128)                 # 4 tiles of 128
    draw_register_tile(one, 64, 512, max_block_r=512)                   # 1 tile of 512
    later = [p for p in tiled.patches if p.get_linestyle() == "--"]
    assert len(later) == 3 and all(p.get_width() == pytest.approx(0.8 * 128 / 512) for p in later)
    assert "4 rank tiles of BLOCK_R = 128: tile 1 is in registers, tiles 2–4 reuse them in turn" in _texts(tiled)
    assert "= 64 registers per thread" in _texts(tiled)
    assert not [p for p in one.patches if p.get_linestyle() == "--"]
    assert "= 256 registers per thread" in _texts(one)
    assert _gauge(one)[1][1].get_width() == REGISTER_CAP                # blue up to the cap, hatched past it
    assert [p.get_width() for p in _gauge(one)[0].patches if p.get_hatch()] == [1]


def test_draw_register_tile_pads_past_the_rank():
    ax = axes()
    draw_register_tile(ax, 16, 192, max_block_r=128)                    # 2 tiles of 128: 64 padded columns
    (pad,) = _hatched(ax)
    assert pad.get_width() == pytest.approx(0.8 * 64 / 512)
    assert "tile 2 reuses them after it; hatched: padding past r = 192" in _texts(ax)
    ax = axes()
    draw_register_tile(ax, 16, 192, max_block_r=512)                    # one tile padded to 256
    (pad,) = _hatched(ax)
    assert pad.get_width() == pytest.approx(0.8 * 64 / 512) and "fp32 = 4,096 values" in _texts(ax)


def test_draw_register_tile_compiled_count_at_its_value():
    ax = axes()
    draw_register_tile(ax, 64, 256, max_block_r=512, n_regs=255, n_spills=116, measured_label="compiled (GPU X)")
    g, bars = _gauge(ax)
    assert bars[0].get_width() == 255 and bars[1].get_width() == 128
    (spill,) = [p for p in g.patches if p.get_hatch()]
    assert (spill.get_x(), spill.get_width()) == (255, 116)             # stacked on the 255 registers
    assert [t.get_text() for t in g.get_yticklabels()] == ["T tile alone", "compiled (GPU X)"]
    assert "255 + 116 spilled" in _texts(g) and g.get_xlim()[1] >= 255 + 116


def test_draw_register_tile_names_hatching_only_where_it_is_drawn():
    cases = {(252, 0, 256): None, (255, 116, 256): "hatched: spilled", (None, 0, 512): "hatched: past the cap",
             (255, 28, 512): "hatched: past the cap / spilled"}
    for (n_regs, n_spills, rank), words in cases.items():
        ax = axes()
        draw_register_tile(ax, 64, rank, max_block_r=512, n_regs=n_regs, n_spills=n_spills)
        g, _ = _gauge(ax)
        drawn = [p for p in g.patches if p.get_hatch()]
        if words is None:
            assert not drawn and "hatched" not in g.get_xlabel()
        else:
            assert drawn and words in g.get_xlabel()


def test_draw_register_tile_shared_register_axis():
    ax = axes()
    draw_register_tile(ax, 64, 256, n_regs=252, registers_max=400)          # panels that compare: one axis
    g, _ = _gauge(ax)
    assert g.get_xlim()[1] == pytest.approx(400 * 1.04)
    assert [int(t) for t in g.get_xticks()] == [0, 64, 128, 192, 255, 320, 384]


def test_draw_registers_vs_rank_leaves_room_for_the_spill_labels():
    ax = axes()
    draw_registers_vs_rank(ax, REG_ROWS, block_m=64)
    assert ax.get_ylim()[1] >= 1.1 * (255 + 100)


def test_draw_register_tile_eight_warps_split_rows_and_columns():
    ax = axes()
    draw_register_tile(ax, 16, 256, num_warps=8, max_block_r=256)      # one 16-row slab: warps split columns
    assert "16×256 fp32 = 4,096 values / 256 threads = 16 registers per thread" in _texts(ax)
    assert sum(1 for p in ax.patches if p.get_fill() and p.get_height() == pytest.approx(0.3 / 4)) == 8


@pytest.mark.parametrize("args, kw, err, msg", [
    ((None, 64, 128), {}, TypeError, "ax: expected a matplotlib Axes"),
    (("ax", 48, 128), {}, ValueError, "block_m: must be a power of two, got 48"),
    (("ax", 8, 128), {}, ValueError, "block_m: must be >= 16"),
    (("ax", 64, 0), {}, ValueError, "rank: must be >= 1"),
    (("ax", 64, 128), dict(max_block_r=100), ValueError, "max_block_r: must be a power of two, got 100"),
    (("ax", 64, 128), dict(num_warps=6), ValueError, "num_warps: must be a power of two"),
    (("ax", 64, 128), dict(n_regs=-1), ValueError, "n_regs: must be >= 0"),
    (("ax", 64, 128), dict(n_spills=None), TypeError, "n_spills: expected an int"),
    (("ax", 64, 128), dict(registers_max=100), ValueError, "registers_max: must be >= 255"),
])
def test_draw_register_tile_rejects(args, kw, err, msg):
    args = tuple(axes() if a == "ax" else a for a in args)
    with pytest.raises(err, match=msg):
        draw_register_tile(*args, **kw)


def test_draws_reject_a_non_axes():
    with pytest.raises(TypeError, match="ax: expected a matplotlib Axes"):
        draw_registers_vs_rank(Figure(), REG_ROWS, block_m=64)


def test_committed_data_draws_what_the_csv_says():
    rows = read_csv(DATA / "registers.csv")
    for block_m in (16, 64):
        ax = axes()
        draw_registers_vs_rank(ax, rows, block_m=block_m, show_prediction=False)
        want = [r["n_regs"] for r in rows if r["block_m"] == block_m]
        want += [r["n_spills"] for r in rows if r["block_m"] == block_m and r["n_spills"]]
        assert sorted(round(p.get_height()) for p in ax.patches) == sorted(want)
    kernels = read_csv(DATA / "kernels.csv")
    ax = axes()
    draw_time_vs_rank(ax, kernels, preset="qwen3-30b-a3b", op="w13", M=8192)
    one_shot = next(ln for ln in ax.lines if ln.get_label().startswith("one-shot"))
    assert list(one_shot.get_xdata()) == [16, 64, 128, 256]
