"""Shared pytest configuration.

* nbval: when notebooks are compared (cells marked ``# NBVAL_CHECK_OUTPUT``),
  ignore outputs that differ from run to run: HTML/JS reprs, widget views
  and anything written to stderr (warnings, progress bars).
* ``--gpu``: run on CUDA. Tests take the ``device`` fixture, which is
  ``"cuda"`` with ``--gpu`` and ``"cpu"`` without it.
* ``@pytest.mark.gpu`` (or the ``gpu`` fixture): skipped unless CUDA is
  available.
* hypothesis profiles ``ci`` (default) and ``thorough``.
"""

from __future__ import annotations

import functools

import moelora_lab  # noqa: F401  (first: without a GPU it must set up the Triton interpreter before triton loads)
import pytest
from hypothesis import HealthCheck, settings

# Property tests (tests/test_properties.py): a fixed seed and a bounded number of examples in CI;
# `--hypothesis-profile=thorough` for a longer, randomised local run.
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]
settings.register_profile("ci", derandomize=True, max_examples=25, deadline=None, print_blob=True,
                          suppress_health_check=_SLOW_OK)
settings.register_profile("thorough", max_examples=300, deadline=None, print_blob=True,
                          suppress_health_check=_SLOW_OK)
settings.load_profile("ci")

NBVAL_SKIP_COMPARE = (
    "text/html",
    "application/javascript",
    "application/vnd.jupyter.widget-view+json",
    "stderr",
)


@functools.cache
def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


class _NbvalSkipCompare:
    """Extends ``skip_compare`` of nbval's notebook collectors (see nbval docs).

    Registered as a plugin rather than written as a conftest hook: conftest
    hooks only see collectors below their own folder, and the notebooks live
    outside ``tests/``.
    """

    @staticmethod
    def pytest_collectstart(collector):
        try:
            from nbval.plugin import IPyNbFile
        except ImportError:
            return
        if isinstance(collector, IPyNbFile):
            collector.skip_compare += tuple(
                k for k in NBVAL_SKIP_COMPARE if k not in collector.skip_compare
            )


def pytest_addoption(parser):
    parser.addoption(
        "--gpu",
        action="store_true",
        default=False,
        help="run tests on CUDA (the `device` fixture returns 'cuda')",
    )


# Test modules whose module-scoped fixture starts process groups (tens of seconds under the interpreter): as one
# unit they set it up once, where split over the workers each worker would set it up again.
ONE_UNIT_MODULES = ("tests/test_dist.py", "tests/test_dist_inputs.py")


class _NotebookOnOneWorker:
    """Under pytest-xdist (``-n N``): a notebook's cells share one kernel and run in
    order, so each notebook goes to one worker as one unit, and so does each module of
    ``ONE_UNIT_MODULES``; every other test is a unit of its own, as under xdist's plain ``load``.
    """

    @staticmethod
    def pytest_xdist_make_scheduler(config, log):
        if config.getvalue("dist") not in ("load", "loadgroup"):
            return None                        # an explicit other --dist is the caller's choice
        from xdist.scheduler import LoadScopeScheduling

        class NotebookScopes(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                path = nodeid.split("::", 1)[0]
                return path if path.endswith(".ipynb") or path in ONE_UNIT_MODULES else nodeid

        return NotebookScopes(config, log)


def pytest_configure(config):
    if not config.pluginmanager.has_plugin("moelora-nbval-skip-compare"):
        config.pluginmanager.register(_NbvalSkipCompare(), "moelora-nbval-skip-compare")
    if config.pluginmanager.has_plugin("xdist") and not config.pluginmanager.has_plugin("moelora-notebook-scopes"):
        config.pluginmanager.register(_NotebookOnOneWorker(), "moelora-notebook-scopes")
    if config.getoption("--gpu", default=False) and not _cuda_available():
        raise pytest.UsageError(
            "--gpu was given but CUDA is not available "
            "(torch.cuda.is_available() is False); drop --gpu to run on CPU."
        )


def pytest_collection_modifyitems(config, items):
    marked = [item for item in items if item.get_closest_marker("gpu")]
    if marked and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in marked:
            item.add_marker(skip)


@pytest.fixture
def gpu():
    """Skip the requesting test unless CUDA is available."""
    if not _cuda_available():
        pytest.skip("needs a CUDA GPU")


@pytest.fixture
def device(request) -> str:
    """``"cuda"`` when pytest runs with ``--gpu``, else ``"cpu"``."""
    return "cuda" if request.config.getoption("--gpu") else "cpu"


@pytest.fixture
def fresh_tries(monkeypatch):
    """Each test starts as a new kernel session: no wrong tries of an exercise counted yet."""
    from moelora_lab.exercises import core
    monkeypatch.setattr(core, "_MISSES", {})
