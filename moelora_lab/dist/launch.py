"""Run a function on W local processes joined in one ``torch.distributed`` process group.

``run_local(fn, W, *args)`` spawns W fresh Python processes (the ``spawn`` start method, so it
works from a notebook, under pytest and with CUDA), joins them with ``init_process_group`` over
TCP on localhost, calls ``fn(rank, W, *args)`` in each and returns the W results in rank order.
``fn`` must be importable (a module-level function of an installed module) and its result
picklable; results travel as bytes (tensors come back as CPU copies), so a process may exit before
the parent reads what it sent. Backend ``gloo`` runs on the CPU (the kernels under the Triton
interpreter); ``nccl`` gives rank w the GPU w and leaves NVLink multicast off
(``NCCL_NVLS_ENABLE=0``) unless the environment says otherwise.
"""
from __future__ import annotations

import io
import os
import queue as queue_module
import socket
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..validate import check_choice, check_int

BACKENDS = ("gloo", "nccl")


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
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(minutes=10), **kwargs)
        try:
            results.put((rank, True, encode_result(fn(rank, world, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:                       # report, never hang the parent
        results.put((rank, False, traceback.format_exc()))


def run_local(fn, world_size: int, *args, backend: str = "gloo", timeout_s: float = 600.0,
              threads: int | None = None) -> list:
    """``[fn(0, W, *args), ..., fn(W-1, W, *args)]``, each computed in its own process of one group.

    ``threads``: torch's CPU threads per process (default: the cores shared out, at least 1).
    A failure in any process raises a RuntimeError carrying that process's traceback.
    """
    check_int("world_size", world_size, low=1)
    check_choice("backend", backend, BACKENDS)
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"world_size: {world_size} NCCL ranks need as many GPUs, this machine has "
                         f"{torch.cuda.device_count()}; use backend='gloo' on the CPU")
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
    for p in procs:
        p.start()
    out, failures = {}, []
    try:
        for _ in range(world_size):
            try:
                rank, ok, value = results.get(timeout=timeout_s)
            except queue_module.Empty:
                raise RuntimeError(f"run_local: no result within {timeout_s:.0f} s from ranks "
                                   f"{sorted(set(range(world_size)) - set(out))}") from None
            if ok:
                out[rank] = decode_result(value)
            else:
                failures.append(f"rank {rank}:\n{value}")
                break                           # the others may wait forever on the failed rank
    finally:
        for p in procs:
            p.join(timeout=5 if failures else 60)
            if p.is_alive():
                p.terminate()
    if failures:
        raise RuntimeError("run_local: a process failed\n" + "\n".join(failures))
    return [out[rank] for rank in range(world_size)]
