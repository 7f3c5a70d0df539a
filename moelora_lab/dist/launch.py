"""Run a function on W local processes joined in one ``torch.distributed`` process group.

``run_local(fn, W, *args)`` spawns W fresh Python processes (the ``spawn`` start method, so it
works from a notebook, under pytest and with CUDA), joins them with ``init_process_group`` over
TCP on localhost, calls ``fn(rank, W, *args)`` in each and returns the W results in rank order.
``fn`` must be importable (a module-level function of an installed module) and its result
picklable; results travel as bytes (tensors come back as CPU copies), so a process may exit before
the parent reads what it sent. Backend ``gloo`` runs on the CPU (the kernels under the Triton
interpreter, also where a GPU is visible: its processes start with ``MOELORA_INTERPRET=1``); ``nccl`` gives rank w the GPU w, gloo for CPU tensors in the same group
(``"cpu:gloo,cuda:nccl"``), and leaves NVLink multicast off (``NCCL_NVLS_ENABLE=0``) unless the
environment says otherwise. The parent watches the processes: one that fails or dies ends the
call at once with a RuntimeError naming its rank.
"""
from __future__ import annotations

import contextlib
import io
import os
import queue as queue_module
import signal
import socket
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .._backend import interpreter_breaks
from ..validate import check_choice, check_int

BACKENDS = ("gloo", "nccl")
# "nccl" also gives the group gloo for CPU tensors: the layers' input agreement (``agree``) then
# exchanges its few integers on the host, without waiting for the GPU
PROCESS_GROUP_BACKENDS = {"gloo": "gloo", "nccl": "cpu:gloo,cuda:nccl"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def encode_result(value) -> bytes:
    """``value`` as bytes, tensors copied to the CPU: a tensor put on a ``torch.multiprocessing`` queue
    as itself is shared through its process, which may have exited by the time the parent reads it."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def decode_result(payload: bytes):
    """What :func:`encode_result` encoded, tensors on the CPU."""
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)


def _worker(rank, world, port, backend, threads, fn, args, results):
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        torch.set_num_threads(threads)
        kwargs = dict(device_id=torch.device("cuda", rank)) if backend == "nccl" else {}
        dist.init_process_group(PROCESS_GROUP_BACKENDS[backend], init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(minutes=10), **kwargs)
        try:
            results.put((rank, True, encode_result(fn(rank, world, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:                       # report, never hang the parent
        results.put((rank, False, traceback.format_exc()))


POLL_S = 0.2          # how often the parent looks for processes that died without reporting
GRACE_S = 2.0         # after a failure, how long the other processes get to exit before they are terminated


def run_local(fn, world_size: int, *args, backend: str = "gloo", timeout_s: float = 600.0,
              threads: int | None = None) -> list:
    """``[fn(0, W, *args), ..., fn(W-1, W, *args)]``, each computed in its own process of one group.

    Parameters
    ----------
    fn : callable
        A module-level function of an importable module, ``fn(rank, world_size, *args)``; its result
        travels back to the caller.
    world_size : int
        W, the processes.
    *args
        Passed to every call of ``fn``.
    backend : str
        "gloo" (CPU tensors; the processes run the kernels on the Triton interpreter) or "nccl" (one GPU
        per process).
    timeout_s : float
        Seconds to wait for every result.
    threads : int, optional
        torch's CPU threads per process (default: the cores shared out, at least 1).

    Returns
    -------
    list
        The W results, by rank.

    Notes
    -----
    A failure in any process raises a RuntimeError carrying that process's traceback; a process that
    dies without reporting one (a crash, the out-of-memory killer, ``os._exit``, a script that calls
    ``run_local`` without an ``if __name__ == "__main__":`` guard) raises one at once, with its rank and
    exit code, rather than after ``timeout_s``. The other processes are then terminated.

    Examples
    --------
    ``divmod(rank, W)`` in each of two processes (several seconds: each starts Python and imports
    torch); a script must call it under ``if __name__ == "__main__":``:

    >>> from moelora_lab.dist import run_local
    >>> run_local(divmod, 2)                                       # doctest: +SKIP
    [(0, 0), (0, 1)]
    >>> run_local(divmod, 0)
    Traceback (most recent call last):
    ...
    ValueError: world_size: must be >= 1, got 0
    """
    check_int("world_size", world_size, low=1)
    check_choice("backend", backend, BACKENDS)
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"world_size: {world_size} NCCL ranks need as many GPUs, this machine has "
                         f"{torch.cuda.device_count()}; use backend='gloo' on the CPU")
    if backend == "gloo" and interpreter_breaks():
        raise RuntimeError(f"backend='gloo': its processes run the kernels on the Triton interpreter, which cannot "
                           f"run here: {interpreter_breaks()}; or use backend='nccl' with one GPU per process")
    if not callable(fn) or "<locals>" in getattr(fn, "__qualname__", "<locals>") or fn.__module__ == "__main__":
        raise TypeError("fn: must be a module-level function of an importable module (the processes are fresh "
                        "interpreters that import it by name), e.g. moelora_lab.dist.checks.ep_case")
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")      # no NVLink multicast objects
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(rank, world_size, port, backend, threads, fn, args, results),
                         daemon=True) for rank in range(world_size)]
    with _child_environment(MOELORA_INTERPRET="1" if backend == "gloo" else None):
        for p in procs:
            p.start()
    out, failures = {}, []
    try:
        _collect(procs, results, out, failures, timeout_s)
    finally:
        _stop(procs, grace_s=GRACE_S if failures else 60.0)
    if failures:
        raise RuntimeError("run_local: a process failed\n" + "\n".join(failures))
    return [out[rank] for rank in range(world_size)]


@contextlib.contextmanager
def _child_environment(**changes):
    """``os.environ`` with ``changes`` (None: unchanged) while the processes start (a spawned process
    copies its parent's environment), then as it was."""
    changes = {k: v for k, v in changes.items() if v is not None}
    before = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _collect(procs, results, out: dict, failures: list, timeout_s: float) -> None:
    """Read the processes' reports into ``out`` until every rank has reported, one fails or dies
    without a report (into ``failures``), or ``timeout_s`` passes (a RuntimeError)."""
    world = len(procs)
    reported: set = set()
    deadline = time.monotonic() + timeout_s
    while len(out) < world and not failures:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"run_local: no result within {timeout_s:.0f} s from ranks "
                               f"{sorted(set(range(world)) - set(out))}")
        try:
            report = results.get(timeout=min(POLL_S, left))
        except queue_module.Empty:
            if any(r not in reported and p.exitcode is not None for r, p in enumerate(procs)):
                _drain(results, out, failures, reported)      # a report sent just before the exit
                _note_dead(procs, reported, failures)
            continue
        _take(report, out, failures, reported)
    if failures:
        # a rank that died without a report is the likely cause of the others' failures: look once more
        _drain(results, out, failures, reported)
        _note_dead(procs, reported, failures)


def _take(report, out: dict, failures: list, reported: set) -> None:
    rank, ok, value = report
    reported.add(rank)
    if ok:
        out[rank] = decode_result(value)
    else:
        failures.append(f"rank {rank}:\n{value}")      # the others may wait forever on the failed rank


def _drain(results, out: dict, failures: list, reported: set) -> None:
    """Every report already sent."""
    while True:
        try:
            report = results.get(timeout=POLL_S)
        except queue_module.Empty:
            return
        _take(report, out, failures, reported)


def _note_dead(procs, reported: set, failures: list) -> None:
    """Put first in ``failures`` every process that has exited without a report."""
    dead = [_died(r, p.exitcode) for r, p in enumerate(procs) if r not in reported and p.exitcode is not None]
    reported.update(r for r, p in enumerate(procs) if p.exitcode is not None)
    failures[:0] = dead


def _died(rank: int, code: int) -> str:
    """What the parent knows of a process that exited without a report: its rank and exit code."""
    if code < 0:
        try:
            how = f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
        if -code == signal.SIGKILL:
            how += " (the out-of-memory killer sends it)"
    else:
        how = f"exited with code {code}"
    return (f"rank {rank}: the process {how} without reporting a result or a traceback. If it printed nothing, "
            "look for a crash in native code (or os._exit); a script that calls run_local must do so under "
            "`if __name__ == \"__main__\":`, since each process imports the script again")


def _stop(procs, *, grace_s: float) -> None:
    """Join the processes, terminating (then killing) those still alive after ``grace_s`` in all."""
    end = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
