"""Where the Triton kernels run: the GPU, or the Triton interpreter on the CPU.

This is the one place that decides. It must run before any ``@triton.jit`` function is defined,
because Triton reads ``TRITON_INTERPRET`` when a kernel is decorated; ``moelora_lab/__init__.py``
imports it first for that reason.

    MOELORA_INTERPRET=1   always use the interpreter (kernels run on CPU tensors, slowly)
    MOELORA_INTERPRET=0   never (kernels need a CUDA GPU)
    unset                 the interpreter exactly when no CUDA GPU is visible

An explicit ``TRITON_INTERPRET`` set by the user is respected when MOELORA_INTERPRET is unset.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import warnings

import torch

_CHOICE = os.environ.get("MOELORA_INTERPRET", "").strip()
if _CHOICE not in ("", "0", "1"):
    raise ValueError(f"MOELORA_INTERPRET: {_CHOICE!r} is not accepted; use 0 (GPU), 1 (interpreter) or leave it unset")

_TRITON_FIRST = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") != "1"
if _CHOICE == "1" or (_CHOICE == "" and "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available()):
    if _TRITON_FIRST:
        # triton's own @jit helpers (tl.cdiv, ...) were already built for the compiler, and
        # interpreted kernels cannot call them: fail now with the fix, not later inside a kernel
        raise ImportError(
            "moelora_lab must be imported before triton when kernels run on the Triton interpreter "
            "(no GPU here): restart Python and import moelora_lab first, or set MOELORA_INTERPRET=1 "
            "(or TRITON_INTERPRET=1) in the environment before Python starts")
    os.environ["TRITON_INTERPRET"] = "1"
elif _CHOICE == "0":
    os.environ["TRITON_INTERPRET"] = "0"

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreter_breaks() -> str | None:
    """Why the Triton interpreter cannot run this lab's kernels with the installed packages, or None: numpy 2.4
    breaks the triton 3.6 interpreter (loops with a runtime bound fail); 3.7 is fine."""
    from importlib.metadata import PackageNotFoundError, version

    import numpy as np

    try:
        triton_version = tuple(int(v) for v in version("triton").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return None
    major, minor = (int(v) for v in np.__version__.split(".")[:2])
    if (major, minor) >= (2, 4) and triton_version < (3, 7):
        return (f"numpy {np.__version__} breaks the Triton {version('triton')} interpreter (loops with a runtime "
                "bound fail); install numpy<2.4, or triton>=3.7, to run the kernels on the CPU")
    return None


def _check_numpy() -> None:
    broken = interpreter_breaks() if INTERPRET else None
    if broken:
        warnings.warn(broken, RuntimeWarning, stacklevel=2)


_check_numpy()

# The Triton interpreter keeps its state in the process: the launch grid and the triton.language functions it
# swaps in while a kernel runs. Two threads launching interpreted kernels at once would run each other's grids
# (a crash, or a wrong result without one), so interpreted launches take this lock, one at a time; on a GPU
# nothing is serialised.
INTERPRETER_LOCK = threading.RLock()


def _serialise_interpreted_launches() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run
    if getattr(run, "serialised", False):
        return

    @functools.wraps(run)
    def locked(self, *args, **kwargs):
        with INTERPRETER_LOCK:
            return run(self, *args, **kwargs)

    locked.serialised = True
    InterpretedFunction.run = locked


if INTERPRET:
    _serialise_interpreted_launches()


def on_device(t: torch.Tensor):
    """Make ``t``'s GPU the current device while kernels are launched and streams are used (Triton
    launches on the current device, whatever device the tensors are on); nothing for CPU tensors."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def kernel_device() -> torch.device:
    """The device kernel inputs should live on: CUDA when kernels compile, else the CPU."""
    if INTERPRET:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("MOELORA_INTERPRET=0 turned the Triton interpreter off, but no CUDA GPU is visible: "
                           "kernels cannot run here. Unset MOELORA_INTERPRET (or set it to 1) to run them on the CPU")
    return torch.device("cuda")


def describe() -> str:
    """One line saying where kernels run, for notebooks and benchmark provenance."""
    if INTERPRET:
        return "Triton interpreter on the CPU (correctness only: timings here are not GPU timings)"
    if not torch.cuda.is_available():
        return ("no CUDA GPU is visible, and MOELORA_INTERPRET=0 turned the Triton interpreter off: kernels cannot "
                "run here; unset MOELORA_INTERPRET (or set it to 1) to run them on the CPU")
    return f"CUDA: {torch.cuda.get_device_name()}"


def optional_module(name: str, *, needed_for: str, install: str):
    """The module ``name`` (dotted), imported on first use; if it is missing, an ImportError saying what needs it
    and the command that installs it. moelora_lab itself imports without its optional packages."""
    import importlib
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(f"{needed_for} needs {name.split('.')[0]}, which is not installed: {install}") from exc
