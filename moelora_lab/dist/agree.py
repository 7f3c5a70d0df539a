"""Input checks of the distributed layers that every rank of the group agrees on.

A rank that raised alone would leave the others blocked in the layer's first collective (the
all-to-all of expert parallelism, the all-reduce of tensor parallelism). So each layer checks all
of its inputs on every rank first, catching the error, and :func:`agree` then exchanges one small
integer vector per rank (one all-gather): whether the rank's checks failed, and the sizes that must
be equal on every rank (hidden size, dtype, adapters, ...). Every rank then raises the same error,
naming the argument and the rank that holds it, or none does. Only on that error path do the
ranks exchange their messages (one more collective of Python objects).

Cost: the one all-gather of a few integers and its read on the host. Where the group has a CPU
backend (gloo, or ``"cpu:gloo,cuda:nccl"`` as ``run_local`` makes it), the vector stays on the CPU
and nothing waits for the device; a group with only NCCL exchanges it on the GPU and reads it back
(one synchronisation).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from .._backend import INTERPRET
from ..validate import FLOAT_DTYPES

# torch >= 2.13 renames all_gather_into_tensor (and warns on the old name)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Same(NamedTuple):
    """A size every rank must pass equal: the argument it belongs to, what it is, its value here
    (an int; -1 where it does not apply) and, optionally, how to print a value."""

    argument: str
    what: str
    value: int
    show: Callable[[int], str] = str


def dtype_code(dtype: torch.dtype) -> int:
    """A float dtype as an int for :class:`Same` (-1: another dtype)."""
    return FLOAT_DTYPES.index(dtype) if dtype in FLOAT_DTYPES else -1


def dtype_name(code: int) -> str:
    return str(FLOAT_DTYPES[code]).replace("torch.", "") if 0 <= code < len(FLOAT_DTYPES) else "another dtype"


def check_kernels_run(x: torch.Tensor) -> None:
    """The layer's Triton kernels run on x's device and dtype (checked on every rank, before any collective)."""
    if x.device.type != "cuda" and not INTERPRET:
        raise ValueError(f"x: the layer's Triton kernels need CUDA tensors (got {x.device}); set MOELORA_INTERPRET=1 "
                         "before importing moelora_lab to run them on the CPU")
    if INTERPRET and x.dtype == torch.bfloat16:
        raise TypeError("x: bfloat16 is mis-computed by the Triton interpreter; use float32 or float16 on the CPU")


def layer_device(x) -> torch.device:
    """The device the layer runs on: x's, or (x not even a tensor) the current GPU, else the CPU."""
    if isinstance(x, torch.Tensor):
        return x.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def run_checks(check: Callable, *args, **kwargs):
    """``(check(*args, **kwargs), None)``, or ``(None, the exception)`` if the checks raised."""
    try:
        return check(*args, **kwargs), None
    except Exception as e:                  # any failure here must reach the other ranks, not hang them
        return None, e


def exchange_device(group, fallback: torch.device) -> torch.device:
    """Where the agreement vector travels: the CPU when the group has a CPU backend, else ``fallback``
    (the layer's device)."""
    return torch.device("cpu") if "gloo" in str(dist.get_backend(group)) else fallback


def agree(group, error: Exception | None, same: list[Same], device: torch.device) -> None:
    """Collective: raise on every rank of ``group`` the same error if any rank's checks failed
    (``error``: this rank's, or None) or if a :class:`Same` differs between ranks; return otherwise.

    ``same`` must list the same fields, in the same order, on every rank (its values may differ).
    The error is a TypeError when the failing rank's was one, else a ValueError; its message starts
    with the rank(s) that hold the bad input, then that rank's own message (which names the argument).
    """
    world = dist.get_world_size(group)
    n = 1 + len(same)
    mine = torch.tensor([int(error is not None)] + [0 if error is not None else int(s.value) for s in same],
                        dtype=torch.int64)
    mine = mine.to(exchange_device(group, device))
    table = mine.new_empty(world * n)
    _all_gather(table, mine, group=group)
    rows = table.view(world, n).tolist()            # the one read
    failed = [w for w in range(world) if rows[w][0]]
    if failed:
        reports = [None] * world
        dist.all_gather_object(reports, _report(error), group=group)
        raise _error(reports, failed) from error
    for i, s in enumerate(same):
        values = [rows[w][1 + i] for w in range(world)]
        if len(set(values)) > 1:
            per_rank = ", ".join(f"rank {w}: {s.show(v)}" for w, v in enumerate(values))
            raise ValueError(f"{s.argument}: {s.what} differs between the ranks ({per_rank}); every rank of the "
                             "group must pass the same")


def _report(error: Exception | None):
    if error is None:
        return None
    kind = "TypeError" if isinstance(error, TypeError) else "ValueError"
    message = str(error) if isinstance(error, (TypeError, ValueError)) else f"{type(error).__name__}: {error}"
    return kind, message


def _error(reports: list, failed: list) -> Exception:
    """The error every rank raises: the first failing rank's, naming every rank that failed alike."""
    kind, message = reports[failed[0]]
    alike = [w for w in failed if reports[w] == (kind, message)]
    others = [w for w in failed if w not in alike]
    who = f"rank {alike[0]}" if len(alike) == 1 else "ranks " + ", ".join(map(str, alike))
    text = f"{who}: {message}"
    if others:
        text += " (also " + "; ".join(f"rank {w}: {reports[w][1]}" for w in others) + ")"
    return (TypeError if kind == "TypeError" else ValueError)(text)
