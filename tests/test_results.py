"""The data stamp: committed files must fit the code's schema and tile rules, or be refused by name."""
from pathlib import Path

import pytest

from moelora_lab import results, rules

from moelora_lab.results import DATA_SCHEMA, StaleDataError, check_current, config_fingerprint, load, stamp


def rows(**change):
    return [dict(dict(M=1, us_median=2.5, gpu="GPU", torch="2", triton="3", date="d", **stamp()), **change)]


def test_fingerprint_follows_every_rule(monkeypatch):
    before = config_fingerprint()
    assert len(before) == 12 and before == config_fingerprint()
    monkeypatch.setattr(rules, "TWO_KERNEL_MAX_PAIRS", rules.TWO_KERNEL_MAX_PAIRS * 2)
    assert config_fingerprint() != before                     # the auto rule moved
    monkeypatch.undo()
    monkeypatch.setattr(rules, "MAX_EXPAND_COLUMNS", 2048)
    assert config_fingerprint() != before                     # a tile rule moved
    monkeypatch.undo()
    monkeypatch.setattr(rules, "SIDE_PROGRAMS", rules.SIDE_PROGRAMS * 2)
    assert config_fingerprint() != before                     # the side stream's tiles moved
    monkeypatch.undo()
    from moelora_lab import base_moe as moe
    monkeypatch.setattr(moe, "gpu_gemm_tiles", lambda per_expert, lora=False: dict(BLOCK_M=16))
    assert config_fingerprint() != before                     # the base GEMM's tiles moved


def test_check_current_refuses_stale_rows():
    assert check_current(rows(), "f.csv")[0]["us_median"] == 2.5
    with pytest.raises(StaleDataError, match=r"f.csv was produced by other code \(schema 1 / config"):
        check_current(rows(schema=1), "f.csv")
    with pytest.raises(StaleDataError, match="bash scripts/gpu_data.sh"):
        check_current(rows(config="000000000000"), "f.csv")
    with pytest.raises(StaleDataError, match="schema none"):          # a file from before the stamp
        check_current([dict(M=1)], "old.csv")
    with pytest.raises(StaleDataError, match="no rows"):
        check_current([], "f.csv")


def test_load_round_trip_and_missing(tmp_path):
    results.write_csv(rows(), tmp_path / "x.csv")
    got = load("x", tmp_path)
    assert got[0]["M"] == 1 and got[0]["schema"] == DATA_SCHEMA and got[0]["config"] == config_fingerprint()
    with pytest.raises(FileNotFoundError, match="y.csv is missing"):
        load("y", tmp_path)


def test_older_rules_are_loaded_only_when_asked_and_labelled(tmp_path):
    results.write_csv(rows(config="0a0a0a0a0a0a", code="abc1234567"), tmp_path / "old.csv")
    with pytest.raises(StaleDataError, match="old.csv was produced by other code"):
        load("old", tmp_path)
    got = load("old", tmp_path, accept_older_rules=True)
    assert got[0]["us_median"] == 2.5
    label = results.older_rules(got)
    assert "config 0a0a0a0a0a0a, code abc1234567" in label and config_fingerprint() in label
    assert results.older_rules(rows()) is None
    results.write_csv(rows(schema=1, config="000000000000"), tmp_path / "columns.csv")
    with pytest.raises(StaleDataError, match="schema 1"):                 # other columns: never shown
        load("columns", tmp_path, accept_older_rules=True)


def test_code_version(monkeypatch):
    monkeypatch.setenv("MOELORA_CODE_VERSION", "abc123")
    assert results.code_version() == "abc123" and stamp()["code"] == "abc123"
    monkeypatch.delenv("MOELORA_CODE_VERSION")
    assert results.code_version()                             # a commit here, 'unknown' without git


def assert_current_or_labelled(path):
    """The rows of ``path`` carry the current schema; measured under older rules, their folder's README
    says so (section 'Measured under older rules', naming every commit they come from)."""
    rows = load(path.stem, data_dir=path.parent, accept_older_rules=True)
    label = results.older_rules(rows)
    if label:
        readme = " ".join((path.parent / "README.md").read_text().split())
        codes = {str(r["code"]) for r in rows}
        assert "Measured under older rules" in readme and all(f"code {c}" in readme for c in codes), \
            f"{path.name}: {label}; say so in {path.parent.name}/README.md (section 'Measured under older rules')"


def test_every_committed_file_is_current():
    """Every CSV and the traces the notebooks read were produced by this code's schema and rules (a tile
    walk and the two-GPU set may come from older rules, where their README says so)."""
    for path in sorted(results.DATA_DIR.glob("*.csv")):
        if path.stem == "vllm_reference":                     # measured with vLLM's code, not ours
            continue
        if path.stem in results.WALKS:
            assert_current_or_labelled(path)
        else:
            load(path.stem)
    results.load_traces()
    for path in sorted((results.DATA_DIR.parent / "h200x2").glob("*.csv")):
        assert_current_or_labelled(path)


def test_history_files_are_listed_and_labelled():
    """Every file kept for a before/after comparison has the current schema, is measured under older rules
    or by older kernels than the current file of its name (else it belongs in data/h200) and is described
    in data/history/README.md. A probe (its ``command`` starts with ``probe:``: a benchmark with its variants
    replaced) may be measured under the current rules: it has no current file."""
    readme = " ".join((results.HISTORY_DIR / "README.md").read_text().split())
    files = sorted(results.HISTORY_DIR.glob("*.csv"))
    assert files
    for path in files:
        rows = load(path.stem, results.HISTORY_DIR, accept_older_rules=True)
        if not results.older_rules(rows) and not rows[0]["command"].startswith("probe:"):
            # then an older run of a current file: <name>_<code>.csv
            # (a current file may join cases of two runs: compare each case with the same case there)
            current = results.read_csv(results.DATA_DIR / f"{path.stem.rsplit('_', 1)[0]}.csv")
            keys = [k for k in ("preset", "M", "rank", "variant") if k in rows[0]]
            code_now = {tuple(r.get(k) for k in keys): r["code"] for r in current}
            same = [r for r in rows if code_now.get(tuple(r.get(k) for k in keys)) == r["code"]]
            assert not same, \
                f"{path.name} is measured under the current rules by the current code: move it to data/h200"
        assert f"`{path.name}`" in readme and all(f"code {r['code']}" in readme for r in rows[:1]), path.name


def test_data_readme_lists_every_file():
    text = (results.DATA_DIR / "README.md").read_text()
    listed = {name for name in __import__("re").findall(r"`([\w.*-]+\.(?:csv|json|log|png))`", text)}
    for path in results.DATA_DIR.iterdir():
        if path.name == "README.md":
            continue
        assert path.name in listed or any(
            "*" in n and path.name.startswith(n.split("*")[0]) and path.suffix == Path(n).suffix for n in listed), \
            f"{path.name} is committed but data/h200/README.md does not say what it is"


@pytest.mark.parametrize("name", ["layer.csv", "layer_in_k.csv"])
def test_data_readme_clock_ranges_match_the_files(name):
    """The SM clocks the data README quotes for a file are the file's."""
    import re
    text = " ".join((results.DATA_DIR / "README.md").read_text().split())
    found = re.search(rf"`{re.escape(name)}`, its mean SM clock during a case: (\d+)–(\d+) MHz up to M = 512, "
                      r"(\d+)–(\d+) at M = 2048, (\d+)–(\d+) at M = 8192", text)
    assert found, f"data/h200/README.md: the sentence quoting {name}'s SM clocks is gone"
    clocks = {}
    for row in results.read_csv(results.DATA_DIR / name):
        band = "small" if row["M"] <= 512 else row["M"]
        clocks.setdefault(band, []).append(row["sm_mhz_mean"])
    quoted = [int(v) for v in found.groups()]
    assert quoted == [int(f(clocks[b])) for b in ("small", 2048, 8192) for f in (min, max)]


def test_data_readme_quotes_the_gpu_test_log():
    """The GPU suite's counts the data README quotes are the committed log's last line, and every test
    that failed in the log is named there (with its reason): a failure is never left unsaid."""
    import re
    text = (results.DATA_DIR / "README.md").read_text()
    row = re.search(r"`gpu_tests.log` \| the whole test suite on the GPU at (\w+)[^|]*?: (\d+) passed, "
                    r"(none|\d+) failed[^|]*\|", text)
    assert row, "data/h200/README.md: the gpu_tests.log row no longer says what the suite gave"
    code, passed, failed = row.groups()
    log = (results.DATA_DIR / "gpu_tests.log").read_text().strip().splitlines()
    assert f"code {code};" in log[0]
    if failed == "none":
        assert re.match(rf"{passed} passed, \d+ skipped in ", log[-1]) and "failed" not in log[-1]
    else:
        assert re.match(rf"{failed} failed, {passed} passed, \d+ skipped in ", log[-1]), log[-1]
    names = [re.match(r"FAILED tests/[\w/]+\.py::(\S+)", line).group(1) for line in log if line.startswith("FAILED ")]
    assert len(names) == (0 if failed == "none" else int(failed))
    for name in names:
        assert f"`{name}`" in row.group(0), f"data/h200/README.md: the failed GPU test {name} is not named"


def test_data_readme_quotes_the_counters_clock():
    """The SM clock range the data README gives for the run under the profiler is the file's."""
    import re
    text = " ".join((results.DATA_DIR / "README.md").read_text().split())
    found = re.search(r"The profiler ran the GPU at (\d+)–(\d+) MHz \(`sm_mhz`\)", text)
    assert found, "data/h200/README.md: the sentence quoting lora_dram.csv's SM clocks is gone"
    clocks = [row["sm_mhz"] for row in results.read_csv(results.DATA_DIR / "lora_dram.csv")]
    assert [int(v) for v in found.groups()] == [min(clocks), max(clocks)]


def test_label_of_a_file_that_joins_two_runs():
    row = dict(gpu="NVIDIA H200", torch="2.11", triton="3.6", date="2026-12-04", code="aaa")
    assert results.label(row).endswith("2026-12-04, code aaa")
    assert results.label([row, dict(row, code="bbb"), row]).endswith("2026-12-04, code aaa + bbb")
    with pytest.raises(KeyError, match="provenance field"):
        results.label([row, {"gpu": "x"}])


def test_the_house_move_left_the_layer_as_fast_as_before():
    """``history/layer_house_44ce2cf.csv``: the layer before and after the schedule table, timed in one call."""
    rows = load("layer_house_44ce2cf", results.HISTORY_DIR, accept_older_rules=True)
    by = {}
    for r in rows:
        by.setdefault((r["rank"], r["M"], r["variant"]), {})[r["code"]] = r
    assert len(by) == 32 and all(len(v) == 2 for v in by.values())
    for key, pair in by.items():
        before, after = pair["d42157a"], pair["44ce2cf"]
        assert (before["schedule"], before["lora_path"]) == (after["schedule"], after["lora_path"]), key
        assert float(after["us_median"]) <= 1.03 * float(before["us_median"]), key


def test_load_first_takes_the_first_gpu_folder_that_has_the_file(tmp_path, monkeypatch):
    first, second = tmp_path / "h200", tmp_path / "h100"
    results.write_csv(rows(gpu="B"), second / "x.csv")
    monkeypatch.setattr(results, "GPU_DIRS", (first, second))
    assert results.load_first("x")[0]["gpu"] == "B"
    results.write_csv(rows(gpu="A"), first / "x.csv")
    assert results.load_first("x")[0]["gpu"] == "A"
    with pytest.raises(FileNotFoundError, match="y.csv is in none of h200, h100"):
        results.load_first("y")


def test_h100_readme_quotes_its_files_and_its_suite():
    """data/h100/README.md names every file there, quotes the suite log's counts and code, and names the file of
    every test that failed in it."""
    import re
    folder = results.DATA_DIR.parent / "h100"
    text = " ".join((folder / "README.md").read_text().split())
    for path in folder.iterdir():
        assert path.name == "README.md" or f"`{path.name}`" in text, path.name
    log = (folder / "gpu_tests.log").read_text()
    code = re.match(r"# [^;]+; [^;]+; code (\w+);", log).group(1)
    failed, passed, skipped = re.search(r"(\d+) failed, (\d+) passed, (\d+) skipped in", log).groups()
    assert f"at code {code}" in text and f"{passed} passed, {failed} failed, {skipped} skipped" in text
    for test_file in set(re.findall(r"^FAILED (tests/[\w/]+\.py)::", log, re.M)):
        assert f"`{test_file}" in text, test_file
    for name in ("train", "grad"):
        assert results.load(name, folder)                                   # current code, current schema
