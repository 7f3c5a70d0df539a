"""Layer timelines as Chrome trace-event JSON (Perfetto, chrome://tracing), and any such file back.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, H hidden, I intermediate, P = M*k pairs.

Written as ``{"displayTimeUnit": "ns", "traceEvents": [...], "otherData": {...}}`` (no other top-level
keys: some readers stop at unknown ones). One process (pid) per case, named after it, with M, r,
schedule and LoRA path as its labels; one thread (tid) per CUDA stream the schedule used: "main
stream", and "side stream" for a row of ``layer.SCHEDULES`` on two streams (the others run every stage on
the main stream).
One complete event ("ph": "X") per stage: ts and dur in µs, cat the stage's kind, args lane (the
tracer's "main" or "lora"), kernel, bytes, bytes_read, bytes_written, achieved_GBps, tiles (see
``timeline.stage_model``). otherData: producer, models, SM count, shared provenance, every case's meta.
:func:`load_trace_events` (``profile.trace_import``, re-exported here) reads any trace-event file
(object or array form, plain or gzip: this module's, Perfetto's, chrome://tracing's,
``torch.profiler``'s ``export_chrome_trace``).

``python -m moelora_lab.profile.trace_events TRACES.json OUT_DIR [--combined]`` writes
OUT_DIR/<case>.trace.json per case, or with --combined all cases in OUT_DIR/<TRACES stem>.trace.json.
"""
from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from ..layer.table import SCHEDULES
from .timeline import H200_SMS, STAGE_KINDS, achieved_gbps, stage_model
from .trace_import import PRODUCER, THREADS, _is_number, load_trace_events

__all__ = ["check_trace_events", "export_trace_files", "load_trace_events", "save_trace_events", "to_trace_events"]

ONE_STREAM = tuple(name for name, row in SCHEDULES.items() if row.one_stream)   # every stage on the main stream
PROVENANCE = ("gpu", "torch", "triton", "python", "date", "code", "command")
METADATA = ("process_name", "process_labels", "process_sort_index", "thread_name", "thread_sort_index")
TRAFFIC = ("kernel", "bytes", "bytes_read", "bytes_written")


def _cases(traces, name: str | None) -> dict:
    """{case: {"meta", "records"}} from one case or from a mapping case -> case, checked."""
    if not isinstance(traces, dict) or not traces:
        raise TypeError(f"traces: expected a case {{'meta', 'records'}} or a non-empty dict of them, got "
                        f"{traces!r:.80}")
    if isinstance(traces.get("records"), list) and isinstance(traces.get("meta"), dict):
        keys = [traces["meta"].get(k) for k in ("preset", "M", "rank", "schedule")]
        traces = {name or ("{}_M{}_r{}_{}".format(*keys) if None not in keys else "trace"): traces}
    for case, t in traces.items():
        if not isinstance(t, dict) or not isinstance(t.get("meta"), dict) or not isinstance(t.get("records"), list) \
                or not t["records"]:
            raise ValueError(f"traces: case {case!r} lacks a dict 'meta' or a non-empty list of 'records'")
        for i, r in enumerate(t["records"]):
            if not isinstance(r, dict) or not {"stream", "name", "start_us", "end_us"} <= set(r):
                raise ValueError(f"traces: case {case!r} record {i} is not a dict with stream, name, start_us, end_us")
            if not (_is_number(r["start_us"]) and _is_number(r["end_us"]) and r["end_us"] >= r["start_us"]):
                raise ValueError(f"traces: case {case!r} record {i} ({r['name']!r}) needs numbers start_us <= end_us, "
                                 f"got {r['start_us']!r}, {r['end_us']!r}")
    return traces


def _threads(meta: dict, records: list) -> dict:
    """lane -> (tid, thread name): one thread per CUDA stream the run used."""
    lanes = list(dict.fromkeys(r["stream"] for r in records))
    spans = sorted((r["start_us"], r["end_us"]) for r in records)
    serial = all(b[0] >= a[1] for a, b in zip(spans, spans[1:]))      # one track must not overlap itself
    if meta.get("schedule") in ONE_STREAM and serial:
        return {lane: THREADS["main"] for lane in lanes}
    tids = iter(range(len(THREADS) + 1, len(THREADS) + 1 + len(lanes)))
    return {lane: THREADS.get(lane) or (next(tids), str(lane)) for lane in lanes}


def _metadata(kind: str, pid, tid, name: str) -> list[dict]:
    """The name and sort index of a process (kind "process", sorted by pid) or a thread (by tid)."""
    return [dict(ph="M", name=f"{kind}_name", pid=pid, tid=tid, args={"name": name}),
            dict(ph="M", name=f"{kind}_sort_index", pid=pid, tid=tid, args={"sort_index": tid or pid})]


def to_trace_events(traces, *, name: str | None = None, model: bool = True, sms: int = H200_SMS) -> dict:
    """Chrome trace-event JSON (a dict, see the module doc) of one case ``{"meta", "records"}`` or of a
    dict case name -> case (``layer_traces.json``; one process each). ``name``: the case name of a lone
    case (default from its meta). ``model=False`` leaves out bytes and tiles (traces whose meta is not a
    benchmark's); ``sms``: the SM count the LoRA tile rule assumes.
    """
    cases = _cases(traces, name)
    events, metas = [], {}
    for pid, (case, t) in enumerate(cases.items(), start=1):
        meta, records = t["meta"], t["records"]
        try:
            stages = stage_model(meta, sms=sms) if model else {}
        except ValueError as exc:
            raise ValueError(f"traces: case {case!r}: {exc}; pass model=False to export without bytes and "
                             "tiles") from None
        labels = ", ".join(f"{k}={meta[k]}" for k in ("M", "rank", "schedule", "lora_path") if k in meta)
        events += _metadata("process", pid, 0, case)
        events += [dict(ph="M", name="process_labels", pid=pid, tid=0, args={"labels": labels})] if labels else []
        threads = _threads(meta, records)
        for tid, thread in sorted(set(threads.values())):
            events += _metadata("thread", pid, tid, thread)
        for r in records:
            dur = round(r["end_us"] - r["start_us"], 6)
            args = {"lane": r["stream"]}
            if r["name"] in stages:
                s = stages[r["name"]]
                args.update({k: s[k] for k in TRAFFIC}, achieved_GBps=achieved_gbps(s["bytes"], dur), tiles=s["tiles"])
                args = {k: v for k, v in args.items() if v not in (None, {})}
            events.append(dict(ph="X", name=r["name"], cat=STAGE_KINDS.get(r["name"], "stage"), ts=r["start_us"],
                               dur=dur, pid=pid, tid=threads[r["stream"]][0], args=args))
        metas[case] = meta
    first = next(iter(metas.values()))
    other = {"producer": PRODUCER, "time_unit": "microseconds (ts, dur)"}
    other |= {k: first[k] for k in PROVENANCE if k in first and all(m.get(k) == first[k] for m in metas.values())}
    if model:
        other |= {"sms": sms, "bytes": "moelora_lab.profile.traffic.layer_traffic, lower bound of HBM bytes",
                  "tiles": "moelora_lab.op.dispatch.gpu_config, moelora_lab.base_moe.gpu_gemm_tiles"}
    return {"displayTimeUnit": "ns", "traceEvents": events, "otherData": other | {"cases": metas}}


def check_trace_events(doc) -> int:
    """Check ``doc`` (object or array form) against the trace-event format as this module writes it:
    every complete event has a string name, ts and dur numbers >= 0, pid and tid ints or strings,
    dict args; every pid and (pid, tid) used is named by process_name / thread_name metadata.
    Returns the number of complete events; raises ValueError listing the first problems."""
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise ValueError("trace events: expected a JSON array of events or an object with a 'traceEvents' array")
    problems, used, named = [], set(), set()
    for i, e in enumerate(events):
        if not isinstance(e, dict) or not isinstance(e.get("ph"), str):
            problems.append(f"event {i} is not an object with a string 'ph'")
            continue
        ids = [e.get("pid"), e.get("tid")]
        if not all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in ids):
            problems.append(f"event {i} ({e['ph']}): pid and tid must be ints or strings, got {ids}")
        elif e["ph"] == "X":
            bad = [k for k in ("ts", "dur") if not (_is_number(e.get(k)) and e[k] >= 0)]
            bad += ["name"] if not isinstance(e.get("name"), str) else []
            bad += ["args"] if not isinstance(e.get("args", {}), dict) else []
            problems += [f"event {i} (X): bad or missing {', '.join(bad)}"] if bad else []
            used |= {(ids[0], None), tuple(ids)}
        elif e["ph"] == "M":
            if e.get("name") not in METADATA or not isinstance(e.get("args"), dict):
                problems.append(f"event {i} (M): expected one of {', '.join(METADATA)} with dict args")
            elif e["name"] in ("process_name", "thread_name"):
                named.add((ids[0], None) if e["name"] == "process_name" else tuple(ids))
    problems += [f"pid {pid} has no process_name" if tid is None else f"pid {pid} tid {tid} has no thread_name"
                 for pid, tid in sorted(used - named, key=str)]
    if isinstance(doc, dict) and doc.get("displayTimeUnit", "ms") not in ("ms", "ns"):
        problems.append(f"displayTimeUnit must be 'ms' or 'ns', got {doc['displayTimeUnit']!r}")
    if problems:
        raise ValueError("trace events: " + "; ".join(problems[:5]) + (" ..." if len(problems) > 5 else ""))
    if not used:
        raise ValueError("trace events: no complete events ('ph': 'X')")
    return sum(1 for e in events if e["ph"] == "X")


def save_trace_events(path, traces, **kwargs) -> Path:
    """Write ``traces`` (a case, a dict of cases, or a trace-event dict) as trace-event JSON to ``path``
    (gzip when it ends in .gz: Perfetto opens both); ``kwargs`` go to :func:`to_trace_events`."""
    doc = traces if isinstance(traces, dict) and "traceEvents" in traces else to_trace_events(traces, **kwargs)
    check_trace_events(doc)
    path = Path(path)
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    path.write_bytes(gzip.compress(text.encode()) if path.suffix == ".gz" else text.encode())
    return path


def export_trace_files(traces: dict, out_dir, *, combined: bool = False, stem: str = "layer_traces",
                       sms: int = H200_SMS) -> list[Path]:
    """Write ``traces`` (case -> {"meta", "records"}) as OUT_DIR/<case>.trace.json, one file per case, or
    with ``combined`` as OUT_DIR/<stem>.trace.json, one process per case; returns the paths."""
    cases = _cases(traces, None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if combined:
        return [save_trace_events(out / f"{stem}.trace.json", cases, sms=sms)]
    return [save_trace_events(out / f"{case}.trace.json", {case: t}, sms=sms) for case, t in cases.items()]


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m moelora_lab.profile.trace_events`` (runs on a CPU)."""
    p = argparse.ArgumentParser(prog="python -m moelora_lab.profile.trace_events", description="Write layer "
                                "timelines as Chrome trace-event JSON for Perfetto or chrome://tracing.")
    p.add_argument("traces", type=Path, help="layer timelines, e.g. moelora_lab/data/h200/layer_traces.json")
    p.add_argument("out_dir", type=Path, help="folder for the trace files (created if missing)")
    p.add_argument("--combined", action="store_true", help="one file, <traces stem>.trace.json, every case a process")
    p.add_argument("--sms", type=int, default=H200_SMS, help="SMs for the LoRA tile rule (default %(default)s: H200)")
    return p


def main(argv=None) -> list[Path]:
    p = build_parser()
    args = p.parse_args(argv)
    if args.sms < 1:
        p.error(f"--sms: expected a positive SM count, got {args.sms}")
    try:
        traces = json.loads(args.traces.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        p.error(f"traces: cannot read {args.traces} as JSON ({exc})")
    paths = export_trace_files(traces, args.out_dir, combined=args.combined, stem=args.traces.stem, sms=args.sms)
    print(f"wrote {len(paths)} trace file(s) to {args.out_dir}; open them in Perfetto or chrome://tracing")
    return paths


if __name__ == "__main__":
    main()
