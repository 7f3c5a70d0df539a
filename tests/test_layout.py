"""The package is a ladder: every module imports only its own floor and the floors below (README, "What is inside"),
and the package root holds few flat modules."""
import ast
from pathlib import Path

import moelora_lab as ml

PACKAGE = Path(ml.__file__).parent
# floors from the bottom; a top-level name is a module or a subpackage of moelora_lab
FLOORS = [
    {"_backend", "validate", "blocks", "tiles", "rules", "reference", "kernels"},
    {"routing"},
    {"op", "base_moe", "config", "quant"},
    {"layer"},
    {"experiments", "adapters", "dist", "train"},
    {"profile", "results"},
    {"bench", "plots", "exercises", "lesson", "summary"},
]
FLOOR = {name: i for i, names in enumerate(FLOORS) for name in names}
# modules that sit on another floor than their package's: the distributed benchmark is a benchmark
ON_FLOOR_OF = {"dist/bench.py": "bench"}


def imported(path: Path) -> set:
    """Top-level moelora_lab names ``path`` imports anywhere in it (lazy imports included)."""
    rel = path.relative_to(PACKAGE).with_suffix("").parts
    package = list(rel[:-1])                    # the module's package inside moelora_lab
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                parts = base + (node.module.split(".") if node.module else [])
                if not parts:                   # `from . import x` at the package root
                    names.update(a.name for a in node.names)
                    continue
                names.add(parts[0])
            elif node.module and node.module.startswith("moelora_lab."):
                names.add(node.module.split(".")[1])
            elif node.module == "moelora_lab":
                names.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name.split(".")[1] for a in node.names if a.name.startswith("moelora_lab."))
    return names


def test_every_module_has_a_floor():
    tops = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
            if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").exists())}
    assert tops == set(FLOOR), f"floors missing {sorted(tops - set(FLOOR))}, stale {sorted(set(FLOOR) - tops)}"


def test_no_module_imports_a_floor_above_its_own():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts == ("__init__.py",):
            continue                            # the package's face re-exports from every floor
        top = ON_FLOOR_OF.get(rel.as_posix(), rel.parts[0].removesuffix(".py"))
        for name in imported(path):
            if name in FLOOR and FLOOR[name] > FLOOR[top]:
                upward.append(f"{rel} imports {name}")
    assert not upward, upward


def test_few_flat_modules():
    flat = [p.name for p in PACKAGE.glob("*.py")]
    assert len(flat) <= 12, sorted(flat)
