"""``python -m moelora_lab.bench dram``: what the LoRA op's kernels move to and from DRAM, by the GPU's counters.

The byte model (``profile.traffic``) counts the bytes a path must move at least; the timing sweep
divides them by the time. This step reads what the kernels do move: the sweep runs again as a child
process under Nsight Compute (``ncu``), which replays each kernel with the caches flushed before it
(as the timing flushes L2) and the clocks left alone, and reads its DRAM bytes read and written, its
L2 traffic, its duration and its SM clock. A 1 GiB copy by an elementwise kernel is read the same way, so
every kernel's DRAM rate stands next to the copy's under the same profiler.

Two ratios split the gap between a path and the copy rate:

* ``dram_over_model``: the DRAM bytes over the model's bytes (above 1: re-reads that L2 did not hold);
  ``read_over_model`` the same for reads alone (L2 writes back: output rows still in L2 when the kernel
  ends reach DRAM after it, uncounted, so writes alone can fall short of the model);
* ``rate_share``: the DRAM rate while the kernels ran over the copy's (below 1: time spent not streaming:
  latency, launch and tail, too few bytes in flight).

``model_share`` (the model's bytes over the time, over the copy rate) is their product. ``waves`` (the grid
over the programs all SMs hold at once) and ``occupancy`` (the share of an SM's warps they hold, by the
launch's limits) come from ncu's launch statistics; like ``sm_mhz`` they are averaged over a case's
kernels weighted by each one's duration.

Each case is built and checked against the reference exactly as ``bench kernels`` builds it
(``kernels_sweep.build_case``) before it is measured. Rows: one per (case, path).

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, K in, N out, S slices.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from glob import glob
from pathlib import Path

import torch

from ..config import MoEShape, random_lora_weights
from ..profile import timing
from ..profile.traffic import lora_op_traffic
from .common import device, progress, seeded_generator, sweep_parser
from .kernels_sweep import build_case
from .ncu import ncu_command, parse_ncu_csv

NAME = "dram"
COPY_BYTES = 1 << 30      # the reference copy: 1 GiB read and 1 GiB written
PATHS = ("auto", "one_shot", "two_kernel")


def add_parser(sub):
    d = sweep_parser(sub, NAME, "the LoRA op's DRAM bytes and rate by hardware counters (needs ncu)",
                     name="lora_dram", tokens=(512, 2048, 8192), ranks=(16, 64))
    d.add_argument("--ops", nargs="+", choices=["w13", "w2"], default=["w13", "w2"],
                   help="projections: w13 (gate and up), w2 (down) (default: both)")
    d.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS), help="LoRA paths to count (default: all)")
    d.add_argument("--ncu", default=None, help="the ncu executable (default: on PATH, else under /opt/nvidia)")
    d.add_argument("--from-report", type=Path, default=None,
                   help="parse a saved <name>_report.json again instead of measuring (no GPU needed)")
    d.add_argument("--inner", type=Path, default=None, help=argparse.SUPPRESS)   # the child under ncu
    d.set_defaults(tune=False, small_batch_max_tokens=0)     # what build_case reads: default tiles, no per-pair path


def find_ncu(explicit: str | None = None) -> str:
    """The ncu executable: ``explicit``, else ``ncu`` on PATH, else the newest under /opt/nvidia or CUDA's bin."""
    if explicit:
        if shutil.which(explicit) is None:
            raise FileNotFoundError(f"--ncu: {explicit!r} is not an executable; give the path of Nsight Compute's ncu")
        return explicit
    found = shutil.which("ncu") or next(iter(sorted(glob("/opt/nvidia/nsight-compute/*/ncu"), reverse=True)), None)
    found = found or shutil.which("ncu", path="/usr/local/cuda/bin")
    if found is None:
        raise FileNotFoundError("ncu (Nsight Compute) was not found on PATH or under /opt/nvidia/nsight-compute; "
                                "install it or pass --ncu PATH")
    return found


def _cases(args):
    """(meta, the call) for every case and path, each case built and checked when reached."""
    dtype = getattr(torch, args.dtype)
    gen = seeded_generator(args.seed)
    for preset in args.presets:
        shape = MoEShape.from_name(preset)
        for rank in args.ranks:
            for op in args.ops:
                lora_a, lora_b = random_lora_weights(shape, op, args.loras, rank, gen, dtype)
                k_in, n_out, S = lora_a[0].shape[3], lora_b[0].shape[2], len(lora_a)
                for M in args.tokens:
                    runs, work, inputs = build_case(shape, op, rank, M, lora_a, lora_b, args, gen, dtype)
                    for path, real, cfg, fn in runs:
                        traffic = lora_op_traffic(real, work, in_features=k_in, out_features=n_out, num_slices=S,
                                                  rank=rank, x_rows="token" if op == "w13" else "pair",
                                                  dtype_bytes=inputs["x"].element_size(), add_inputs=True)
                        meta = dict(preset=preset, op=op, M=M, rank=rank, loras=args.loras, dtype=args.dtype,
                                    path=path, ran=real, block_m=cfg.block_m, block_n=cfg.block_n,
                                    n_chunks=cfg.n_chunks, model_bytes=traffic.bytes,
                                    model_read_bytes=traffic.bytes_read)
                        yield meta, fn
                    del runs, inputs
                del lora_a, lora_b


def run_inner(args) -> None:
    """The child under ncu: each case once inside its own profiled range, named by an NVTX range (ncu
    names the kernels after it); the copy first. The cases' meta go to ``args.inner`` as JSON."""
    cuda = device() == "cuda"
    seen = []

    def measured(name, fn):
        fn()                                                  # compiled and warm outside the profiled range
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            torch.cuda.nvtx.range_push(name)
        fn()
        if cuda:
            torch.cuda.nvtx.range_pop()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()

    copy_bytes = COPY_BYTES if cuda else 1 << 20                      # on the CPU (tests) a token copy
    src = torch.empty(copy_bytes // 2, dtype=torch.bfloat16, device=device())
    dst = torch.empty_like(src)
    measured("copy", lambda: torch.mul(src, 1, out=dst))     # a kernel (a plain copy_ is a DMA ncu cannot see)
    del src, dst
    for meta, fn in progress(_cases(args), desc="dram", unit="run"):
        measured(f"c{len(seen)}", fn)                          # rows_from finds case i by this name
        seen.append(meta)
    Path(args.inner).write_text(json.dumps(seen))


def child_argv(args, cases_path: Path) -> list[str]:
    """The arguments of the child that runs the cases under ncu."""
    argv = [NAME, "--inner", str(cases_path), "--presets", *args.presets, "--tokens", *map(str, args.tokens),
            "--ranks", *map(str, args.ranks), "--ops", *args.ops, "--paths", *args.paths,
            "--loras", str(args.loras), "--dtype", args.dtype, "--seed", str(args.seed)]
    return [sys.executable, "-m", "moelora_lab.bench", *argv]


def rows_from(kernels: list[dict], cases: list[dict], prov: dict) -> list[dict]:
    """One row per case: its kernels' counters summed, set against the model and the copy."""
    by_name: dict[str, list[dict]] = {}
    for k in kernels:
        by_name.setdefault(k["range"], []).append(k)
    if "copy" not in by_name:
        raise RuntimeError("ncu reported no kernel of the reference copy: was the run profiled at all?")
    copy = by_name["copy"]
    copy_bytes = sum(k["dram_read_bytes"] + k["dram_write_bytes"] for k in copy)
    copy_tbps = copy_bytes / sum(k["duration_ns"] for k in copy) / 1e3          # bytes per ns / 1e3 = TB/s
    with_limits = all("occupancy" in k for k in copy)
    copy_occupancy = round(sum(k["occupancy"] for k in copy) / len(copy), 3) if with_limits else ""
    rows = []
    for i, meta in enumerate(cases):
        ks = by_name.get(f"c{i}")
        if not ks:
            raise RuntimeError(f"ncu reported no kernel for case c{i} ({meta}): the profiled ranges and the "
                               "cases do not line up")
        ns = sum(k["duration_ns"] for k in ks)
        read, write = sum(k["dram_read_bytes"] for k in ks), sum(k["dram_write_bytes"] for k in ks)
        tbps = (read + write) / ns / 1e3
        rows.append(dict(
            **meta, kernels=len(ks), grids=";".join(str(k["grid"]) for k in ks), duration_us=round(ns / 1e3, 2),
            dram_read_bytes=int(read), dram_write_bytes=int(write), l2_bytes=int(sum(k["l2_bytes"] for k in ks)),
            dram_over_model=round((read + write) / meta["model_bytes"], 4), dram_tbps=round(tbps, 4),
            read_over_model=round(read / meta["model_read_bytes"], 4) if "model_read_bytes" in meta else "",
            copy_dram_tbps=round(copy_tbps, 4), copy_occupancy=copy_occupancy, rate_share=round(tbps / copy_tbps, 4),
            model_share=round(meta["model_bytes"] / ns / 1e3 / copy_tbps, 4),
            sm_mhz=round(sum(k["sm_hz"] * k["duration_ns"] for k in ks) / ns / 1e6),
            **{c: round(sum(k[c] * k["duration_ns"] for k in ks) / ns, 3) if all(c in k for k in ks) else ""
               for c in ("waves", "occupancy")}, **prov))
    return rows


def rows_from_report(report: dict) -> list[dict]:
    """The rows of a saved report ({prov, cases, ncu: the raw ncu CSV}), parsed again."""
    return rows_from(parse_ncu_csv(report["ncu"]), report["cases"], report["prov"])


def run(args) -> list[dict]:
    if args.inner is not None:
        run_inner(args)
        raise SystemExit(0)                                   # the parent writes the CSV
    if args.from_report is not None:
        return rows_from_report(json.loads(Path(args.from_report).read_text()))
    ncu = find_ncu(args.ncu)
    prov = timing.provenance(args.command)
    with tempfile.TemporaryDirectory() as tmp:
        log, cases_path = Path(tmp) / "ncu.csv", Path(tmp) / "cases.json"
        cmd = ncu_command(ncu, log) + child_argv(args, cases_path)
        print("running the cases under", ncu, file=sys.stderr)
        done = subprocess.run(cmd, text=True, stdout=subprocess.PIPE, stderr=None)
        if done.returncode != 0 or not cases_path.exists():
            raise RuntimeError(f"the run under ncu failed (exit {done.returncode}); its report ends:\n"
                               f"{log.read_text()[-3000:] if log.exists() else '(none)'}")
        report = dict(prov=prov, cases=json.loads(cases_path.read_text()), ncu=log.read_text())
    saved = Path(args.out) / f"{args.name}_report.json"
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(report))
    print(f"wrote {saved} (the raw counters: --from-report parses it again)", file=sys.stderr)
    return rows_from_report(report)
