"""Count what a Triton kernel loads from and stores to global memory, under the Triton interpreter.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, K in, N out.

    with count_memory(x=x, a=lora_a, t=inter) as mem:
        kernel[grid](x, lora_a, inter, ...)
    mem.loaded("a"), mem.stored("t"), mem.report()

Every ``tl.load`` / ``tl.store`` (and atomic) that runs is counted where its mask is true: the
bytes moved and the distinct bytes touched, per named tensor (an address is given to the tensor
whose storage holds it; an address in none of them counts under "other"). ``loaded(name) /
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


def _ranges(tensors: dict) -> list[tuple[int, int, str]]:
    out = []
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor to attribute addresses to, got {type(t).__name__}")
        storage = t.untyped_storage()
        out.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes(), name))
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

    def attribute(kind, ptrs, mask, itemsize):
        addresses = np.asarray(ptrs).reshape(-1)
        keep = np.broadcast_to(np.asarray(mask, dtype=bool), np.asarray(ptrs).shape).reshape(-1)
        addresses = addresses[keep].astype(np.uint64)
        if not addresses.size:
            return
        slot = np.searchsorted(starts, addresses, side="right") - 1
        for i in np.unique(slot):
            sel = addresses[slot == i]
            inside = (i >= 0) & (sel < ranges[i][1]) if i >= 0 else np.zeros(sel.shape, bool)
            if i >= 0 and inside.any():
                count._add(kind, ranges[i][2], sel[inside], itemsize)
            if (~inside).any():
                count._add(kind, "other", sel[~inside], itemsize)

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
