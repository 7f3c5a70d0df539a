"""``python -m moelora_lab.dist.bench``: the distributed layers on W local GPUs (NCCL), checked and timed.

Shape legend: M tokens per rank, E experts, k top-k, L adapters, r rank, H hidden, W ranks.

Writes to ``--out`` (default ``moelora_lab/data/h200x2``):

* ``dist_checks.csv``: each distributed layer against the single-GPU layer and the spec (bf16);
* ``dist_collectives.csv``: all-to-all, all-reduce and all-gather alone, by size (the latency and
  link rate the communication model uses);
* ``dist_steps.csv``: every stage of ``ep_layer`` and ``tp_layer`` (median over repetitions, CUDA
  events on the compute stream, a barrier before each repetition), the bytes ``dist.comm`` says the
  collectives send, and the single-GPU layer on the same tokens;
* ``dist_trace.json``: one expert-parallel prefill call with one and with two micro-batches,
  ``torch.profiler``'s GPU activity of every rank, one process per GPU (Chrome trace format).

NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``, set by ``run_local`` unless already set).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import MoEShape, benchmark_routing, layer_lora_weights
from ..layer import moe_lora_layer
from ..profile import timing
from ..profile.timeline import Tracer
from ..results import DATA_DIR, write_csv
from .checks import default_case, ep_case, tp_case
from .comm import ep_bytes, tp_bytes
from .ep import count_pairs, ep_layer
from .launch import run_local
from .partition import LORA_KEYS, ExpertPartition, shard_tp
from .tp import _all_gather, tp_layer

OUT = DATA_DIR.parent / "h200x2"
SIZES = [1 << p for p in range(12, 29, 2)]          # 4 KiB .. 256 MiB per rank


PARK_CYCLES = 20_000_000                             # ~10 ms of GPU sleep while the host queues the call


def _park_us(cycles: int) -> float:
    """How long the park sleeps on this GPU, in µs."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3


def _events_us(fn, reps: int, warmup: int = 3, *, park: bool = True) -> tuple[list, dict, float, float]:
    """Total µs per repetition, {stage: [µs]} (Tracer on the compute stream), the host's median µs
    to queue the call and the park's µs. A barrier first; ``park``: the stream first sleeps while the
    host queues every launch, so the events time the GPU, not Python (the call must not wait on the
    host). After the warm-up the park grows to twice the slowest rank's queueing time if it was
    shorter (every rank parks as long, so their collectives still meet)."""
    totals, stages, host = [], {}, []
    cycles = PARK_CYCLES
    for i in range(warmup + reps):
        tracer = Tracer()
        dist.barrier()
        torch.cuda.synchronize()
        if park:
            torch.cuda._sleep(cycles)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        fn(tracer)
        end.record()
        t1 = time.perf_counter()
        records = tracer.records()
        if i == warmup - 1 and park:
            need = torch.tensor([2 * (t1 - t0) * 1e6 / _park_us(cycles)], device="cuda")
            dist.all_reduce(need, op=dist.ReduceOp.MAX)
            cycles = max(cycles, int(cycles * float(need)))
        if i >= warmup:
            totals.append(start.elapsed_time(end) * 1e3)
            host.append((t1 - t0) * 1e6)
            for r in records:
                stages.setdefault(r["name"], []).append(r["end_us"] - r["start_us"])
    return totals, stages, statistics.median(host), _park_us(cycles) if park else 0.0


def collectives(rank, world, reps) -> list[dict]:
    rows = []
    for size in SIZES:
        n = size // 2
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        ops = {"all_to_all": (lambda: dist.all_to_all_single(torch.empty_like(x), x)) if n % world == 0 else None,
               "all_reduce": lambda: dist.all_reduce(x),
               "all_gather": lambda: _all_gather(x.new_empty(world * n), x)}
        for op, fn in ops.items():
            if fn is None:
                continue
            totals, _, _, _ = _events_us(lambda tracer: fn(), reps)
            rows.append(dict(op=op, bytes_per_rank=size, us_median=round(statistics.median(totals), 2),
                             us_min=round(min(totals), 2)))
    return rows


def _routing(shape, L, M, seed):
    """(topk_ids, topk_weights, token_lora) of the benchmarks' M tokens on this GPU."""
    r = benchmark_routing(shape, L, M, seed)
    return tuple(r[n].cuda() for n in ("topk_ids", "topk_weights", "token_lora"))


def _setup(shape, M, rank, world, L, rank_r, seed):
    """This rank's tokens and routing, the full weights (the same on every GPU: drawn on the device
    from one seed, w13 ~ N(0, 1/H) then w2 ~ N(0, 1/I)) and LoRA of rank r."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    E, H, I = shape.num_experts, shape.hidden, shape.intermediate
    w13 = torch.randn(E, 2 * I, H, device="cuda", generator=gen, dtype=torch.bfloat16) / H ** 0.5
    w2 = torch.randn(E, H, I, device="cuda", generator=gen, dtype=torch.bfloat16) / I ** 0.5
    lora = layer_lora_weights(shape, L, rank_r, gen, torch.bfloat16)
    ids, weights, token_lora = _routing(shape, L, M, seed + 1000 * (rank + 1))
    x = torch.randn(M, shape.hidden, device="cuda", dtype=torch.bfloat16)
    routing_all = [_routing(shape, L, M, seed + 1000 * (w + 1))[0] for w in range(world)]
    return x, ids, weights, token_lora, dict(w13=w13, w2=w2, **lora), routing_all


def steps(rank, world, args) -> list[dict]:
    shape = MoEShape.from_name(args.preset)
    part = ExpertPartition(shape.num_experts, world)
    rows = []
    for M in args.tokens:
        for r in args.ranks:
            x, ids, wts, tl, full, routing_all = _setup(shape, M, rank, world, args.loras, r, args.seed)
            counts = {mb: count_pairs(ids, part, micro_batches=mb) for mb in (1, 2)}
            base = dict(w13=full["w13"], w2=full["w2"])
            lora = {key: full[key] for key in LORA_KEYS}
            # TP serves every rank's tokens: W*M rows, the same on all ranks
            X, IDS, WTS, TL = (torch.cat([t] * world) for t in (x, ids, wts, tl))
            cases = {}
            for with_lora in (False, True):
                tag = f"r{r}" if with_lora else "none"
                if with_lora or r == args.ranks[0]:
                    w = dict(base, **lora) if with_lora else base
                    local = part.shard(w, rank)
                    cases[("ep", tag, 1)] = lambda tr, local=local: ep_layer(x, ids, wts, tl, local, part, tracer=tr,
                                                                             counts=counts[1], validate=False)
                    cases[("single_gpu", tag, 1)] = (lambda tr, w=w: moe_lora_layer(
                        x, ids, wts, tl, w["w13"], w["w2"], *(w.get(key) for key in LORA_KEYS), tracer=tr,
                        validate=False))
                    for fs in ((False, True) if with_lora else (False,)):
                        shard = shard_tp(w, rank, world, fully_sharded=fs)
                        name = "tp_fully_sharded" if fs else "tp"
                        cases[(name, tag, 1)] = (lambda tr, shard=shard, fs=fs: tp_layer(
                            X, IDS, WTS, TL, shard, fully_sharded=fs, tracer=tr, validate=False))
            local = part.shard(dict(base, **lora), rank)
            cases[("ep", f"r{r}", 2)] = lambda tr: ep_layer(x, ids, wts, tl, local, part, tracer=tr, micro_batches=2,
                                                            counts=counts[2], validate=False)
            cases[("ep_counts", "none", 1)] = lambda tr: count_pairs(ids, part)     # waits on the host: not parked
            model = ep_bytes(routing_all, part, shape.hidden)
            for (layer, tag, mb), fn in cases.items():
                totals, stages, host_us, park_us = _events_us(fn, args.reps, park=layer != "ep_counts")
                comm = _comm_bytes(layer, rank, world, M, shape, r if tag != "none" else 0, model)
                for stage, us in [("total", totals)] + sorted(stages.items()):
                    rows.append(dict(layer=layer, lora=tag, micro_batches=mb, M_per_rank=M, tokens_layer=(
                        M * world if layer.startswith("tp") else M), stage=stage,
                        us_median=round(statistics.median(us), 2), us_p20=round(_q(us, 0.2), 2),
                        us_p80=round(_q(us, 0.8), 2), host_us=round(host_us, 1), parked=layer != "ep_counts",
                        park_us=round(park_us, 1), gpu_timed=host_us < park_us,
                        model_bytes=comm.get(stage, ""), rank=rank))
            del x, full, lora, base, cases
            torch.cuda.empty_cache()
    return rows


def _q(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _comm_bytes(layer, rank, world, M, shape, r, model) -> dict:
    """Bytes this rank sends in each collective stage, by the model."""
    if layer == "ep":
        return {"dispatch": model["dispatch"][rank], "combine": model["combine"][rank]}
    if layer.startswith("tp"):
        t = tp_bytes(M * world, shape.top_k, shape.hidden, r, world, fully_sharded=layer == "tp_fully_sharded")
        return {name: round(sent) for name, (_, sent) in t.items()}
    return {}


def trace(rank, world, args) -> list[dict]:
    """Kernel events of one prefill EP call, one and two micro-batches, this rank's GPU."""
    shape = MoEShape.from_name(args.preset)
    part = ExpertPartition(shape.num_experts, world)
    M, r = max(args.tokens), args.ranks[0]
    x, ids, wts, tl, full, _ = _setup(shape, M, rank, world, args.loras, r, args.seed)
    local = part.shard(full, rank)
    events = []
    for mb in (1, 2):
        counts = count_pairs(ids, part, micro_batches=mb)
        for _ in range(3):
            ep_layer(x, ids, wts, tl, local, part, micro_batches=mb, counts=counts, validate=False)
        dist.barrier()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            torch.cuda._sleep(PARK_CYCLES)            # the host queues the whole call first
            ep_layer(x, ids, wts, tl, local, part, micro_batches=mb, counts=counts, validate=False)
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "t.json"
            prof.export_chrome_trace(str(path))
            doc = json.loads(path.read_text())
        kept = [e for e in doc.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy")
                and not any(s in e.get("name", "") for s in ("sleep", "spin_kernel"))]
        pid = 10 * mb + rank
        label = f"GPU {rank}, {mb} micro-batch{'es' if mb > 1 else ''}"
        events.append(dict(name="process_name", ph="M", pid=pid, args=dict(name=label)))
        events.append(dict(name="process_sort_index", ph="M", pid=pid, args=dict(sort_index=pid)))
        streams = sorted({int(e.get("args", {}).get("stream", e.get("tid", 0))) for e in kept})
        for s in streams:
            events.append(dict(name="thread_name", ph="M", pid=pid, tid=s, args=dict(name=f"stream {s}")))
        for e in kept:
            events.append(dict(name=e["name"][:80], cat=e["cat"], ph="X", ts=e["ts"], dur=e["dur"], pid=pid,
                               tid=int(e.get("args", {}).get("stream", e.get("tid", 0)))))
    return events


def worker(rank, world, args) -> dict:
    torch.manual_seed(args.seed)
    out = {}
    checks = []
    for M in args.check_tokens:
        for kind, fn, extra in (("ep", ep_case, {}), ("tp_fully_sharded", tp_case, dict(fully_sharded=True)),
                                ("tp", tp_case, dict(fully_sharded=False))):
            case = default_case(preset=args.preset, tokens=[M] * world, num_loras=args.loras, rank=args.ranks[0],
                                dtype="bfloat16", device="cuda", no_adapter_fraction=0.25, **extra)
            checks.append(dict(layer=kind, M_per_rank=M, rank=rank, **fn(rank, world, case)))
    out["checks"] = checks
    out["collectives"] = [dict(row, rank=rank) for row in collectives(rank, world, args.reps)]
    out["steps"] = steps(rank, world, args)
    out["trace"] = trace(rank, world, args)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m moelora_lab.dist.bench``."""
    p = argparse.ArgumentParser(prog="python -m moelora_lab.dist.bench", description=__doc__.split("\n\n")[0],
                                epilog="Needs --world CUDA GPUs: with fewer it stops at once; on a CPU, notebook 08 "
                                       "runs both layers in gloo processes and plots the committed data.")
    p.add_argument("--world", type=int, default=2, help="processes, one per GPU (default: %(default)s)")
    p.add_argument("--preset", default="qwen3-30b-a3b", help="layer shape, a name of moelora_lab.PRESETS "
                                                            "(default: %(default)s)")
    p.add_argument("--tokens", nargs="+", type=int, default=[64, 4096],
                   help="tokens per rank of the timed cases (decode, prefill; default: %(default)s)")
    p.add_argument("--check-tokens", nargs="+", type=int, default=[16, 512],
                   help="tokens per rank of the correctness checks (default: %(default)s)")
    p.add_argument("--ranks", nargs="+", type=int, default=[16, 64], help="LoRA ranks r (default: %(default)s)")
    p.add_argument("--loras", type=int, default=4, help="adapter slots L (default: %(default)s)")
    p.add_argument("--reps", type=int, default=20, help="timed repetitions per step (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random tensors and routing (default: %(default)s)")
    p.add_argument("--out", type=Path, default=OUT, help="folder for the files (default: the committed data, "
                                                          "%(default)s)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if torch.cuda.device_count() < args.world:
        print(f"needs {args.world} CUDA GPUs (found {torch.cuda.device_count()}); on the CPU, read the committed "
              f"data under {OUT}", file=sys.stderr)
        return 2
    from moelora_lab.dist import bench          # the worker by its importable name, also when run as __main__
    results = run_local(bench.worker, args.world, args, backend="nccl", timeout_s=1800)
    kept = [a for a in (argv if argv is not None else sys.argv[1:])]
    if "--out" in kept:                       # where it was written, not how it was measured
        i = kept.index("--out")
        del kept[i:i + 2]
    command = " ".join(["python -m moelora_lab.dist.bench"] + [shlex.quote(a) for a in kept])
    prov = dict(timing.provenance(command), world=args.world, nccl=".".join(map(str, torch.cuda.nccl.version())),
                nvls=os.environ.get("NCCL_NVLS_ENABLE", "0"))
    for name in ("checks", "collectives", "steps"):
        rows = [row for res in results for row in res[name]]
        keys = list(dict.fromkeys(key for row in rows for key in row))      # ep and tp rows differ
        write_csv([dict({key: row.get(key, "") for key in keys}, **prov) for row in rows],
                  args.out / f"dist_{name}.csv")
    doc = dict(displayTimeUnit="ns", traceEvents=[e for res in results for e in res["trace"]],
               otherData=dict(producer="moelora_lab.dist.bench", **prov))
    (args.out / "dist_trace.json").write_text(json.dumps(doc))
    print(f"wrote {args.out}/dist_*.csv and dist_trace.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
