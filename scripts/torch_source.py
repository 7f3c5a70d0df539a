"""Which torch build a CPU venv gets, and the pip arguments that get it.

``make venv`` (and ``make test-wheel``) run this with the new venv's python before installing
``requirements-cpu.txt``. It prints the extra pip arguments on stdout (nothing, or
``--extra-index-url https://download.pytorch.org/whl/cpu``) and one line on stderr saying which torch
build pip will install and why. In order:

1. pip already finds a local ``torch==<pin>+cpu`` wheel (its find-links): nothing to add.
2. ``nvidia-smi`` lists a GPU: nothing to add (PyPI's torch is the CUDA build).
3. ``PIP_INDEX_URL``, ``PIP_EXTRA_INDEX_URL``, ``PIP_FIND_LINKS`` or ``PIP_NO_INDEX`` is set: yours decide.
4. PyTorch's CPU index answers and offers ``<pin>+cpu``: add it (pip prefers ``+cpu`` to the plain version).
5. Otherwise nothing is added: an extra index pip cannot reach costs retries on every package (minutes),
   so it is added only after one quick query with ``--retries 0``.

Usage::

    python scripts/torch_source.py [requirements-cpu.txt]
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
USER_VARS = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX")
ROOT = Path(__file__).resolve().parents[1]


def torch_pin(requirements: Path) -> str:
    """The version of the ``torch==...`` line of a requirements file.

    Raises
    ------
    ValueError
        If ``requirements`` has no ``torch==<version>`` line.
    """
    found = re.search(r"^torch==([^\s;#]+)", Path(requirements).read_text(), re.MULTILINE)
    if not found:
        raise ValueError(f"requirements: {requirements} has no 'torch==<version>' line; pin torch there")
    return found.group(1)


def _pip(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, env=env,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(args, 1, "", "timed out")


def local_cpu_wheel(version: str) -> bool:
    """Whether pip, without any index, finds ``torch==<version>+cpu`` (its find-links, from env or config)."""
    probe = _pip("install", "--dry-run", "--quiet", "--no-deps", "--ignore-installed", "--no-index",
                 f"torch=={version}+cpu")
    return probe.returncode == 0


def has_gpu() -> bool:
    """Whether ``nvidia-smi -L`` lists an NVIDIA GPU."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return listed.returncode == 0 and "GPU" in listed.stdout


def cpu_index_offers(version: str) -> bool:
    """Whether PyTorch's CPU index answers at once and lists ``torch <version>+cpu``.

    One query, no retries, 5 s timeout, with pip's configuration files and index variables off so that
    only that index is asked (proxy and certificate variables still apply).
    """
    env = {k: v for k, v in os.environ.items() if k not in USER_VARS}
    env["PIP_CONFIG_FILE"] = os.devnull
    probe = _pip("index", "versions", "torch", "--index-url", CPU_INDEX, "--retries", "0", "--timeout", "5",
                 env=env, timeout=30)
    listed = re.search(r"Available versions:(.*)", probe.stdout)
    return probe.returncode == 0 and bool(listed) and f"{version}+cpu" in listed.group(1).replace(",", " ").split()


def decide(version: str, *, local, gpu, user_vars, cpu_index) -> tuple[list[str], str]:
    """The extra pip arguments and the line that explains them.

    Parameters
    ----------
    version : str
        The pinned torch version, e.g. ``"2.13.0"``.
    local, gpu, cpu_index : callable
        ``local()``, ``gpu()``, ``cpu_index()``: the probes above, called only when the decision needs them.
    user_vars : list of str
        The pip variables the user has set (names from ``USER_VARS``).
    """
    if local():
        return [], f"torch {version}+cpu (CPU build): a local wheel, found through pip's find-links"
    if gpu():
        return [], f"torch {version} from pip's configured index (on PyPI, the CUDA build): nvidia-smi lists a GPU"
    if user_vars:
        return [], f"torch {version} from where you point pip: {', '.join(user_vars)} set, so nothing is added"
    if cpu_index():
        return ["--extra-index-url", CPU_INDEX], \
            f"torch {version}+cpu (CPU build, ~200 MB): no NVIDIA GPU, so PyTorch's CPU index ({CPU_INDEX}) is added"
    return [], (f"torch {version} from pip's configured index (on PyPI, the CUDA build, several GB): no NVIDIA GPU, "
                f"but {CPU_INDEX} did not answer; to pick it: PIP_EXTRA_INDEX_URL={CPU_INDEX} make")


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print(__doc__.split("Usage::")[1].strip(), file=sys.stderr)
        return 2
    version = torch_pin(Path(argv[0]) if argv else ROOT / "requirements-cpu.txt")
    args, line = decide(version, local=lambda: local_cpu_wheel(version), gpu=has_gpu,
                        user_vars=[v for v in USER_VARS if os.environ.get(v)],
                        cpu_index=lambda: cpu_index_offers(version))
    print(line, file=sys.stderr)
    print(" ".join(args))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
