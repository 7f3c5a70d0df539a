"""What the benchmark subcommands share: the device they run on, their seeded tensors and routing,
the arguments every sweep takes, and the command line recorded with the data.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, H hidden, I expert intermediate.
"""
from __future__ import annotations

import shlex
import textwrap
import time
from pathlib import Path

import torch

from ..config import BENCH_ADAPTERS, MoEShape, benchmark_routing
from ..results import DATA_DIR as DEFAULT_OUT

DEVICE = "cuda"   # the benchmarks run on CUDA; tests point this at the CPU to run the pipeline end to end
PROG = "python -m moelora_lab.bench"
GPU_ONLY = ("Needs a CUDA GPU: on a CPU it stops at once; the committed CSVs under moelora_lab/data/ are what the "
            "notebooks plot.")


def close(got: torch.Tensor, want: torch.Tensor, tol: float = 2e-2) -> bool:
    """``got`` equals ``want`` within ``tol`` relative to each element and to ``want``'s largest magnitude
    (the check every sweep makes before it times a kernel); NaN never passes."""
    return torch.allclose(got, want, rtol=tol, atol=tol * max(float(want.abs().max()), 1e-3))


def device() -> str:
    """Where the benchmarks put their tensors (``DEVICE``, read at each call)."""
    return DEVICE


def seeded_generator(seed: int) -> torch.Generator:
    """A generator on the benchmark's device: tensors are drawn where they live."""
    return torch.Generator(device=device()).manual_seed(seed)


def sweep_routing(shape: MoEShape, num_loras: int, M: int, seed: int, adapters: str = "uniform"):
    """(topk_ids [M, k], topk_weights [M, k], token_lora [M]) of the benchmarks' M tokens on the device:
    min(M, 8) sequences, seed + M, adapters drawn as ``adapters`` says
    (:func:`moelora_lab.config.benchmark_routing`)."""
    r = benchmark_routing(shape, num_loras, M, seed, adapters)
    return tuple(r[n].to(device()) for n in ("topk_ids", "topk_weights", "token_lora"))


def base_weights(shape: MoEShape, gen: torch.Generator, dtype: torch.dtype):
    """Random base weights w13 [E, 2I, H] ~ N(0, 1/H) and w2 [E, H, I] ~ N(0, 1/I), drawn on the device."""
    E, H, I = shape.num_experts, shape.hidden, shape.intermediate
    w13 = torch.randn(E, 2 * I, H, device=device(), generator=gen, dtype=dtype) / H ** 0.5
    w2 = torch.randn(E, H, I, device=device(), generator=gen, dtype=dtype) / I ** 0.5
    return w13, w2


def grouped_mm_fns(x, h, topk_ids, w13, w2):
    """The w13 and w2 base GEMMs through torch._grouped_mm on rows pre-grouped by expert (grouping
    not timed): two callables. x [M, H], h [M*k, I], topk_ids [M, k]."""
    k = topk_ids.shape[1]
    experts = topk_ids.reshape(-1).long()
    order = torch.sort(experts, stable=True).indices
    xs, hs = x[order // k].contiguous(), h[order].contiguous()
    offs = torch.cumsum(torch.bincount(experts, minlength=w13.shape[0]), 0).to(torch.int32)
    b13, b2 = w13.transpose(1, 2), w2.transpose(1, 2)
    return lambda: torch._grouped_mm(xs, b13, offs=offs), lambda: torch._grouped_mm(hs, b2, offs=offs)


def progress(iterable=None, **kw):
    """A progress bar on stderr (or in the notebook)."""
    from tqdm.auto import tqdm     # imported here: tqdm.auto pulls in IPython where it is installed
    return tqdm(iterable, **kw)


def sweep_parser(sub, what: str, help: str, *, name: str, tokens, presets=("qwen3-30b-a3b",), ranks=None,
                 dtype: bool = True, max_seconds: bool = False):
    """A subcommand with the arguments every sweep shares (ranks, dtype, time budget optional)."""
    p = sub.add_parser(what, help=help, description=textwrap.fill(f"{help[0].upper()}{help[1:]}. {GPU_ONLY}", 100))
    p.add_argument("--presets", nargs="+", default=list(presets),
                   help="layer shapes, names of moelora_lab.PRESETS (default: %(default)s)")
    p.add_argument("--tokens", nargs="+", type=int, default=list(tokens),
                   help="token counts M to sweep (default: %(default)s)")
    if ranks is not None:
        p.add_argument("--ranks", nargs="+", type=int, default=list(ranks),
                       help="LoRA ranks r to sweep (default: %(default)s)")
    p.add_argument("--loras", type=int, default=4, help="adapter slots L (default: %(default)s)")
    p.add_argument("--adapters", choices=BENCH_ADAPTERS, default="uniform",
                   help="each sequence's adapter: uniform = a random one (some may go unused), distinct = sequence i "
                        "gets adapter i mod L (all in use); recorded in every row (default: %(default)s)")
    if dtype:
        p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                       help="dtype of the activations and weights (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random tensors and routing (default: %(default)s)")
    if max_seconds:
        p.add_argument("--max-seconds", type=float, default=1e9, help="stop starting new cases after this many seconds")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="folder for the CSV and plots (default: the committed data, %(default)s)")
    p.add_argument("--name", default=name, help="file stem of the CSV and plots (default: %(default)s)")
    return p


def command_line(argv) -> str:
    """The command that reproduces a run, as recorded in its data (``--out`` is where it was written,
    not how it was measured, and is left out)."""
    kept, argv = [], list(argv)
    while argv:
        a = argv.pop(0)
        if a == "--out":
            argv.pop(0)
        elif not a.startswith("--out="):
            kept.append(a)
    return f"{PROG} " + " ".join(shlex.quote(a) for a in kept)


def eager_sampler(calls: dict, *, rounds: int, warmup_ms: float, rep_ms: float, cpu_steps: int = 1):
    """sample(name, round) -> times in ms of ``calls[name]()`` run eagerly (no CUDA graph), for
    ``timing.interleave``: CUDA events with L2 flushed (``triton.testing.do_bench``, ``rep_ms`` of calls over all
    rounds, ``warmup_ms`` before the first) where the benchmark's tensors are on a GPU, else the wall clock of
    ``cpu_steps`` calls per round (the pipelines' tests on the CPU; never a GPU's time)."""
    if torch.device(device()).type == "cuda":
        import triton.testing

        def sample(name, rnd):
            times = triton.testing.do_bench(calls[name], warmup=warmup_ms if rnd == 0 else warmup_ms / 5,
                                            rep=rep_ms / rounds, return_mode="all")
            if not isinstance(times, list):
                raise RuntimeError("triton.testing.do_bench(return_mode='all') did not return the call times")
            return times
    else:
        def sample(name, rnd):
            out = []
            for _ in range(cpu_steps):
                t0 = time.perf_counter()
                calls[name]()
                out.append((time.perf_counter() - t0) * 1e3)
            return out
    return sample
