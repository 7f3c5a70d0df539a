"""FP8 e4m3 expert weights with float32 block scales, and per-token-group FP8 activations.

Shape legend: E experts, N out, K in, M rows (tokens or pairs), BN x BK a weight scale block, G an activation
group, SN = ceil(N / BN), SK = ceil(K / BK).

The format is the one fine-grained FP8 checkpoints use (a ``weight_block_size`` of [128, 128]): a weight is
stored as ``data`` [E, N, K] float8_e4m3fn and ``scale`` [E, SN, SK] float32, and its value is
``data[e, n, k] * scale[e, n // BN, k // BK]`` (the scale multiplies: checkpoints call it ``weight_scale_inv``).
Per-tensor FP8 is the same format with one block per expert (``block_size=None``: BN = N, BK = K). Activations
are quantized per row and per group of G columns: ``x ≈ xq[m, j] * x_scale[m, j // G]``.

Each scale maps its block's largest magnitude onto FP8_MAX, so nothing saturates; an all-zero block gets
scale 1 (its data are zeros).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..validate import FLOAT_DTYPES, check_int, check_tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)     # 448
BLOCK_SIZE = (128, 128)                        # the checkpoints' weight_block_size
GROUP_SIZE = 128                               # the activations' group along K


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _per_max(amax: torch.Tensor) -> torch.Tensor:
    """amax / FP8_MAX, rounded once (IEEE division) on every device: divided by a Python number, a CUDA tensor is
    multiplied by the number's reciprocal instead, which differs in the last bit for about half the values."""
    return amax / torch.full_like(amax, FP8_MAX)


def check_block_size(name: str, block_size) -> tuple[int, int] | None:
    """A weight scale block (BN, BK) of positive ints, or None (one scale per expert); a named error otherwise."""
    if block_size is None:
        return None
    if not (isinstance(block_size, (tuple, list)) and len(block_size) == 2):
        raise TypeError(f"{name}: expected a pair (BN, BK) such as {BLOCK_SIZE}, or None for one scale per "
                        f"expert, got {block_size!r}")
    return check_int(f"{name}[0]", block_size[0], low=1), check_int(f"{name}[1]", block_size[1], low=1)


def _check_finite(name: str, t: torch.Tensor) -> None:
    if 0 in t.shape:
        raise ValueError(f"{name}: has no elements (shape {tuple(t.shape)}); there is nothing to quantize")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name}: holds inf or NaN, which FP8 cannot scale; find where they came from first")


@dataclass(frozen=True, eq=False)
class FP8Weight:
    """One stack of expert weights in FP8: ``data`` [E, N, K] float8_e4m3fn, ``scale`` [E, SN, SK] float32,
    ``block_size`` (BN, BK). ``dequantize()`` gives the weights it stands for."""

    data: torch.Tensor
    scale: torch.Tensor
    block_size: tuple[int, int]

    def __post_init__(self) -> None:
        check_tensor("data", self.data, ndim=3, dtypes=(FP8_DTYPE,), legend="[E, N, K]")
        E, N, K = self.data.shape
        BN, BK = check_block_size("block_size", self.block_size) or (N, K)
        object.__setattr__(self, "block_size", (BN, BK))
        check_tensor("scale", self.scale, dtypes=(torch.float32,), shape=(E, _cdiv(N, BN), _cdiv(K, BK)),
                     legend=f"[E, ceil(N / {BN}), ceil(K / {BK})]", device=self.data.device)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[E, N, K] in ``dtype``: every element times its block's scale (computed in float32)."""
        E, N, K = self.data.shape
        BN, BK = self.block_size
        scale = self.scale.repeat_interleave(BN, 1)[:, :N].repeat_interleave(BK, 2)[:, :, :K]
        return (self.data.float() * scale).to(dtype)

    def nbytes(self) -> int:
        """Bytes in memory: one per weight plus four per scale."""
        return self.data.numel() + 4 * self.scale.numel()


@dataclass(frozen=True, eq=False)
class QuantizedExperts:
    """An MoE layer's base weights in FP8: ``w13`` [E, 2I, H] and ``w2`` [E, H, I]."""

    w13: FP8Weight
    w2: FP8Weight

    def __post_init__(self) -> None:
        for name in ("w13", "w2"):
            if not isinstance(getattr(self, name), FP8Weight):
                raise TypeError(f"{name}: expected an FP8Weight (quantize_weight(...)), "
                                f"got {type(getattr(self, name)).__name__}")
        (E, N13, H), (E2, H2, I) = self.w13.shape, self.w2.shape
        if E2 != E or H2 != H or N13 != 2 * I:
            raise ValueError(f"w13 {tuple(self.w13.shape)} and w2 {tuple(self.w2.shape)} are not one layer's: "
                             "expected w13 [E, 2I, H] and w2 [E, H, I]")
        if self.w13.device != self.w2.device:
            raise ValueError(f"w2: is on {self.w2.device}, but w13 is on {self.w13.device}")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        return self.w13.dequantize(dtype), self.w2.dequantize(dtype)


def quantize_weight(w: torch.Tensor, block_size=BLOCK_SIZE) -> FP8Weight:
    """``w`` [E, N, K] (float32/16, bf16) as an :class:`FP8Weight` with one scale per (BN, BK) block
    (``block_size=None``: one per expert). Blocks at the edges may be partial."""
    check_tensor("w", w, ndim=3, dtypes=FLOAT_DTYPES, legend="[E, N, K]")
    E, N, K = w.shape
    _check_finite("w", w)
    BN, BK = check_block_size("block_size", block_size) or (N, K)
    SN, SK = _cdiv(N, BN), _cdiv(K, BK)
    padded = w.new_zeros(E, SN * BN, SK * BK, dtype=torch.float32)
    padded[:, :N, :K] = w.float()
    blocks = padded.view(E, SN, BN, SK, BK)
    amax = blocks.abs().amax(dim=(2, 4))                                   # [E, SN, SK]
    scale = torch.where(amax > 0, _per_max(amax), torch.ones_like(amax))
    q = (blocks / scale[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    data = q.view(E, SN * BN, SK * BK)[:, :N, :K].contiguous()
    return FP8Weight(data, scale.contiguous(), (BN, BK))


def quantize_experts(w13: torch.Tensor, w2: torch.Tensor, block_size=BLOCK_SIZE) -> QuantizedExperts:
    """Both base weights of a layer in FP8, with ``block_size`` blocks (None: per tensor)."""
    return QuantizedExperts(quantize_weight(w13, block_size), quantize_weight(w2, block_size))


def quantize_activation(x: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] as (xq [M, K] float8_e4m3fn, x_scale [M, ceil(K / G)] float32): one scale per row and group
    of G columns, its largest magnitude mapped onto FP8_MAX (the spec of the activation quantization)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, legend="[M, K]")
    G = check_int("group_size", group_size, low=1)
    M, K = x.shape
    _check_finite("x", x)
    SK = _cdiv(K, G)
    padded = x.new_zeros(M, SK * G, dtype=torch.float32)
    padded[:, :K] = x.float()
    groups = padded.view(M, SK, G)
    amax = groups.abs().amax(dim=2)
    scale = torch.where(amax > 0, _per_max(amax), torch.ones_like(amax))
    q = (groups / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(M, SK * G)[:, :K].contiguous(), scale.contiguous()


def dequantize_activation(xq: torch.Tensor, x_scale: torch.Tensor, group_size: int = GROUP_SIZE,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The activation ``(xq, x_scale)`` stands for, [M, K] in ``dtype``."""
    check_tensor("xq", xq, ndim=2, dtypes=(FP8_DTYPE,), legend="[M, K]")
    G = check_int("group_size", group_size, low=1)
    M, K = xq.shape
    check_tensor("x_scale", x_scale, dtypes=(torch.float32,), shape=(M, _cdiv(K, G)), legend=f"[M, ceil(K / {G})]",
                 device=xq.device)
    return (xq.float() * x_scale.repeat_interleave(G, 1)[:, :K]).to(dtype)
