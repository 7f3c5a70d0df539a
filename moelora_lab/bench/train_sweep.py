"""``python -m moelora_lab.bench train``: one training step (forward + backward) of the MoE layer with LoRA,
the lab's against transformers + PEFT in the same run.

Variants per (preset, M, rank), one row each (the steps in ``train_models``):
  lab_lora         ``moe_lora_layer`` with L adapters (``--loras``, default 1: every token on adapter 0),
                   gradients to x and every LoRA factor, base frozen
  lab_base         the same layer without LoRA, gradient to x
  grouped_mm_base  a base MoE layer on torch._grouped_mm (pairs sorted by expert, offsets) under torch autograd,
                   gradient to x: the reference for the base (a row error where torch._grouped_mm is missing)
  hf_peft          transformers' Qwen3-MoE experts (``grouped_mm`` where the installed transformers offers it;
                   ``impl`` says what ran) with PEFT LoRA on gate_up_proj and down_proj (``target_parameters``,
                   rank r, the lab_lora adapters themselves), gradients to x and the LoRA factors; PEFT runs
                   one adapter per call, so with L > 1 one call per adapter on its own tokens (rows gathered
                   before the step)
  hf_base          the same experts without PEFT, gradient to x
The router is excluded from every variant: all start from the same routing and build their own routing
metadata (plan, sort) inside the step. Each step runs eagerly, as training does (no CUDA graph): time between
CUDA events around it, L2 flushed before each (``triton.testing.do_bench``), median / p20 / p80 in µs of
the steps of ``ROUNDS`` interleaved rounds (``timing.interleave``), so CPU launch overhead counts where the
GPU waits for it.

``peak_mib``: torch.cuda.max_memory_allocated during one step (after reset_peak_memory_stats) minus
memory_allocated just before it: the step's own working set (saved activations, temporaries, the gradients
it returns) above everything resident (inputs, weights, LoRA factors, the other variants' models).
``floor_bytes`` / ``floor_flops``: ``train_models.train_floor`` of the row (with or without LoRA); ``floor_us``
bytes at the copy rate, ``roofline_us`` max(floor_us, FLOPs at the matmul rate), both rates measured in this
run. ``lora_share_time`` on the LoRA rows, (lab_lora - lab_base) / lab_lora and (hf_peft - hf_base) / hf_peft,
next to ``lora_share_bytes`` and ``lora_share_flops`` from the floors.
``grad_rel_err``: before timing, each variant's gradients against ``moe_layer_reference``'s (float32
arithmetic) on the whole case, max |got - want| / max |want| over the tensors (hf_peft's compared in PEFT's
layout); above ``GRAD_TOL`` the row's ``error`` says so. Rows carry ``device``: the GPU's name, or ``cpu``
where the tests point ``common.DEVICE`` at the CPU (then wall-clock times of a few steps, never a GPU's).

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, H hidden, I expert intermediate.
"""
from __future__ import annotations

import gc
import sys
import time

import torch

from ..config import MoEShape
from ..profile import timing
from ..profile.gpu_state import GpuMonitor
from ..profile.traffic import count_workload
from ..train.peft_grads import relative_error
from .common import device, eager_sampler, progress, seeded_generator, sweep_parser
from .train_models import (BASE_OF, VARIANTS, WITH_LORA, build_adapters, build_base, build_case, build_variant,
                           reference_grads, train_floor)

NAME = "train"
ROUNDS = 3               # interleaved rounds per case
WARMUP_MS, REP_MS = 25.0, 300.0     # do_bench's warm-up in the first round; replay time per variant, all rounds
CPU_STEPS = 1            # wall-clock steps per round on the CPU (the pipeline's tests)
GRAD_TOL = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def add_parser(sub):
    p = sweep_parser(sub, NAME, "forward + backward of the MoE layer with LoRA against transformers + PEFT",
                     name="train", tokens=(512, 2048, 4096, 8192), ranks=(16, 64), max_seconds=True)
    p.set_defaults(loras=1)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), metavar="VARIANT",
                   help=f"a subset of {', '.join(VARIANTS)} (default: all)")
    return p


def _on_gpu() -> bool:
    return torch.device(device()).type == "cuda"


def _probe(step):
    """(gradients, peak_mib) of one step, on a GPU after a warm-up step (kernels compiled); peak_mib '' on the
    CPU."""
    gpu = _on_gpu()
    if gpu:
        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    grads = step()
    if not gpu:
        return grads, ""
    torch.cuda.synchronize()
    return grads, round((torch.cuda.max_memory_allocated() - before) / 2 ** 20, 1)


def _grad_error(got: list, want: list) -> float:
    if len(got) != len(want):
        raise RuntimeError(f"the step returned {len(got)} gradients, the reference {len(want)}")
    for g, w in zip(got, want):
        if g.shape != w.shape:
            raise RuntimeError(f"a gradient of shape {tuple(g.shape)} against the reference's {tuple(w.shape)}")
    return max(relative_error(g.float(), w.float()) for g, w in zip(got, want))


def _err(exc: Exception) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"


def _share(part, whole):
    """(whole - part) / whole, '' where either is missing."""
    return "" if part is None or whole is None or not whole else round((whole - part) / whole, 4)


def run_case(case, names, dtype, rates) -> list[dict]:
    """The rows of one case: build, check and measure every variant, time those that ran in interleaved rounds."""
    shape = case.base.shape
    L, r = case.adapters.lora["w13_lora_a"][0].shape[0], case.adapters.rank
    ref, made, rows = {}, {}, {}
    for with_lora, key in ((True, "lora"), (False, "base")):
        if any((n in WITH_LORA) == with_lora for n in names):
            try:
                ref[key] = reference_grads(case, with_lora)
            except Exception as exc:                   # noqa: BLE001 (recorded in the rows, the sweep goes on)
                ref[key] = exc
    for name in names:
        row = dict(impl="", grads="", peak_mib="", grad_rel_err="", error="")
        try:
            v = made[name] = build_variant(name, case)
            row.update(impl=v.impl, grads=v.grads)
            got, row["peak_mib"] = _probe(v.step)
            want = ref["lora" if name in WITH_LORA else "base"]
            if isinstance(want, Exception):
                row["error"] = f"no reference gradients: {_err(want)}"
            else:
                err = row["grad_rel_err"] = float(f"{_grad_error(got, v.want(ref)):.3g}")
                if not err <= GRAD_TOL[dtype]:
                    row["error"] = f"gradients differ from the reference: relative error {err:.3g} > {GRAD_TOL[dtype]}"
            del got
        except Exception as exc:                       # noqa: BLE001 (e.g. torch._grouped_mm or peft missing)
            made.pop(name, None)
            row["error"] = _err(exc)
        rows[name] = row
    ref.clear()
    with GpuMonitor() as state:
        sample = eager_sampler({n: v.step for n, v in made.items()}, rounds=ROUNDS, warmup_ms=WARMUP_MS,
                               rep_ms=REP_MS, cpu_steps=CPU_STEPS)
        timed = timing.interleave(list(made), ROUNDS, sample)
    made.clear()
    medians = {n: t.median_us for n, t in timed.items() if isinstance(t, timing.Timing)}
    work = count_workload(case.topk_ids, case.token_lora, shape.num_experts, L)
    floors = {w: train_floor(shape, r, work, dtype_bytes=torch.finfo(dtype).bits // 8, with_lora=w)
              for w in (True, False)}
    copy_bps, flops_per_s = rates
    out = []
    for name, row in rows.items():
        t, fl, lora = timed.get(name), floors[name in WITH_LORA], name in WITH_LORA
        if isinstance(t, Exception):
            row["error"] = _err(t)
        times = (round(t.median_us, 2), round(t.p20_us, 2), round(t.p80_us, 2)) if name in medians else ("",) * 3
        floor_us = fl.floor_us(copy_bps) if copy_bps else None
        roof = max(floor_us, fl.flops / flops_per_s * 1e6) if floor_us else None
        out.append(dict(
            preset=shape.name, M=case.x.shape[0], rank=r, loras=L, variant=name, impl=row["impl"], grads=row["grads"],
            us_median=times[0], us_p20=times[1], us_p80=times[2], peak_mib=row["peak_mib"],
            floor_bytes=fl.bytes, floor_flops=fl.flops, floor_us=round(floor_us, 2) if floor_us else "",
            roofline_us=round(roof, 2) if roof else "",
            lora_share_time=_share(medians.get(BASE_OF.get(name)), medians.get(name)) if lora else "",
            lora_share_bytes=_share(floors[False].bytes, floors[True].bytes) if lora else "",
            lora_share_flops=_share(floors[False].flops, floors[True].flops) if lora else "",
            grad_rel_err=row["grad_rel_err"], error=row["error"], **state.summary()))
    return out


def run(args) -> list[dict]:
    """Time every variant of every case within ``--max-seconds``; the rows carry the device and provenance."""
    dtype = getattr(torch, args.dtype)
    prov = timing.provenance(args.command)
    gpu = _on_gpu()
    rates = (timing.copy_bandwidth(), timing.matmul_rate(dtype)) if gpu else (None, None)
    where = dict(device=torch.cuda.get_device_name() if gpu else "cpu", dtype=args.dtype,
                 copy_tbps=round(rates[0] / 1e12, 4) if gpu else "",
                 matmul_tflops=round(rates[1] / 1e12, 1) if gpu else "")
    gen = seeded_generator(args.seed)
    cases = [(p, r, m) for p in args.presets for r in args.ranks for m in args.tokens]
    rows, base, adapters = [], None, None
    start = time.monotonic()
    for preset, rank, M in progress(cases, desc=NAME, unit="case"):
        if rows and time.monotonic() - start > args.max_seconds:      # the first case always runs
            print(f"time budget of {args.max_seconds} s spent: skipping the remaining cases", file=sys.stderr)
            break
        shape = MoEShape.from_name(preset)
        if base is None or base.shape != shape:
            base = adapters = None
            _free()
            base = build_base(shape, dtype, args.seed, gen)
        if adapters is None or adapters.rank != rank:
            adapters = None
            _free()
            adapters = build_adapters(base, args.loras, rank, args.seed, gen, dtype)
        case = build_case(base, adapters, M, args.loras, args.seed, gen, dtype, args.adapters)
        rows += [dict(row, **where, **prov) for row in run_case(case, args.variants, dtype, rates)]
        del case
        _free()
    return rows


def _free() -> None:
    gc.collect()
    if _on_gpu():
        torch.cuda.empty_cache()
