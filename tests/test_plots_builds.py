import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from moelora_lab.plots.builds import build_speedups, draw_build_speedups, rule_variant  # noqa: E402


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
