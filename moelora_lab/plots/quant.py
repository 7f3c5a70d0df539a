"""Notebook 10's tables and figures: the LoRA's share of the layer's bytes on a bf16 and on an FP8 base (the byte
model, ``profile.traffic.layer_traffic``), the measured layer on both bases (``bench layer`` beside ``bench layer
--base fp8``, one run: ``scripts/gpu_data.sh fp8``), and one weight's block scales.

Shape legend: M tokens, r rank; a weight [E, N, K] with scales [E, SN, SK].
"""
from __future__ import annotations

import math

from ..config import MoEShape
from ..layer.table import AUTO_CPU
from ..profile.traffic import layer_traffic
from ..validate import check_int
from .traffic import sweep_workload

BASES = {"dtype": "bf16 base", "fp8": "FP8 base"}
MARKERS = {16: "o", 64: "s"}


def lora_share_rows(shape, tokens, ranks=(16, 64), *, num_loras: int = 4) -> list[dict]:
    """One row per (base, rank, M) of the byte model (bf16 activations, the one-shot LoRA, the routing of the
    H200 sweep): ``lora`` the bytes of the two LoRA ops, ``total`` the layer's, ``plain`` the layer's without
    LoRA; ``share`` = lora / total and ``ratio`` = total / plain (what the LoRA adds, as a multiple)."""
    shape = shape if isinstance(shape, MoEShape) else MoEShape.from_name(shape)
    rows = []
    for base in BASES:
        for r in ranks:
            check_int("rank", r, low=1)
            for m in tokens:
                wl = sweep_workload(shape, check_int("tokens", m, low=1), num_loras)
                st = layer_traffic(shape, r, wl, base=base)
                plain = layer_traffic(shape, r, wl, base=base, with_lora=False)["total"].bytes
                lora = st["lora_w13"].bytes + st["lora_w2"].bytes
                rows.append(dict(base=base, rank=r, M=m, lora=lora, total=st["total"].bytes, plain=plain,
                                 share=lora / st["total"].bytes, ratio=st["total"].bytes / plain))
    return rows


def draw_lora_share(ax, rows, *, title: str | None = None):
    """The LoRA's share of the layer's bytes against M, one line per (base, rank) of :func:`lora_share_rows`."""
    for (base, name), color in zip(BASES.items(), ("tab:blue", "tab:red")):
        for r in sorted({row["rank"] for row in rows}):
            pts = sorted((row["M"], row["share"]) for row in rows if row["base"] == base and row["rank"] == r)
            if pts:
                ax.plot(*zip(*pts), marker=MARKERS.get(r, "^"), color=color, label=f"{name}, rank {r}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens M")
    ax.set_ylabel("LoRA bytes / layer bytes")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def measured_ratios(bf16_rows, fp8_rows, *, variant: str = AUTO_CPU) -> list[dict]:
    """Per (rank, M) measured in one run on both bases: ``speedup`` = bf16 no_lora time / FP8 no_lora time,
    ``lora_cost`` = FP8 ``variant`` time / FP8 no_lora time, and ``lora_cost_bf16`` the same on the bf16 base
    (``variant`` by default the one-stream schedule, ``AUTO_CPU``)."""
    def times(rows):
        return {(r["rank"], r["M"], r["variant"]): r["us_median"] for r in rows if not r.get("error")}
    b, f = times(bf16_rows), times(fp8_rows)
    out = []
    for (rank, m, _) in sorted(k for k in f if k[2] == variant):
        if (rank, m, "no_lora") in f and (rank, m, "no_lora") in b and (rank, m, variant) in b:
            plain_f, plain_b = f[rank, m, "no_lora"], b[rank, m, "no_lora"]
            out.append(dict(rank=rank, M=m, bf16_us=plain_b, fp8_us=plain_f, speedup=plain_b / plain_f,
                            lora_cost=f[rank, m, variant] / plain_f, lora_cost_bf16=b[rank, m, variant] / plain_b))
    return out


def draw_measured(ax, ratios, *, title: str | None = None):
    """What the LoRA adds to the layer's time (with / without) on each base, against M, from
    :func:`measured_ratios`."""
    for key, name, color in (("lora_cost_bf16", "bf16 base", "tab:blue"), ("lora_cost", "FP8 base", "tab:red")):
        for r in sorted({row["rank"] for row in ratios}):
            pts = sorted((row["M"], row[key]) for row in ratios if row["rank"] == r)
            ax.plot(*zip(*pts), marker=MARKERS.get(r, "^"), color=color, label=f"{name}, rank {r}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens M")
    ax.set_ylabel("time with LoRA / without")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def draw_block_scales(ax, weight, expert: int = 0, *, title: str | None = None):
    """log2 of each block's scale of ``weight`` (a ``quant.FP8Weight``) for one expert, [SN, SK]: one cell per
    (BN, BK) block, so blocks of different magnitudes show as different colours."""
    scale = weight.scale[expert].float().log2().cpu()
    im = ax.imshow(scale.numpy(), cmap="viridis", aspect="auto")
    ax.figure.colorbar(im, ax=ax, label="log2 scale")
    BN, BK = weight.block_size
    ax.set_xlabel(f"block column (of {BK} inputs)")
    ax.set_ylabel(f"block row (of {BN} outputs)")
    ax.set_title(title or f"expert {expert}: {scale.shape[0]} x {scale.shape[1]} scales, "
                          f"{math.prod(scale.shape) * 4} bytes", fontsize=10)
    return ax
