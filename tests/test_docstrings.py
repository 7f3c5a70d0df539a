"""The public functions' docstrings are numpy-style with an Examples section, and the examples run as written.

The examples use CPU tensors: they run where the kernels run on the Triton interpreter (no GPU, or
``MOELORA_INTERPRET=1``). Elsewhere the test runs them in a fresh interpreter with ``MOELORA_INTERPRET=1``,
which must be set before ``moelora_lab`` (and so the kernels) is imported.
"""
from __future__ import annotations

import doctest
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# (module, function): every public entry point a newcomer calls first
FUNCTIONS = [
    ("moelora_lab.op.face", "moe_lora"), ("moelora_lab.op.face", "pack_lora_b"),
    ("moelora_lab.op.grad", "moe_lora_backward"),
    ("moelora_lab.layer.face", "moe_lora_layer"), ("moelora_lab.layer.plan", "plan_layer"),
    ("moelora_lab.layer.in_k_pack", "pack_in_k"), ("moelora_lab.routing.host", "block_list"),
    ("moelora_lab.routing.host", "route"), ("moelora_lab.config", "make_problem"),
    ("moelora_lab.adapters.peft", "load_peft"), ("moelora_lab.adapters.peft", "save_peft"),
    ("moelora_lab.dist.ep", "ep_layer"), ("moelora_lab.dist.tp", "tp_layer"), ("moelora_lab.dist.launch", "run_local"),
]
SECTIONS = ("Parameters", "Returns", "Examples")


def _function(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def run_examples() -> list[str]:
    """Run every listed function's examples; one line per failure (the doctest report) or a missing example."""
    finder, problems = doctest.DocTestFinder(recurse=False), []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for module, name in FUNCTIONS:
        fn = _function(module, name)
        tests = [t for t in finder.find(fn, f"{module}.{name}", globs={}) if t.examples]
        if not tests:
            problems.append(f"{module}.{name}: no examples")
        for test in tests:
            out: list[str] = []
            result = runner.run(test, out=out.append, clear_globs=True)
            if result.failed:
                problems.append("".join(out))
    return problems


def test_every_function_has_the_numpy_sections():
    missing = []
    for module, name in FUNCTIONS:
        doc = _function(module, name).__doc__ or ""
        for section in SECTIONS:
            if not re.search(rf"^\s*{section}\n\s*-{{{len(section)}}}\s*$", doc, re.M):
                missing.append(f"{module}.{name}: {section}")
    assert not missing, f"docstring sections missing: {missing}"


def test_the_examples_run():
    import moelora_lab

    if moelora_lab.INTERPRET:
        problems = run_examples()
    else:          # the kernels compile for the GPU here: run the CPU examples in an interpreted process
        from moelora_lab._backend import interpreter_breaks
        if interpreter_breaks():
            pytest.skip(f"the examples run on the CPU, under the interpreter: {interpreter_breaks()}")
        root = Path(__file__).resolve().parents[1]
        env = dict(os.environ, MOELORA_INTERPRET="1",          # the checkout first, installed or not
                   PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
        done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600,
                              cwd=root)
        problems = [done.stdout + done.stderr] if done.returncode else []
    assert not problems, "\n".join(problems)


if __name__ == "__main__":
    found = run_examples()
    print("\n".join(found))
    sys.exit(1 if found else 0)
