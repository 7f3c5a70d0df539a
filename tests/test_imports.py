"""The import graph of ``moelora_lab``: no cycles, and the benchmark sits on top of the library.

The graph is read from the source (``ast``), not from ``sys.modules``: every ``import`` statement
counts, including those inside functions, which Python runs late and so would hide a cycle from an
import-time check. ``from package import name`` points at ``package.name`` when that is a module
and at the package (its ``__init__``) otherwise; relative imports resolve against the importing
module's package, as Python resolves them.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "moelora_lab"


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted name -> file of every module under ``root / package`` (``__init__.py`` names the package)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of ``from <level dots><target> import ...`` written in ``module``."""
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level - 1 > len(base) - 1:
        raise ValueError(f"{module}: relative import beyond the top-level package")
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _known(name: str, modules) -> str | None:
    """``name`` or its longest prefix that is one of ``modules`` (``import a.b.c`` where c is a class: a.b)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the modules of ``package`` it imports, anywhere in its body."""
    files = module_names(root, package)
    graph = {name: set() for name in files}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node.level, node.module)
                for alias in node.names:      # `from . import x`: the submodule x when there is one
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in files else base)
            for target in targets:
                found = _known(target, files)
                if found is not None and found != name:
                    graph[name].add(found)
    return graph


def tangles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components that hold a cycle (Tarjan): modules that import each other."""
    index, low, stack, on_stack, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle ``[a, b, ..., a]`` per tangle (:func:`tangles`)."""
    return [_cycle_in(graph, comp) for comp in tangles(graph)]


def _cycle_in(graph, comp: set[str]) -> list[str]:
    """A shortest cycle through the first (sorted) node of a strongly connected component."""
    start = min(comp)
    paths, seen = [[start]], set()
    while paths:
        path = paths.pop(0)
        for w in sorted(graph.get(path[-1], ())):
            if w == start:
                return path + [start]
            if w in comp and w not in seen:
                seen.add(w)
                paths.append(path + [w])
    raise AssertionError(f"no cycle through {start}")      # unreachable for a strongly connected component


def reachable(graph, start: str) -> dict[str, str]:
    """Every module ``start`` imports, directly or not -> the module that imports it on the way."""
    via, todo = {}, [start]
    while todo:
        v = todo.pop()
        for w in graph.get(v, ()):
            if w not in via and w != start:
                via[w] = v
                todo.append(w)
    return via


def _chain(via, start, end) -> str:
    out = [end]
    while out[-1] != start:
        out.append(via[out[-1]])
    return " -> ".join(reversed(out))


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.fixture(scope="module")
def graph():
    return import_graph(ROOT, PACKAGE)


def test_no_import_cycles(graph):
    found = [f"{' -> '.join(_cycle_in(graph, comp))}   (tangled: {', '.join(sorted(comp))})"
             for comp in tangles(graph)]
    assert not found, "import cycles in moelora_lab:\n" + "\n".join(found)


def test_plots_never_reach_the_benchmark(graph):
    bad = []
    for name in graph:
        if _in(name, f"{PACKAGE}.plots"):
            via = reachable(graph, name)
            bad += [_chain(via, name, w) for w in via if _in(w, f"{PACKAGE}.bench")]
    assert not bad, "plots import benchmark code (read data with moelora_lab.results):\n" + "\n".join(bad)


def test_only_the_benchmark_imports_the_benchmark(graph):
    bad = [f"{name} -> {w}" for name, deps in graph.items() if not _in(name, f"{PACKAGE}.bench")
           for w in deps if _in(w, f"{PACKAGE}.bench")]
    assert not bad, "library modules import the benchmark package:\n" + "\n".join(bad)


def test_benchmark_cli_is_imported_by_main_only(graph):
    users = sorted(name for name, deps in graph.items() if f"{PACKAGE}.bench.cli" in deps)
    assert users == [f"{PACKAGE}.bench.__main__"]


def test_the_graph_sees_the_benchmark_subcommands(graph):
    """The graph is not vacuous: the CLI reaches every subcommand and they reach the library."""
    cli = graph[f"{PACKAGE}.bench.cli"]
    sweeps = {n for n in graph if n.startswith(f"{PACKAGE}.bench.") and n.endswith("_sweep")}
    assert len(sweeps) >= 8 and sweeps <= cli
    assert f"{PACKAGE}.layer" in graph[f"{PACKAGE}.bench.layer_sweep"]


# --- the detector itself, on graphs made up for the test -------------------------------------------

def test_find_cycles_on_small_graphs():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"a"}}) == [["a", "a"]]
    two = find_cycles({"a": {"b"}, "b": {"a"}, "x": {"y"}, "y": {"z"}, "z": {"x", "a"}})
    assert sorted(map(tuple, two)) == [("a", "b", "a"), ("x", "y", "z", "x")]


def _write(root: Path, files: dict[str, str]):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_import_graph_counts_imports_inside_functions(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "from .core import run\n",
        "pkg/core.py": "def run():\n    from .sub import tool\n    return tool\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/tool.py": "def f():\n    from .. import core\n",     # core -> sub.tool -> core
        "pkg/sub/other.py": "import pkg.sub.tool\nfrom pkg.core import run\nimport os\n",
    })
    g = import_graph(tmp_path, "pkg")
    assert g == {"pkg": {"pkg.core"}, "pkg.core": {"pkg.sub.tool"}, "pkg.sub": set(),
                 "pkg.sub.tool": {"pkg.core"}, "pkg.sub.other": {"pkg.sub.tool", "pkg.core"}}
    assert find_cycles(g) == [["pkg.core", "pkg.sub.tool", "pkg.core"]]


def test_import_graph_without_a_cycle(tmp_path):
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from . import b\n", "pkg/b.py": "from .c import X\n",
                      "pkg/c.py": "X = 1\n"})
    g = import_graph(tmp_path, "pkg")
    assert g["pkg.a"] == {"pkg.b"} and g["pkg.b"] == {"pkg.c"} and find_cycles(g) == []
    assert _chain(reachable(g, "pkg.a"), "pkg.a", "pkg.c") == "pkg.a -> pkg.b -> pkg.c"


def test_notebooks_import_only_existing_public_names():
    """Every ``import`` in the notebooks' code cells (inside functions too, e.g. a GPU-only branch that
    CI never runs) names a module and attribute that exist, and none reaches into the benchmark."""
    import ast as _ast
    import importlib.util
    import json as _json

    for lab_only in ("plotly", "ipywidgets", "anywidget"):      # the lab extra (absent from a bare GPU image)
        pytest.importorskip(lab_only)
    root = Path(__file__).resolve().parent.parent
    for nb in sorted((root / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(_json.loads(nb.read_text())["cells"]):
            if cell["cell_type"] != "code":
                continue
            src = "\n".join(line for line in "".join(cell["source"]).splitlines()
                            if not line.lstrip().startswith(("%", "!")))
            for node in _ast.walk(_ast.parse(src)):
                if isinstance(node, _ast.Import):
                    pairs = [(a.name, None) for a in node.names]
                elif isinstance(node, _ast.ImportFrom):
                    pairs = [(node.module, a.name) for a in node.names]
                else:
                    continue
                for module, name in pairs:
                    where = f"{nb.name} cell {i}: {module}" + (f".{name}" if name else "")
                    if not module.startswith("moelora_lab"):
                        continue
                    assert not module.startswith("moelora_lab.bench"), f"{where}: notebooks use public helpers"
                    mod = importlib.import_module(module)
                    assert name is None or hasattr(mod, name) or importlib.util.find_spec(f"{module}.{name}"), \
                        f"{where} does not exist"
