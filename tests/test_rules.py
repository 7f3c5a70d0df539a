"""The measured rules (``moelora_lab.rules``): each one says why and names its data, the data stamp sees
each one move, and the functions that apply them read them when called."""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from moelora_lab import rules

from moelora_lab.routing import device as align

from moelora_lab import base_moe as moe
from moelora_lab.results import config_fingerprint
from moelora_lab.tiles import KernelConfig

PACKAGE = Path(rules.__file__).resolve().parent
ROOT = PACKAGE.parent
DATA_PATH = re.compile(r"\bdata/(?:h200|history)/[\w.-]+\.\w+")

def rule_comments() -> dict[str, list[str]]:
    """Each public UPPER_CASE constant assigned at the top of rules.py -> the comment lines right above it."""
    source = Path(rules.__file__).read_text()
    lines = source.splitlines()
    found = {}
    for node in ast.parse(source).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            if isinstance(target, ast.Name) and target.id.isupper() and not target.id.startswith("_"):
                above, at = [], node.lineno - 2
                while at >= 0 and lines[at].lstrip().startswith("#"):
                    above.insert(0, lines[at].strip())
                    at -= 1
                found[target.id] = above
    return found


RULES = sorted(rule_comments())


def test_every_rule_says_why_and_names_its_data():
    comments = rule_comments()
    public = {name for name in vars(rules) if name.isupper() and not name.startswith("_")}
    assert public == set(comments), "rules.py: every rule is a plain assignment with its comment above it"
    assert len(comments) >= 40                                      # the parse is not vacuous
    for name, above in comments.items():
        assert len(above) == 1 and not above[0].startswith("# ---"), f"{name}: one comment line right above it"
        paths = DATA_PATH.findall(above[0])
        assert paths, f"{name}: its comment names no data file (data/h200/... or data/history/...)"
        for path in paths:
            assert (PACKAGE / path).is_file(), f"{name}: {path} does not exist"
        why = above[0].lstrip("#").split(paths[0])[0]
        assert len(re.findall(r"[A-Za-z]{2,}", why)) >= 4, f"{name}: say what was measured and why, not only where"


def moves(value) -> dict[str, object]:
    """Named perturbations of one rule's value, each a valid rule of the same kind."""
    if isinstance(value, bool):
        return {"flip": not value}
    if isinstance(value, int):
        return {"x2": value * 2, "/2": value // 2}
    if isinstance(value, str):
        return {"True": True, "False": False}
    if isinstance(value, dict) and all(isinstance(v, KernelConfig) for v in value.values()):
        fields = ("block_m", "block_n", "block_k", "max_block_r", "num_warps", "num_stages")
        return {f"{name}.{field} x2": dict(value, **{name: cfg.replace(**{field: getattr(cfg, field) * 2})})
                for name, cfg in value.items() for field in fields}
    if isinstance(value, dict):
        return {f"{key} x2": dict(value, **{key: v * 2}) for key, v in value.items()}
    raise TypeError(f"no perturbation for {value!r}")


@pytest.mark.parametrize("name", RULES)
def test_the_fingerprint_sees_every_rule_move(name, monkeypatch):
    """Every move of every rule changes the fingerprint: no rule changes under the committed data unnoticed."""
    before = config_fingerprint()
    missed = []
    for move, value in moves(getattr(rules, name)).items():
        monkeypatch.setattr(rules, name, value)
        if config_fingerprint() == before:
            missed.append(move)
        monkeypatch.undo()
    assert config_fingerprint() == before
    assert not missed, f"{name}: the fingerprint missed the moves {missed}"


def test_rules_steer_their_functions_when_called(monkeypatch):
    monkeypatch.setattr(rules, "SUM_TILE_MAX_PAIRS", 7)
    assert moe.rows_as_tile(7) and not moe.rows_as_tile(8)
    monkeypatch.setattr(rules, "HALF_TAIL_MIN_BLOCK", 64)
    assert moe.half_tail(64) and not moe.half_tail(32)
    monkeypatch.setattr(rules, "TAIL_ALIGN", 256)
    assert moe.tail_start(130) == 256
    monkeypatch.setattr(rules, "SUB", 256)
    assert align.chunk_pairs(1 << 20) == 256
    monkeypatch.setattr(rules, "TABLE_BLOCKS", 2)
    assert align._table_sizes([(4, 16, 9, 0, 0, 1)])[2] == 5
    with align.construction(sort_max_pairs=3, recount_max_pairs=5, chained=False):
        assert (rules.SORT_MAX_PAIRS, rules.RECOUNT_MAX_PAIRS, rules.PDL) == (3, 5, False)
    assert (rules.SORT_MAX_PAIRS, rules.RECOUNT_MAX_PAIRS, rules.PDL) == (256, 512, True)


def test_the_in_gemm_limit_is_read_when_called(monkeypatch):
    """The schedules whose LoRA is in the GEMMs name their limit's rule; the limit and ``fused_fits`` read it."""
    from moelora_lab.layer import SCHEDULES
    from moelora_lab.layer.plan import fused_fits

    limited = [row for row in SCHEDULES.values() if row.max_columns == "MAX_FUSED_COLUMNS"]
    assert limited and all(row.too_wide(3, 8) is None for row in limited) and fused_fits(3, 8)
    monkeypatch.setattr(rules, "MAX_FUSED_COLUMNS", 16)                 # L*r = 24, padded to 32
    assert all("L*r <= 16" in row.too_wide(3, 8) for row in limited) and not fused_fits(3, 8)


def test_rules_holds_only_rules():
    """No function or class is defined in rules.py: only the constants and what they are built from."""
    own = {name for name, value in vars(rules).items()
           if not name.startswith("_") and getattr(value, "__module__", None) == rules.__name__}
    assert not own, f"rules.py defines {sorted(own)}: keep code with the modules the rules steer"


def _reads_rules(node) -> bool:
    return (isinstance(node, ast.Name) and node.id == "rules") or (isinstance(node, ast.Attribute)
                                                                     and node.attr == "rules")


def rule_copies(source: str) -> list[str]:
    """Where ``source`` reads or sets a rule other than as ``rules.NAME`` when it runs: through another module
    (``dispatch.NAME``, ``setattr(align, "NAME", ...)``), as a copy taken at import (``from ... import NAME``)
    or as a constant of the same name at the top of a module."""
    names = set(RULES)
    tree = ast.parse("\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found += [f"line {node.lineno}: from {node.module} import {a.name}" for a in node.names if a.name in names]
        elif isinstance(node, ast.Attribute) and node.attr in names and not _reads_rules(node.value):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and ast.unparse(node.func).endswith(("setattr", "getattr"))
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in names
              and not _reads_rules(node.args[0])):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        found += [f"line {node.lineno}: {t.id} = ..." for t in targets if isinstance(t, ast.Name) and t.id in names]
    return found


def test_the_copy_finder_sees_each_form():
    for form in ("from moelora_lab.op.dispatch import CONFIGS", "dispatch.CONFIGS['decode']", "moe.SUM_TILE_MAX_PAIRS + 1",
                 "align.PDL = False", 'monkeypatch.setattr(align, "PDL", False)', "setattr(align, 'SUB', 4)",
                 "FILL_ROWS = 32", "MAX_FUSED_COLUMNS: int = 128"):
        assert rule_copies(form), form
    assert not rule_copies('rules.CONFIGS["decode"]\nml.rules.SUB\nmonkeypatch.setattr(rules, "PDL", False)\n'
                           'rules.PDL = True\ndef f(SUB=4):\n    PDL = 1\n')


def sources():
    """(where, source) of every file that may touch a rule: the package but rules.py, the tests, the scripts, the
    reference solutions and the notebooks' code cells."""
    files = [p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "rules.py" or p.parent != PACKAGE]
    for folder in ("tests", "scripts", "solutions"):
        files += sorted((ROOT / folder).rglob("*.py"))
    for path in files:
        yield path.relative_to(ROOT).as_posix(), path.read_text()
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "code":
                yield f"{path.relative_to(ROOT).as_posix()} cell {i}", "".join(cell["source"])


def test_every_rule_is_read_and_set_as_rules_name():
    """A rule lives in ``rules`` alone: a copy elsewhere would not follow ``rules.NAME = ...`` (a probe, a
    monkeypatch), and setting it through another module would change nothing the code reads."""
    seen = list(sources())
    assert len(seen) > 100 and any(where.startswith("notebooks/") for where, _ in seen)
    copies = {where: found for where, source in seen if (found := rule_copies(source))}
    assert not copies, f"read or set a rule as rules.NAME: {copies}"
