"""Count what a Triton kernel loads from and stores to global memory, under the Triton interpreter.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, K in, N out.

    with count_memory(x=x, a=lora_a, t=inter) as mem:
        kernel[grid](x, lora_a, inter, ...)
    mem.loaded("a"), mem.stored("t"), mem.report()

Every ``tl.load`` / ``tl.store`` (and atomic) that runs is counted where its mask is true: the
bytes moved and the distinct bytes touched, per named tensor (an address is given to the tensor
whose elements hold it). A lane of an access past a tensor's extent (an index below 0 or past its
last element) is out of bounds: ``out_of_bounds()`` names the tensor the rest of that access reads,
how many lanes and how far past; an access with no lane in any named tensor counts under "other". ``loaded(name) /
unique_loaded(name)`` is how many times the kernel read that tensor's bytes over. This is the
"memory score" of GPU-Puzzles: it counts what the code asks for, not what a GPU's caches would
serve, so a kernel that reads a tile twice is charged twice. Only kernels the interpreter runs are
seen: on the CPU every kernel (``moelora_lab`` sets ``TRITON_INTERPRET=1`` when no GPU is visible);
on a GPU, :func:`interpreted` gives the interpreted twin of a compiled kernel, run on CPU tensors.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class MemoryCount:
    """Bytes moved per tensor name: loads, stores, and the distinct addresses behind each."""

    names: tuple[str, ...]
    loads: dict = field(default_factory=dict)
    stores: dict = field(default_factory=dict)
    _addresses: dict = field(default_factory=dict)
    oob: dict = field(default_factory=dict)    # (kind, name) -> [lanes, lowest index, highest index, numel]

    def _add(self, kind: str, name: str, addresses: np.ndarray, itemsize: int) -> None:
        book = self.loads if kind == "load" else self.stores
        book[name] = book.get(name, 0) + int(addresses.size) * itemsize
        seen = self._addresses.setdefault((kind, name), [])
        seen.append((addresses.astype(np.uint64), itemsize))

    def _unique(self, kind: str, name: str) -> int:
        chunks = self._addresses.get((kind, name), [])
        if not chunks:
            return 0
        spans = np.concatenate([(a.reshape(-1)[:, None] + np.arange(size, dtype=np.uint64)[None, :]).reshape(-1)
                                for a, size in chunks])
        return int(np.unique(spans).size)

    def loaded(self, name: str) -> int:
        """Bytes loaded from tensor ``name`` (every load counted, repeats included)."""
        self._known(name)
        return self.loads.get(name, 0)

    def stored(self, name: str) -> int:
        """Bytes stored to tensor ``name``."""
        self._known(name)
        return self.stores.get(name, 0)

    def unique_loaded(self, name: str) -> int:
        """Distinct bytes of ``name`` that were loaded at least once."""
        self._known(name)
        return self._unique("load", name)

    def unique_stored(self, name: str) -> int:
        self._known(name)
        return self._unique("store", name)

    def _out(self, kind: str, name: str, index: np.ndarray, numel: int) -> None:
        book = self.oob.setdefault((kind, name), [0, int(index.min()), int(index.max()), numel])
        book[0] += int(index.size)
        book[1], book[2] = min(book[1], int(index.min())), max(book[2], int(index.max()))

    def out_of_bounds(self) -> list[str]:
        """One line per tensor read or written past its extent (and one for bytes of no named tensor)."""
        lines = []
        for (kind, name), (lanes, lo, hi, numel) in sorted(self.oob.items()):
            where = " and ".join(w for w, bad in ((f"index {lo:,}", lo < 0), (f"index {hi:,}", hi >= numel)) if bad)
            verb = "read" if kind == "load" else "written"
            lines.append(f"{name}: {lanes:,} element{'s' * (lanes != 1)} {verb} out of bounds, up to {where} of "
                         f"its {numel:,} elements (0 to {numel - 1:,}): a mask missing or too wide?")
        for kind, book in (("loaded", self.loads), ("stored", self.stores)):
            if book.get("other"):
                lines.append(f"{book['other']:,} B {kind} at addresses in none of the tensors "
                             f"({', '.join(self.names)}): an index far out of bounds?")
        return lines

    @property
    def total_loaded(self) -> int:
        return sum(self.loads.values())

    @property
    def total_stored(self) -> int:
        return sum(self.stores.values())

    def _known(self, name: str) -> None:
        if name not in self.names and name != "other":
            raise KeyError(f"name: {name!r} was not given to count_memory; known: {', '.join(self.names)}")

    def report(self) -> str:
        """One line per tensor: bytes loaded (and over its distinct bytes), bytes stored."""
        lines, width = [], max(len(n) for n in (*self.names, "other"))
        for name in (*self.names, "other"):
            ld, st = self.loads.get(name, 0), self.stores.get(name, 0)
            if name == "other" and not (ld or st):
                continue
            uniq = self.unique_loaded(name)
            times = f" ({ld / uniq:.2g}x its {uniq:,} distinct bytes)" if uniq else ""
            lines.append(f"  {name:>{width}s}: loaded {ld:>10,} B{times}, stored {st:>10,} B")
        return "\n".join(lines)


def _ranges(tensors: dict) -> list[tuple[int, int, str, int, int]]:
    """(first byte, one past the last byte, name, itemsize, numel) of each tensor's own elements, by address:
    a view's extent, not its storage's, so that reading past a view counts as out of bounds."""
    out = []
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor to attribute addresses to, got {type(t).__name__}")
        span = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) if t.numel() else 0
        out.append((t.data_ptr(), t.data_ptr() + span * t.element_size(), name, t.element_size(), t.numel()))
    return sorted(out)


def interpreted(kernel):
    """``kernel`` as the Triton interpreter runs it: itself where kernels are interpreted already (no
    GPU), else an interpreted twin of the ``@triton.jit`` function (it runs on CPU tensors)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction) and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return InterpretedFunction(kernel.fn)
    return kernel


@contextlib.contextmanager
def count_memory(**tensors):
    """Count the global loads and stores of every interpreted Triton kernel run inside the block,
    attributed to ``tensors`` (name -> tensor, CPU tensors as the interpreter uses them)."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            raise ValueError(f"{name}: on {t.device}; the interpreter counts CPU tensors, pass {name}.cpu()")
    from triton.runtime import interpreter

    ranges = _ranges(tensors)
    starts = np.array([r[0] for r in ranges], dtype=np.uint64)
    count = MemoryCount(tuple(tensors))

    ends = np.array([r[1] for r in ranges], dtype=np.uint64)

    def attribute(kind, ptrs, mask, itemsize):
        addresses = np.asarray(ptrs).reshape(-1)
        keep = np.broadcast_to(np.asarray(mask, dtype=bool), np.asarray(ptrs).shape).reshape(-1)
        addresses = addresses[keep].astype(np.uint64)
        if not addresses.size:
            return
        slot = np.searchsorted(starts, addresses, side="right") - 1
        inside = (slot >= 0) & (addresses < ends[np.maximum(slot, 0)])
        for i in np.unique(slot[inside]):
            count._add(kind, ranges[i][2], addresses[inside & (slot == i)], itemsize)
        if inside.all():
            return
        stray = addresses[~inside]
        if not inside.any():                  # no lane in a named tensor: an unnamed one (or far out)
            count._add(kind, "other", stray, itemsize)
            return
        # one tl.load / tl.store reads one tensor: the one most of its in-bounds lanes hit
        target = np.bincount(slot[inside]).argmax()
        start, _, name, size, numel = ranges[target]
        index = (stray.astype(np.int64) - np.int64(start)) // size
        count._out(kind, name, index, numel)

    builder = interpreter.InterpreterBuilder
    load, store = builder.create_masked_load, builder.create_masked_store
    rmw = getattr(builder, "create_atomic_rmw", None)

    def counted_load(self, ptrs, mask, other, *args, **kwargs):
        ret = load(self, ptrs, mask, other, *args, **kwargs)
        attribute("load", ptrs.data, mask.data, ret.data.dtype.itemsize)
        return ret

    def counted_store(self, ptrs, value, mask, *args, **kwargs):
        attribute("store", ptrs.data, mask.data, np.asarray(value.data).dtype.itemsize)
        return store(self, ptrs, value, mask, *args, **kwargs)

    def counted_rmw(self, op, ptr, val, mask, *args, **kwargs):
        ret = rmw(self, op, ptr, val, mask, *args, **kwargs)
        size = np.asarray(val.data).dtype.itemsize
        attribute("load", ptr.data, mask.data, size)
        attribute("store", ptr.data, mask.data, size)
        return ret

    builder.create_masked_load, builder.create_masked_store = counted_load, counted_store
    if rmw is not None:
        builder.create_atomic_rmw = counted_rmw
    try:
        yield count
    finally:
        builder.create_masked_load, builder.create_masked_store = load, store
        if rmw is not None:
            builder.create_atomic_rmw = rmw


def _times(n: float) -> str:
    return {0: "never", 1: "once", 2: "twice"}.get(n, f"{n:.3g} times") if n == int(n) else f"{n:.3g} times"


def excess(mem: MemoryCount, name: str, kind: str, once: int, *, expected: int = 1, per: str = "") -> str | None:
    """None when tensor ``name`` moves at most ``expected`` x ``once`` bytes (``kind``: "load" or
    "store"; ``once``: the bytes of one pass over what it must move); else the cause, e.g.
    "a: read 16 times per block, expected once (65,536 B against 4,096 B)"."""
    if kind not in ("load", "store"):
        raise ValueError(f"kind: expected 'load' or 'store', got {kind!r}")
    if once <= 0:
        raise ValueError(f"once: the bytes of one pass must be > 0, got {once!r}")
    got = mem.loaded(name) if kind == "load" else mem.stored(name)
    if got <= expected * once:
        return None
    verb = "read" if kind == "load" else "written"
    return (f"{name}: {verb} {_times(round(got / once, 3))}{per}, expected {_times(expected)}"
            f" ({got:,} B against {expected * once:,} B)")
