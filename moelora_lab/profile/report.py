"""Registers, spills, shared memory and an occupancy estimate of a compiled kernel (GPU only).

Hopper limits used for the estimate: 65,536 32-bit registers, 228 KiB shared memory, 64 warps
and 32 resident blocks per SM; registers are allocated per warp in units of 256.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .._backend import INTERPRET

REGS_PER_SM, SMEM_PER_SM, WARPS_PER_SM, BLOCKS_PER_SM = 65536, 228 * 1024, 64, 32


@dataclass(frozen=True)
class KernelReport:
    name: str
    n_regs: int
    n_spills: int
    shared_bytes: int
    num_warps: int
    blocks_per_sm: int
    occupancy: float     # resident warps / 64

    def as_dict(self) -> dict:
        return asdict(self)


def occupancy(n_regs: int, shared_bytes: int, num_warps: int) -> tuple[int, float]:
    """Resident blocks per SM and the fraction of the SM's warp slots they fill."""
    regs_per_warp = -(-max(n_regs, 1) * 32 // 256) * 256
    by_regs = REGS_PER_SM // (regs_per_warp * num_warps)
    by_smem = SMEM_PER_SM // shared_bytes if shared_bytes else BLOCKS_PER_SM
    by_warps = WARPS_PER_SM // num_warps
    blocks = max(0, min(by_regs, by_smem, by_warps, BLOCKS_PER_SM))
    return blocks, blocks * num_warps / WARPS_PER_SM


def report(compiled, num_warps: int) -> KernelReport:
    """Read a compiled Triton kernel (the object a launch returns on a GPU)."""
    if INTERPRET or compiled is None:
        raise RuntimeError("a kernel report needs a GPU: the interpreter compiles nothing, so there are no "
                           "registers to count; the notebooks show the committed H200 data instead")
    shared = int(getattr(compiled.metadata, "shared", 0))
    blocks, occ = occupancy(compiled.n_regs, shared, num_warps)
    return KernelReport(compiled.name, compiled.n_regs, compiled.n_spills, shared, num_warps, blocks, occ)


def one_shot_report(rank: int, *, block_m: int = 64, max_block_r: int = 128, hidden: int = 2048,
                    inter: int = 768, dtype=torch.bfloat16) -> KernelReport:
    """Compile the one-shot kernel for a w13-shaped problem at ``rank`` and report on it."""
    if not torch.cuda.is_available() or INTERPRET:
        raise RuntimeError("one_shot_report needs a CUDA GPU (registers exist only for compiled kernels)")
    from ..config import LoRAShape, MoEShape, make_problem
    from .. import rules
    from ..op.paths import LoRACall, launch_one_shot
    from ..routing.host import block_list

    p = make_problem(MoEShape(hidden, inter, 8, 2, "report"), LoRAShape(1, rank), 64, dtype=dtype,
                     device="cuda", with_base=False, adapter_popularity="identical")
    cfg = rules.CONFIGS["prefill"].replace(block_m=block_m, max_block_r=max_block_r)
    blocks = block_list(p.topk_ids, p.token_lora, 8, 1, block_m)
    out = torch.zeros(64, 2, 2 * inter, dtype=dtype, device="cuda")
    call = LoRACall(p.x, p.topk_ids, p.topk_weights, p.token_lora, p.w13_lora_a, p.w13_lora_b, out, blocks, None,
                    mul_routed_weight=False, add_inputs=False)
    compiled = launch_one_shot(call, cfg)
    return report(compiled, cfg.num_warps)
