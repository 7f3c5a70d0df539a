"""The capstone's scoring: cases built from sweep rows, regret against hand counts, the errors a rule
in progress gets, the artists of each draw function; and both exercises' graders on the committed data."""
import matplotlib

matplotlib.use("Agg")

import pytest
from matplotlib.figure import Figure

from moelora_lab.exercises import get, load_solution
from moelora_lab.exercises.nb06 import DISPATCH_TARGET, SCHEDULE_TARGET, _pct
from moelora_lab.plots.capstone import (auto_path, auto_schedule, case_name, draw_path_map, draw_regret,
                                        largest_regrets, path_cases, schedule_cases, score_rule)


def krow(op, M, rank, path, us, preset="qwen3-30b-a3b"):
    return dict(preset=preset, op=op, path=path, M=M, rank=rank, loras=4, us_median=us, us_p20=us * 0.99,
                us_p80=us * 1.01)


# two cases of qwen3-30b-a3b (k 8, E 128): w13 r 16 M 1 (one-shot fastest), w2 r 64 M 32 (two-kernel fastest)
KERNEL_ROWS = [krow("w13", 1, 16, "one_shot", 10.0), krow("w13", 1, 16, "two_kernel", 15.0),
               krow("w13", 1, 16, "small_batch", 20.0), krow("w13", 1, 16, "auto", 10.1),
               krow("w13", 1, 16, "align", 3.0),
               krow("w2", 32, 64, "one_shot", 30.0), krow("w2", 32, 64, "two_kernel", 20.0)]


def lrow(M, rank, variant, us):
    return dict(preset="qwen3-30b-a3b", M=M, rank=rank, loras=4, variant=variant, us_median=us,
                us_p20=us * 0.99, us_p80=us * 1.01)


LAYER_ROWS = [lrow(1, 16, "sequential", 60.0), lrow(1, 16, "dual_stream", 45.0), lrow(1, 16, "fused", 50.0),
              lrow(1, 16, "no_lora", 40.0), lrow(2048, 64, "sequential", 600.0), lrow(2048, 64, "dual_stream", 610.0)]


def test_path_cases_group_the_paths_and_give_the_features():
    cases = path_cases(KERNEL_ROWS)
    assert [case_name(c["features"]) for c in cases] == ["qwen3-30b-a3b w13 r=16 M=1", "qwen3-30b-a3b w2 r=64 M=32"]
    w13, w2 = cases
    assert w13["us"] == {"one_shot": 10.0, "two_kernel": 15.0, "small_batch": 20.0} and w13["best"] == "one_shot"
    assert w2["best"] == "two_kernel" and set(w2["us"]) == {"one_shot", "two_kernel"}
    assert w13["features"] == dict(preset="qwen3-30b-a3b", op="w13", M=1, rank=16, loras=4, top_k=8,
                                   num_experts=128, pairs=8, K=2048, N=768, slices=2)
    assert (w2["features"]["K"], w2["features"]["N"], w2["features"]["slices"], w2["features"]["pairs"]) == \
        (768, 2048, 1, 256)
    assert w13["band"]["one_shot"] == pytest.approx((9.9, 10.1))


def test_schedule_cases_know_where_fused_fits():
    first, second = schedule_cases(LAYER_ROWS)
    assert first["features"]["fused_fits"] and not second["features"]["fused_fits"]
    assert first["best"] == "dual_stream" and second["best"] == "sequential" and "no_lora" not in first["us"]
    assert second["features"]["pairs_per_expert"] == 2048 * 8 / 128


def test_score_rule_computes_regret_against_the_fastest():
    cases = path_cases(KERNEL_ROWS)
    s = score_rule(lambda f: "one_shot", cases)
    assert [r["regret"] for r in s["rows"]] == pytest.approx([0.0, 0.5])
    assert s["mean"] == pytest.approx(0.25) and s["worst"]["features"]["op"] == "w2" and s["best_picked"] == 1
    assert [r["choice"] for r in largest_regrets(s)] == ["one_shot"]
    assert score_rule(lambda f: "two_kernel" if f["rank"] >= 64 else "one_shot", cases)["mean"] == 0
    seen = []
    score_rule(lambda f: seen.append(f) or f.clear() or "one_shot", cases)   # the rule gets a copy
    assert cases[0]["features"]["rank"] == 16 and len(seen) == 2


def test_score_rule_names_the_case_and_the_reason_of_a_bad_choice():
    paths, schedules = path_cases(KERNEL_ROWS), schedule_cases(LAYER_ROWS)
    with pytest.raises(ValueError, match=r"w2 r=64 M=32: mine returned 'small_batch': it was not measured.*M up "
                                         r"to 1; return one of"):
        score_rule(lambda f: "small_batch", paths, name="mine")
    with pytest.raises(ValueError, match=r"r=64 M=2048: the rule returned 'fused': the in-GEMM LoRA cannot run"):
        score_rule(lambda f: "fused", schedules)
    with pytest.raises(ValueError, match=r"returned None; return one of 'one_shot'"):
        score_rule(lambda f: None, paths)
    with pytest.raises(TypeError, match="choose"):
        score_rule("one_shot", paths)
    with pytest.raises(ValueError, match="cases"):
        score_rule(lambda f: "one_shot", [])


def test_cases_reject_rows_of_another_file():
    with pytest.raises(ValueError, match="missing"):
        path_cases([dict(M=1)])
    with pytest.raises(ValueError, match="no timed row"):
        path_cases([krow("w13", 1, 16, "align", 3.0)])
    with pytest.raises(ValueError, match="no timed row"):
        schedule_cases([lrow(1, 16, "no_lora", 40.0)])


def test_auto_rules_follow_the_library():
    from moelora_lab.op.dispatch import choose_path
    from moelora_lab.layer import gpu_schedule

    for c in path_cases(KERNEL_ROWS):
        f = c["features"]
        assert auto_path(f) == choose_path(f["pairs"], f["num_experts"], f["loras"], f["rank"], f["N"])
    assert [auto_schedule(c["features"]) for c in schedule_cases(LAYER_ROWS)] == \
        [gpu_schedule(8, 128, in_k_columns=4 * 16), gpu_schedule(2048 * 8, 128, in_k_columns=4 * 64)] == \
        ["dual_stream", "in_k"]


def test_draw_regret_draws_a_row_per_rule_and_the_targets():
    cases = path_cases(KERNEL_ROWS)
    scores = {"one": score_rule(lambda f: "one_shot", cases), "two": score_rule(lambda f: "two_kernel", cases)}
    ax = Figure().add_subplot()
    out = draw_regret(ax, scores, target=dict(mean=0.03, worst=0.4))
    assert [(name, round(mean, 3)) for name, mean, _ in out] == [("one", 0.25), ("two", 0.25)]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["one", "two"]
    assert len(ax.collections) == 5                               # dots and mean per rule, the legend's marker
    assert sorted(line.get_xdata()[0] for line in ax.get_lines()) == pytest.approx([3.0, 40.0])
    assert any("worst 50%" in t.get_text() for t in ax.texts)
    with pytest.raises(TypeError, match="scores"):
        draw_regret(ax, {})
    with pytest.raises(TypeError, match="score_rule"):
        draw_regret(ax, {"x": [1]})
    with pytest.raises(TypeError, match="Axes"):
        draw_regret(None, scores)


def test_draw_path_map_shows_the_measured_ratio():
    fig = Figure()
    ax = fig.add_subplot()
    image = draw_path_map(ax, path_cases(KERNEL_ROWS), preset="qwen3-30b-a3b")
    grid = image.get_array()
    assert grid.shape == (2, 2)                                   # rows (w13, 16), (w2, 64); columns M 1, 32
    assert sorted(t.get_text() for t in ax.texts) == ["0.67", "1.50"]
    assert len(fig.axes) == 2                                     # the map and its colorbar
    with pytest.raises(ValueError, match="preset"):
        draw_path_map(ax, path_cases(KERNEL_ROWS), preset="tiny")


@pytest.mark.parametrize("ex_id, target", [("06.dispatcher", DISPATCH_TARGET), ("06.schedule", SCHEDULE_TARGET)])
def test_the_graders_on_the_committed_data(ex_id, target):
    """The reference passes within the target, a constant rule does not, and the feedback names cases."""
    ex = get(ex_id)
    passed = ex.check(load_solution(ex))
    assert passed.passed and f"target ≤ {_pct(target['mean'])}" in passed.message
    const = "one_shot" if ex_id == "06.dispatcher" else "sequential"
    failed = ex.check(lambda case: const)
    assert not failed.passed and failed.done and "largest regrets:" in failed.details
    assert any("auto" in d and "mean" in d for d in failed.details)
    bad = ex.check(lambda case: "nope")
    assert not bad.passed and "returned 'nope'" in bad.message
