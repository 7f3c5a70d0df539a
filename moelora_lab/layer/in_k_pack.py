"""The weights of the LoRA in K, packed once: each base weight widened by every slot's B.

Shape legend: M tokens, k top-k, E experts, L adapters, r rank, H hidden, I expert intermediate,
S slices.

A pair of adapter l computes W x + B_l (A_l x). Widen both operands by L*r columns: x_ext = [x | T]
with T holding the pair's shrink A_l x in columns l*r .. l*r + r and zeros elsewhere, and W_ext =
[W | B of every slot] (packed here, once). Then W_ext x_ext is the base output plus the pair's own LoRA.

``pack_w2_in_k`` stores w2_ext [E, H, I + L*r]; ``pack_w13_in_k`` stores w13_ext [E, 2I, H' + L*r]
(H' = ``moe.tail_start(H)``: zero columns up to a multiple of 128, so no K step mixes x and T; row n
of slice s takes B_s's row). ``pack_in_k`` packs both and hands out the base weights as views.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..base_moe import tail_start


def _pack(w: torch.Tensor, lora_b, at: int, names: tuple, slices: int) -> torch.Tensor:
    """[E, N, at + L*r]: w, zeros up to column ``at``, then every slot's B (rows of slice s from B_s)."""
    wn, bn = names
    if not isinstance(w, torch.Tensor) or w.dim() != 3:
        raise TypeError(f"{wn}: expected a tensor [E, N, K], got {getattr(w, 'shape', type(w).__name__)}")
    if (not isinstance(lora_b, (list, tuple)) or len(lora_b) != slices
            or not all(isinstance(b, torch.Tensor) for b in lora_b)):
        count = "one tensor [L, E, H, r] (w2 has one slice)" if slices == 1 else "two tensors [L, E, I, r] (gate, up)"
        raise TypeError(f"{bn}: expected a list of {count}")
    E, N, K = w.shape
    for s, b in enumerate(lora_b):
        if b.dim() != 4 or tuple(b.shape[1:3]) != (E, N // slices) or b.shape[:1] + b.shape[3:] != lora_b[0].shape[:1] + lora_b[0].shape[3:]:
            raise ValueError(f"{bn}[{s}]: expected [L, {E}, {N // slices}, r] for {wn} of shape {tuple(w.shape)}, "
                             f"got {tuple(b.shape)}")
        if b.dtype != w.dtype or b.device != w.device:
            raise TypeError(f"{bn}[{s}]: expected {w.dtype} on {w.device} like {wn}, got {b.dtype} on {b.device}")
    b = torch.cat(list(lora_b), dim=2)                                        # [L, E, N, r]
    L, r = b.shape[0], b.shape[3]
    ext = w.new_zeros(E, N, at + L * r)
    ext[:, :, :K] = w
    # every pair multiplies its zero columns (other slots', past its slot's rank) by these: NaN or inf there
    # (a slot allocated but not loaded yet, B past a slot's rank) would reach every row as 0 * NaN, so they
    # are packed as zeros
    ext[:, :, at:] = torch.nan_to_num(b.permute(1, 2, 0, 3).reshape(E, N, L * r), nan=0.0, posinf=0.0, neginf=0.0)
    return ext


def pack_w2_in_k(w2: torch.Tensor, w2_lora_b) -> torch.Tensor:
    """w2_ext [E, H, I + L*r], contiguous: w2 [E, H, I] followed by B2 [L, E, H, r] of every slot
    (column I + l*r + j is rank j of slot l; scaling folded into B as everywhere). Pack again when an
    adapter slot changes."""
    return _pack(w2, w2_lora_b, w2.shape[2] if isinstance(w2, torch.Tensor) and w2.dim() == 3 else 0,
                 ("w2", "w2_lora_b"), 1)


def pack_w13_in_k(w13: torch.Tensor, w13_lora_b) -> torch.Tensor:
    """w13_ext [E, 2I, H' + L*r], contiguous (H' = ``moe.tail_start(H)``): w13 [E, 2I, H], zeros up to
    column H', then B of every slot: gate rows from w13_lora_b[0], up rows from w13_lora_b[1], each
    [L, E, I, r]. Pack again when an adapter slot changes."""
    at = tail_start(w13.shape[2]) if isinstance(w13, torch.Tensor) and w13.dim() == 3 else 0
    return _pack(w13, w13_lora_b, at, ("w13", "w13_lora_b"), 2)


class InKWeights(NamedTuple):
    """The layer's base weights packed once with every slot's B (:func:`pack_in_k`). ``w13`` [E, 2I, H] and
    ``w2`` [E, H, I] are views of ``w13_ext`` and ``w2_ext``: give them to ``moe_lora_layer`` with
    ``in_k=`` this, and every schedule reads the one copy of the base weights (``auto`` may then run
    :func:`in_k_layer`). ``lora_b`` and ``versions`` record the B tensors packed and their in-place
    version counters, so a layer call notices an adapter changed since."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_ext: torch.Tensor
    w2_ext: torch.Tensor
    lora_b: tuple
    versions: tuple


def _version(t: torch.Tensor):
    try:
        return t._version
    except RuntimeError:      # an inference-mode tensor keeps no version counter
        return None


def pack_in_k(w13: torch.Tensor, w2: torch.Tensor, w13_lora_b, w2_lora_b) -> InKWeights:
    """Pack the layer once for the LoRA in K (``moe_lora_layer(schedule="in_k", in_k=...)``).

    Parameters
    ----------
    w13, w2 : torch.Tensor
        The base weights, w13 [E, 2I, H] and w2 [E, H, I].
    w13_lora_b, w2_lora_b : list of torch.Tensor
        The LoRA B slices the layer will get: 2 x [L, E, I, r] and 1 x [L, E, H, r].

    Returns
    -------
    InKWeights
        ``w13_ext`` and ``w2_ext`` as :func:`pack_w13_in_k` and :func:`pack_w2_in_k` build them, and
        ``w13`` / ``w2`` as views of them: pass those to the layer (and drop your own copies of the base
        weights). Pack again when an adapter slot changes: the layer refuses a stale pack. Packed without
        autograd: the pack never requires grad, even from a B that does (training through the layer, the
        gradients reach B directly).

    Notes
    -----
    The packed K multiplies every pair's zero columns (another slot's, past its slot's rank) by those
    slots' B, so NaN and inf in B (a slot allocated but not loaded yet, B past a slot's rank) are packed
    as zeros: they never reach a row, as on every other schedule. The one difference: a token whose own
    adapter holds NaN inside its rank gets NaN from the other schedules and a delta without those
    values from ``in_k``. (Dropping the unused columns inside the GEMMs instead kept B as it is, but the
    select took the W tile off the bulk-copy to tensor-core path: 1.12-1.67x each GEMM's time at M = 2048
    and 8192, r 16 and 64, on an H100: data/history/tail_mask_b69769dfe1.csv.)

    Examples
    --------
    >>> import torch
    >>> import moelora_lab as ml
    >>> p = ml.make_problem("tiny", ml.LoRAShape(num_loras=2, rank=4), num_tokens=8, seed=0)
    >>> pack = ml.pack_in_k(p.w13, p.w2, p.w13_lora_b, p.w2_lora_b)
    >>> inputs = p.layer_inputs() | dict(w13=pack.w13, w2=pack.w2)      # the views the pack holds
    >>> y = ml.moe_lora_layer(**inputs, schedule="in_k", in_k=pack)
    >>> torch.allclose(y, ml.moe_layer_reference(**p.layer_inputs()), rtol=1e-4, atol=1e-4)
    True
    """
    with torch.no_grad():                        # a copy of the weights, never trained: no autograd graph
        w13_ext, w2_ext = pack_w13_in_k(w13, w13_lora_b), pack_w2_in_k(w2, w2_lora_b)
    bs = (*w13_lora_b, *w2_lora_b)
    return InKWeights(w13_ext[:, :, :w13.shape[2]], w2_ext[:, :, :w2.shape[2]], w13_ext, w2_ext, bs,
                      tuple(_version(b) for b in bs))


def check_in_k(pack, w13, w2, w13_lora_b, w2_lora_b) -> None:
    """A TypeError / ValueError unless ``pack`` (from :func:`pack_in_k`) holds these very weights, unchanged."""
    if not isinstance(pack, InKWeights):
        raise TypeError(f"in_k: expected the InKWeights of pack_in_k(w13, w2, w13_lora_b, w2_lora_b), got "
                        f"{type(pack).__name__}")
    if w13_lora_b is None:
        raise ValueError("in_k: packs the LoRA's B into the base weights, but the call has no LoRA; drop in_k")

    def same(a, b):
        return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()

    if not (same(w13, pack.w13) and same(w2, pack.w2)):
        raise ValueError("w13, w2: not the views in_k holds; pass in_k.w13 and in_k.w2, so that every schedule "
                         "reads the one packed copy of the base weights")
    bs = (*w13_lora_b, *w2_lora_b)
    if len(bs) != len(pack.lora_b) or any(a is not b for a, b in zip(bs, pack.lora_b)):
        raise ValueError("w13_lora_b, w2_lora_b: not the tensors in_k was packed from; pack_in_k(...) again with "
                         "these")
    if any(v is not None and _version(b) != v for b, v in zip(bs, pack.versions)):
        raise ValueError("w13_lora_b, w2_lora_b: changed in place since pack_in_k packed them; pack again "
                         "(in_k holds a copy of every slot's B)")


def _split(ext, at: int, cols: int, lora_a, slices: int, names: tuple):
    """The base weight [E, N, cols] and B [L, E, N/S, r] of each slice, as views of ``ext``."""
    en, an, pack = names
    if not isinstance(lora_a, (list, tuple)) or len(lora_a) != slices or getattr(lora_a[0], "dim", lambda: 0)() != 4:
        raise TypeError(f"{an}: expected a list of {slices} tensor(s) [L, E, r, K]")
    if not isinstance(ext, torch.Tensor) or ext.dim() != 3:
        raise TypeError(f"{en}: expected a tensor [E, N, K' + L*r] from {pack}, got "
                        f"{getattr(ext, 'shape', type(ext).__name__)}")
    E, N, width = ext.shape
    L, r = lora_a[0].shape[0], lora_a[0].shape[2]
    if width != at + L * r or not ext.is_contiguous():
        raise ValueError(f"{en}: expected a contiguous [E, N, {at} + L*r] = [{E}, {N}, {at + L * r}] (L = {L}, "
                         f"r = {r} from {an}), got {tuple(ext.shape)}; build it with {pack}")
    n = N // slices
    return ext[:, :, :cols], [ext[:, s * n:(s + 1) * n, at:].view(E, n, L, r).permute(2, 0, 1, 3)
                              for s in range(slices)]


def _w2_split(w2_ext, w13, w2_lora_a):
    if not isinstance(w13, torch.Tensor) or w13.dim() != 3:
        raise TypeError("w13, w2_ext: expected tensors [E, 2I, H] and [E, H, I + L*r] (w2_ext from pack_w2_in_k)")
    I = w13.shape[1] // 2
    return _split(w2_ext, I, I, w2_lora_a, 1, ("w2_ext", "w2_lora_a", "pack_w2_in_k(w2, w2_lora_b)"))
