"""The product's kernels stay readable: every ``@triton.jit`` function of ``moelora_lab/kernels`` whose
name ends in ``_kernel`` takes at most MAX_PARAMETERS parameters (read from the source, nothing compiled).
Experiment kernels (``moelora_lab/experiments/kernels``) are not held to it."""
import ast
from pathlib import Path

import pytest

import moelora_lab as ml

KERNELS = Path(ml.__file__).parent / "kernels"
MAX_PARAMETERS = 40


def _is_jit(decorator) -> bool:
    """``@triton.jit`` or ``@triton.jit(...)``."""
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Attribute) and target.attr == "jit" and \
        isinstance(target.value, ast.Name) and target.value.id == "triton"


def product_kernels() -> dict[str, int]:
    """``module.kernel`` -> its number of parameters, for every jitted ``*_kernel`` function."""
    found = {}
    for path in sorted(KERNELS.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and \
                    any(_is_jit(d) for d in node.decorator_list):
                args = node.args
                found[f"{path.stem}.{node.name}"] = len(args.posonlyargs + args.args + args.kwonlyargs)
    return found


COUNTS = product_kernels()


def test_the_kernels_are_found():
    assert {"base_moe.moe_gemm_kernel", "two_kernel.shrink_kernel", "one_shot.one_shot_kernel"} <= set(COUNTS)


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_product_kernel_parameters(name):
    assert COUNTS[name] <= MAX_PARAMETERS, f"{name} takes {COUNTS[name]} parameters (at most {MAX_PARAMETERS})"
