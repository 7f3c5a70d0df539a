"""Generic checks of single values (tensors, ints, choices, ranges, memory overlap) with errors that
name the argument; the checks of the lab's own inputs build on them (``validate/__init__.py``)."""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# the specs (reference.py) also take float64: the gradient checks run in it
SPEC_DTYPES = FLOAT_DTYPES + (torch.float64,)
INDEX_DTYPES = (torch.int32, torch.int64)


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    value,
    *,
    ndim: int | Sequence[int] | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    shape: Sequence[int | None] | None = None,
    legend: str | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check that ``value`` is a tensor of the given rank, dtype, shape and device.

    ``shape`` entries of ``None`` match any size. ``legend`` is the shape in words
    (e.g. ``"[M, k]"``) and is quoted in the message.
    """
    want = f" {legend}" if legend else ""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor{want}, got {type(value).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if value.dim() not in allowed:
            dims = " or ".join(f"{d}-D" for d in allowed)
            raise ValueError(f"{name}: expected a {dims} tensor{want}, got shape {tuple(value.shape)}")
    if dtypes is not None and value.dtype not in dtypes:
        raise TypeError(f"{name}: dtype {value.dtype} is not supported; use one of {_dtype_names(dtypes)}")
    if shape is not None:
        if len(shape) != value.dim() or any(s is not None and s != v for s, v in zip(shape, value.shape)):
            expected = tuple("*" if s is None else s for s in shape)
            raise ValueError(f"{name}: expected shape {expected}{want}, got {tuple(value.shape)}")
    if device is not None and value.device != torch.device(device):
        raise ValueError(f"{name}: is on {value.device}, but the other inputs are on {device}; move it with .to({str(device)!r})")
    return value


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_values(ranges: Sequence[tuple]) -> None:
    """Check ``low <= t < high`` for every ``(name, t, low, high, what)``, with one device read.

    All minima and maxima are gathered into one small tensor, so checking the ids of a call costs
    one synchronisation on a GPU however many tensors it has. Skipped under CUDA graph capture.
    """
    live = [r for r in ranges if r[1] is not None and r[1].numel()]
    if not live or _capturing():
        return
    by_device: dict = {}
    for r in live:
        by_device.setdefault(r[1].device, []).append(r)
    for items in by_device.values():
        stats = [m for _, t, *_ in items for m in torch.aminmax(t.reshape(-1))]          # [min, max] per tensor
        if len({m.dtype for m in stats}) > 1:
            stats = [m.long() for m in stats]
        flat = torch.stack(stats).tolist()                                             # the one device read
        for (name, _, low, high, what), lo, hi in zip(items, flat[0::2], flat[1::2]):
            if lo < low or hi >= high:
                extra = f" ({what})" if what else ""
                raise ValueError(f"{name}: value {lo if lo < low else hi} is out of range; accepted values are "
                                 f"{low} .. {high - 1}{extra}")


def check_range(name: str, value: torch.Tensor, low: int, high: int, what: str = "") -> None:
    """Check ``low <= value < high`` elementwise (skipped under CUDA graph capture)."""
    check_values([(name, value, low, high, what)])


def check_int(name: str, value, *, low: int | None = None, high: int | None = None) -> int:
    """Check that ``value`` is an int with ``low <= value <= high``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name}: must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name}: must be <= {high}, got {value}")
    return value


def check_bool(name: str, value, *, none_ok: bool = False) -> None:
    """Check that a flag is True or False (or None with ``none_ok``): a string such as "False" is truthy, and
    would silently mean the opposite of what it says."""
    if not (isinstance(value, bool) or (none_ok and value is None)):
        raise TypeError(f"{name}: expected True or False{' (or None)' if none_ok else ''}, got "
                        f"{type(value).__name__} {value!r}")


def check_choice(name: str, value, choices: Iterable) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name}: {value!r} is not one of {', '.join(repr(c) for c in choices)}")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """Check that all given tensors live on one device and return it."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{name}: is on {t.device} but {first_name} is on {first.device}; all inputs must share one device"
            )
    return first.device


def check_rows(name: str, rows, keys: Sequence[str], source: str | None = None) -> list:
    """Check a non-empty list of dict rows (e.g. ``results.read_csv``) that all carry ``keys``."""
    what = f" (read_csv of {source})" if source else ""
    if isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, Sequence) or not rows:
        raise TypeError(f"{name}: expected a non-empty list of dicts{what}, got {type(rows).__name__}")
    for i, row in enumerate(rows):
        missing = [k for k in keys if not isinstance(row, Mapping) or k not in row]
        if missing:
            raise ValueError(f"{name}[{i}]: missing {', '.join(missing)}; expected rows"
                             f"{' of ' + source if source else ' with ' + ', '.join(keys)}")
    return list(rows)


def check_no_self_overlap(name: str, value: torch.Tensor) -> None:
    """Raise if two elements of ``value`` share memory (a stride-0 ``expand``, or rows closer than their
    width): a kernel writing one of them would overwrite the other. Sorted by stride, every dimension must
    step past all the elements of the smaller ones (the usual dense and strided layouts do)."""
    reach = 0                                      # the farthest element offset of the dims seen so far
    for stride, size in sorted((abs(s), n) for n, s in zip(value.shape, value.stride()) if n > 1):
        if stride <= reach:
            raise ValueError(f"{name}: its elements overlap in memory (shape {tuple(value.shape)}, strides "
                             f"{tuple(value.stride())}, e.g. an expand()); writing one would change another. Pass "
                             "a tensor of its own, e.g. torch.empty(shape) or .clone()")
        reach += (size - 1) * stride


def check_no_overlap(name: str, value: torch.Tensor, **others) -> None:
    """Raise if ``value`` shares memory with any of ``others`` (a kernel writing ``value`` would
    read back what it had already overwritten). Compares address ranges, on the host."""
    def span(t):
        if t.numel() == 0:
            return None
        last = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    mine = span(value)
    if mine is None:
        return
    for other, t in others.items():
        for i, ti in enumerate(t if isinstance(t, (list, tuple)) else [t]):
            if not isinstance(ti, torch.Tensor) or ti.device != value.device or (theirs := span(ti)) is None:
                continue
            if mine[0] < theirs[1] and theirs[0] < mine[1]:
                what = f"{other}[{i}]" if isinstance(t, (list, tuple)) else other
                raise ValueError(f"{name}: shares memory with {what}; the kernels would read values they have "
                                 f"already overwritten. Pass a separate output buffer (and copy it back if "
                                 "you need the result in place)")


def wants_grad(*inputs) -> bool:
    """Whether autograd is on and any of ``inputs`` (tensors, None, lists, tuples or dicts of them) requires
    grad: the one test every entry point uses to choose between its autograd Function and a plain launch."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors_in(inputs))


def tensors_in(items):
    """Every tensor in ``items``, through lists, tuples and dicts (None and other values skipped)."""
    for item in items:
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, dict):
            yield from tensors_in(item.values())
        elif isinstance(item, (list, tuple)):
            yield from tensors_in(item)
