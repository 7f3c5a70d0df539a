import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from moelora_lab.plots.builds import (build_speedups, chunk_table, draw_build_speedups, draw_chunk_table,  # noqa: E402
                                      rule_variant)


def rows_(rank=16):
    t = dict(before=10.0, contiguous=8.0, contiguous_unpipelined=9.0, prefetch=8.5, prefetch_unpipelined=9.5)
    return [dict(op="w2", rank=rank, M=512, b_layout=layout, variant=v, us_median=us * (0.5 if layout == "n_fastest" else 1))
            for layout in ("n_fastest", "r_fastest") for v, us in t.items()]


def test_rule_variant_follows_the_build_rule():
    assert rule_variant(16) == "contiguous" and rule_variant(8) == "contiguous"
    assert rule_variant(64) == "prefetch" and rule_variant(32) == "prefetch"
    with pytest.raises(ValueError, match="rank: 128 takes the unpipelined expand"):
        rule_variant(128)


def test_build_speedups():
    cases = build_speedups(rows_())
    assert [c["b_layout"] for c in cases] == ["r_fastest", "n_fastest"]        # as given first
    c = cases[0]
    assert (c["before_us"], c["contiguous"], c["prefetch"]) == (10.0, 1.25, pytest.approx(10 / 8.5))
    assert (c["rule"], c["rule_over_best"]) == ("contiguous", 1.0)
    r64 = build_speedups(rows_(64))[0]
    assert r64["rule"] == "prefetch" and r64["rule_over_best"] == pytest.approx(8.5 / 8.0)
    with pytest.raises(ValueError, match="has no 'before' row"):
        build_speedups([r for r in rows_() if r["variant"] != "before"])


def test_draw_build_speedups():
    fig, ax = plt.subplots()
    cases = draw_build_speedups(ax, rows_())
    assert len(cases) == 2 and len(ax.patches) == 8
    outlined = [p for p in ax.patches if p.get_edgecolor()[3] > 0]               # one per case: the rule's build
    assert [p.get_height() for p in outlined] == [1.25, 1.25]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["w2\nr16\n512", "w2\nr16\n512\npacked"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "contiguous rank offsets", "contiguous, expand not pipelined", "contiguous + next output tile prefetched",
        "prefetched, expand not pipelined"]
    plt.close(fig)


def chunk_rows(M=128, rank=64, two=True):
    """A chunk probe of qwen3-30b-a3b's w2: the rule's tiles then (2 chunks of 128) first, then 1 and 4 chunks."""
    rows = [dict(preset="qwen3-30b-a3b", op="w2", path="one_shot", M=M, rank=rank, loras=4, n_chunks=c, block_n=bn,
                 us_median=us) for c, bn, us in ((2, 128, 50.0), (1, 128, 40.0), (4, 64, 60.0), (2, 128, 51.0))]
    return rows + ([dict(rows[0], path="two_kernel", n_chunks=1, us_median=45.0)] if two else [])


def test_chunk_table_sets_todays_chunks_against_the_rule_then():
    from moelora_lab.op.dispatch import gpu_config
    from moelora_lab.plots.traffic import sweep_workload
    [c] = chunk_table(chunk_rows())
    groups = min(1024, sweep_workload("qwen3-30b-a3b", 128, 4).touched_adapter_experts)
    cfg = gpu_config("one_shot", 1024, groups, 2048, 1, 132, rank=64)
    assert c["now"] == (cfg.n_chunks, cfg.block_n) == (1, 128)          # two programs per SM at a 64-wide rank tile
    assert (c["pairs"], c["before"], c["before_us"], c["now_us"]) == (1024, (2, 128), 50.0, 40.0)
    assert (c["best_us"], c["two_kernel_us"]) == (40.0, 45.0)
    [narrow] = chunk_table(chunk_rows(rank=16))                            # four programs per SM: 2 chunks
    assert narrow["now"] == (2, 128) and narrow["now_us"] == 50.0          # the first of the duplicate rows
    with pytest.raises(ValueError, match="one two_kernel row"):
        chunk_table(chunk_rows(two=False))


def test_draw_chunk_table():
    fig, ax = plt.subplots()
    assert len(draw_chunk_table(ax, chunk_rows() + chunk_rows(M=8))) == 2
    assert len(ax.collections) >= 4 and ax.get_xscale() == "log"
    plt.close(fig)
