"""GPU timing the way the lab's H200 tables were measured, and the copy-bandwidth ceiling.

Method ("cold"): warm the op up, capture it in a CUDA graph, time graph replays with
``triton.testing.do_bench`` (it flushes L2 before every replay) and report the median with the
20th/80th percentiles in microseconds. Variants meant to be compared can be timed in interleaved
rounds (:func:`time_cuda_interleaved`, alternating direction), so that a slow drift of the GPU lands
on all of them. The numbers include the graph launch floor (a few µs).
Timings need a CUDA GPU; on the CPU these functions raise instead of returning interpreter times.
"""
from __future__ import annotations

import datetime
import platform
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    median_us: float
    p20_us: float
    p80_us: float


def _need_gpu(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} needs a CUDA GPU; on the CPU the lab shows the committed H200 data instead")


def _warm(fn) -> None:
    """Three calls on a side stream: compile the kernels, settle the allocator."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def _replayable(fn):
    """``fn`` captured in a CUDA graph: its replay (the graph lives as long as the returned callable)."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def time_cuda(fn, *, graph: bool = True, warmup_ms: float = 25, rep_ms: float = 100) -> Timing:
    """Median / p20 / p80 µs of ``fn()`` replayed from a CUDA graph with L2 flushed before each run."""
    _need_gpu("time_cuda")
    import triton.testing

    _warm(fn)
    run = _replayable(fn) if graph else fn
    q = triton.testing.do_bench(run, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    return Timing(*(v * 1e3 for v in q))


def pooled(samples_ms) -> Timing:
    """Median / p20 / p80 µs of replay times in ms (linear interpolation, as ``do_bench``'s quantiles)."""
    if len(samples_ms) == 0:
        raise ValueError("samples_ms: no replay times to summarise")
    q = torch.tensor(list(samples_ms), dtype=torch.float64).quantile(torch.tensor([0.5, 0.2, 0.8], dtype=torch.float64))
    return Timing(*(float(v) * 1e3 for v in q))


def interleave(names, rounds: int, sample) -> dict:
    """Run ``sample(name, round)`` (a list of replay times in ms) for every name in every round, the
    names in turn within a round, and pool each name's times over the rounds: a drift of the GPU's
    clock or temperature during a sweep then lands on every name alike. The rounds alternate direction
    (forward, backward, forward, ...): a steady drift then evens out over each pair of rounds, and no
    name always runs right after the same one (a heavy variant that pushes the GPU into its power cap
    would otherwise slow the next one in every round). A name whose sample raises is tried no more;
    its entry is the exception. Returns {name: Timing or Exception}."""
    if rounds < 1:
        raise ValueError(f"rounds: need at least 1, got {rounds}")
    names = list(names)
    samples, failed = {n: [] for n in names}, {}
    for rnd in range(rounds):
        for n in (names if rnd % 2 == 0 else names[::-1]):
            if n not in failed:
                try:
                    samples[n].extend(sample(n, rnd))
                except Exception as exc:      # e.g. torch._grouped_mm missing: record it, time the others
                    failed[n] = exc
    return {n: failed[n] if n in failed else pooled(samples[n]) for n in names}


def time_cuda_interleaved(fns: dict, *, rounds: int = 3, warmup_ms: float = 25, rep_ms: float = 100) -> dict:
    """:func:`time_cuda` for several callables at once, in ``rounds`` interleaved rounds (each round a
    fresh CUDA graph per callable and ``rep_ms / rounds`` of replays), the replays pooled per callable.
    Returns {name: Timing, or the exception its warm-up, capture or replay raised}."""
    _need_gpu("time_cuda_interleaved")
    import triton.testing

    def sample(name, rnd):
        if rnd == 0:
            _warm(fns[name])
        run = _replayable(fns[name])
        warmup = warmup_ms if rnd == 0 else max(1.0, warmup_ms / 5)     # warm already after the first round
        times = triton.testing.do_bench(run, warmup=warmup, rep=rep_ms / rounds, return_mode="all")
        if not isinstance(times, list):
            raise RuntimeError("triton.testing.do_bench(return_mode='all') did not return the replay times")
        return times

    return interleave(list(fns), rounds, sample)


def copy_bandwidth(num_bytes: int = 2 << 30) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    _need_gpu("copy_bandwidth")
    src = torch.empty(num_bytes // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = time_cuda(lambda: dst.copy_(src), graph=False)
    return 2 * num_bytes / (t.median_us * 1e-6)


def matmul_rate(dtype: torch.dtype = torch.bfloat16, n: int = 8192) -> float:
    """FLOP/s of one n x n x n matmul in ``dtype`` (the compute ceiling next to the copy ceiling)."""
    _need_gpu("matmul_rate")
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    t = time_cuda(lambda: a @ b, graph=False)
    return 2 * n ** 3 / (t.median_us * 1e-6)


def fp8_matmul_rate(n: int = 8192) -> float:
    """FLOP/s of one n x n x n FP8 e4m3 matmul (``torch._scaled_mm``, one scale per tensor, bf16 out): the
    compute ceiling of a layer on an FP8 base. A RuntimeError where this GPU or torch has no FP8 matmul."""
    _need_gpu("fp8_matmul_rate")
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()      # column-major, as _scaled_mm reads it
    one = torch.ones((), device="cuda")
    t = time_cuda(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), graph=False)
    return 2 * n ** 3 / (t.median_us * 1e-6)


def provenance(command: str) -> dict:
    """What produced a measurement: GPU, software versions, date, command, and the code's stamp
    (schema, tile-rule fingerprint, commit: see :mod:`moelora_lab.results`)."""
    import triton

    from ..results import stamp

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "command": command,
        **stamp(),
    }
