"""Every command line of the package explains each of its options, and the GPU-only ones say so and stop at once."""
import argparse
import ast
from pathlib import Path

import pytest
import torch

import moelora_lab
from moelora_lab.bench import cli as bench_cli
from moelora_lab.dist import bench as dist_bench
from moelora_lab.exercises import __main__ as exercises_cli
from moelora_lab.profile import trace_events
from moelora_lab.train import __main__ as train_cli

PACKAGE = Path(moelora_lab.__file__).parent
# module (as `python -m` names it) -> (its parser, whether it needs a CUDA GPU)
CLIS = {
    "moelora_lab.bench": (bench_cli.build_parser, True),
    "moelora_lab.dist.bench": (dist_bench.build_parser, True),
    "moelora_lab.exercises": (exercises_cli.build_parser, False),
    "moelora_lab.profile.trace_events": (trace_events.build_parser, False),
    "moelora_lab.train": (train_cli.build_parser, False),
}


def _parsers(parser: argparse.ArgumentParser, prog: str):
    """(prog, parser) of ``parser`` and of every subcommand below it."""
    yield prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, child in action.choices.items():
                assert helps.get(name), f"{prog} {name}: the subcommand has no help line in {prog} --help"
                yield from _parsers(child, f"{prog} {name}")


def _argparse_modules() -> set[str]:
    """Modules of the package that build an ArgumentParser and can run as ``python -m``."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        tree = ast.parse(text)
        builds = any(isinstance(n, ast.Attribute) and n.attr == "ArgumentParser" for n in ast.walk(tree))
        if builds:
            module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
            found.add(module.removesuffix(".cli").removesuffix(".__main__"))
    return found


def test_every_command_line_is_covered():
    assert _argparse_modules() == set(CLIS), "a module builds an ArgumentParser: add its build_parser to CLIS"


@pytest.mark.parametrize("module", sorted(CLIS))
def test_every_option_has_help(module):
    build, _ = CLIS[module]
    missing = []
    for prog, parser in _parsers(build(), f"python -m {module}"):
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if not (action.help or "").strip():
                missing.append(f"{prog} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, f"options without help text: {missing}"


@pytest.mark.parametrize("module", sorted(m for m, (_, gpu) in CLIS.items() if gpu))
def test_gpu_commands_say_so_in_their_help(module):
    build, _ = CLIS[module]
    for prog, parser in _parsers(build(), f"python -m {module}"):
        text = " ".join(parser.format_help().split())
        assert "CUDA GPU" in text, f"{prog} --help does not say that it needs a CUDA GPU"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("argv", [["layer"], ["kernels", "--presets", "tiny"], ["registers"]])
def test_bench_refuses_at_once_without_a_gpu(argv, capsys):
    assert bench_cli.main(argv) == 2
    assert "needs a GPU" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks the refusal on a machine with fewer than 2 GPUs")
def test_dist_bench_refuses_at_once_without_gpus(capsys):
    assert dist_bench.main(["--world", "2"]) == 2
    assert "needs 2 CUDA GPUs" in capsys.readouterr().err
