"""The notebooks' honesty helpers: checked claims, code shown with its real line numbers, live vs committed data."""
import inspect

import pytest

from moelora_lab import lesson, results
from moelora_lab.kernels.one_shot import one_shot_kernel
from moelora_lab.lesson import ClaimError, claim, show_code


def test_claim_prints_and_fails_when_false(capsys):
    assert claim("saves {x:.0%} at M = {m}", x=0.25, m=16, holds=True) == "saves 25% at M = 16"
    assert capsys.readouterr().out == "saves 25% at M = 16\n"
    with pytest.raises(ClaimError, match=r"no longer holds for the data: 'saves 5% at M = 16' \(x=0.05, m=16\)"):
        claim("saves {x:.0%} at M = {m}", x=0.05, m=16, holds=0.05 > 0.2)
    assert capsys.readouterr().out == ""                      # nothing printed for a false sentence
    with pytest.raises(TypeError, match="text: expected the sentence as a str"):
        claim(3)


def test_show_code_whole_kernel_with_file_line_numbers(capsys):
    text = show_code(one_shot_kernel)
    fn = one_shot_kernel
    while hasattr(fn, "fn"):
        fn = fn.fn
    lines, first = inspect.getsourcelines(fn)
    shown = text.splitlines()
    assert shown[0] == "moelora_lab/kernels/one_shot.py, one_shot_kernel:"
    assert len(shown) == len(lines) + 1 and "⋮" not in text
    assert shown[1].split()[0] == str(first) and shown[-1].split()[0] == str(first + len(lines) - 1)
    assert shown[5].split("  ", 1)[1] == lines[4].rstrip("\n")   # the line itself, unfiltered


def test_show_code_excerpts_mark_every_elision():
    text = show_code(one_shot_kernel, ("for rt in range", "rank_tile("), ("if RANK_TILES > 1", "tl.debug_barrier"))
    shown = text.splitlines()
    assert "for rt in range" in shown[2] and "rank_tile(" in shown[4] and "tl.debug_barrier" in shown[-1]
    elided = [line for line in shown if "⋮" in line]
    assert len(elided) >= 2 and all("lines not shown" in line for line in elided)
    numbers = [int(line.split()[0]) for line in shown[1:] if "⋮" not in line]
    assert numbers == sorted(numbers)                         # in file order, never reordered
    with pytest.raises(ValueError, match="'no such line' is not in one_shot_kernel"):
        show_code(one_shot_kernel, ("no such line", "rank_tile("))
    with pytest.raises(TypeError, match="excerpts: expected"):
        show_code(one_shot_kernel, "rank_tile(")


def test_data_committed_and_live_switch(capsys, monkeypatch):
    monkeypatch.setattr(lesson, "gpu_available", lambda: False)
    assert lesson.live_mode(True) is False
    assert "no CUDA GPU here" in capsys.readouterr().out
    assert lesson.live_mode(False) is False
    assert "committed H200 data" in capsys.readouterr().out
    rows = lesson.data("registers")
    assert rows == results.load("registers")
    assert lesson.source(rows).startswith("committed data: " + rows[0]["gpu"])
    with pytest.raises(ValueError, match="needs the benchmark's arguments"):
        lesson.data("registers", live=True)
    with pytest.raises(ValueError, match="no live traces"):
        lesson.traces("nothing", live=True)


def test_a_tile_walk_under_older_rules_is_shown_with_that_label(tmp_path, monkeypatch):
    """A walk (results.WALKS) measured under older rules loads, and its source says so; any other
    file measured under older rules is refused."""
    row = dict(M=1, us_median=2.5, gpu="G", torch="t", triton="x", date="2026-01-01", **results.stamp())
    old = dict(row, config="0a0a0a0a0a0a", code="abc1234567")
    monkeypatch.setattr(results, "DATA_DIR", tmp_path)
    for name in ("lora_tune", "registers"):
        results.write_csv([old], tmp_path / f"{name}.csv")
    got = lesson.data("lora_tune")
    assert got[0]["us_median"] == 2.5
    assert "measured under older tile and schedule rules (config 0a0a0a0a0a0a, code abc1234567)" in lesson.source(got)
    with pytest.raises(results.StaleDataError, match="registers.csv was produced by other code"):
        lesson.data("registers")
    results.write_csv([row], tmp_path / "lora_tune.csv")
    assert "older" not in lesson.source(lesson.data("lora_tune"))


def test_show_code_sees_through_decorators():
    from moelora_lab.layer.streams import Streams
    text = show_code(Streams.side)                           # a @contextlib.contextmanager method
    assert text.splitlines()[0] == "moelora_lab/layer/streams.py, side:"


def test_live_claims_report_instead_of_failing(capsys, monkeypatch):
    monkeypatch.setattr(lesson, "gpu_available", lambda: True)
    monkeypatch.setattr("torch.cuda.get_device_name", lambda *a: "Some GPU")
    assert lesson.live_mode(True) is True
    assert claim("x is {x}", x=1, holds=False) == "x is 1"
    assert "[does not hold here; it holds for the committed H200 data] x is 1" in capsys.readouterr().out
    lesson.live_mode(False)                                  # back to committed data: claims fail again
    with pytest.raises(ClaimError):
        claim("x is {x}", x=1, holds=False)
