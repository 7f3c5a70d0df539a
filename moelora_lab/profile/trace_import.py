"""Read Chrome trace-event files (this lab's, Perfetto's, chrome://tracing's, ``torch.profiler``'s) back
into layer timelines: ``load_trace_events``. ``profile.trace_events`` writes them and re-exports it.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, H hidden, I intermediate, P = M*k pairs.
"""
from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

from .profiler import PREFIX, kineto_cases

PRODUCER = "moelora_lab.profile.trace_events"      # the writer's name in the files it writes
THREADS = {"main": (1, "main stream"), "lora": (2, "side stream")}
LANE_OF_THREAD = {name: lane for lane, (_, name) in THREADS.items()}
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")   # torch.profiler's device activity


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _read(path: Path) -> tuple[list, dict]:
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    try:
        text = raw.decode("utf-8")
        try:
            doc = json.loads(text)
        except json.JSONDecodeError:
            if not text.lstrip().startswith("["):
                raise
            doc = json.loads(text.rstrip().rstrip(",") + "]")     # the array form may omit its closing ]
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not JSON ({exc}); expected a Chrome trace-event file") from None
    if isinstance(doc, list):
        return doc, {}
    if isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list):
        other = doc.get("otherData")
        return doc["traceEvents"], other if isinstance(other, dict) else {}
    raise ValueError(f"{path}: not a trace-event file; expected an array of events or an object with 'traceEvents'")


def _key(v):
    """A pid or tid as a dict key (ints and strings as they are; anything else as its JSON text)."""
    return v if isinstance(v, (int, str)) and not isinstance(v, bool) else json.dumps(v)


def _lane(e: dict, threads: dict) -> str:
    """Our lane if the file is ours, else the CUDA stream (torch.profiler's args.stream), else the thread."""
    args = e.get("args") if isinstance(e.get("args"), dict) else {}
    thread = threads.get((_key(e.get("pid")), _key(e.get("tid"))))
    if isinstance(args.get("lane"), str):
        return args["lane"]
    if thread in LANE_OF_THREAD:
        return LANE_OF_THREAD[thread]
    if _is_number(args.get("stream")):
        return f"stream {args['stream']}"
    return str(thread).strip() if thread is not None else f"tid {e.get('tid')}"


def _rename_lanes(records: list, lanes) -> dict:
    """new -> old lane names: ``lanes`` itself, or for "auto" a trace with one or two lanes and none
    called main or lora gets "main" for the lane that starts first and "lora" for the other."""
    found = list(dict.fromkeys(r["stream"] for r in records))
    if lanes is None or isinstance(lanes, dict):
        return {new: old for old, new in (lanes or {}).items() if old in found}
    if {"main", "lora"} & set(found) or len(found) > 2:
        return {}
    return dict(zip(("main", "lora"), found))


def load_trace_events(path, *, categories="auto", lanes="auto", details: bool = False) -> dict:
    """Read a trace-event file into {case: {"meta", "records"}}, one case per process with kept events.

    Complete events ("ph": "X") become records (stream, name, start_us = ts, end_us = ts + dur, file
    time, sorted by start); others are skipped. categories: "auto" keeps torch.profiler's device activity
    (cat kernel, gpu_memcpy, gpu_memset) if the file has any, else all; None: all; or the cats to keep.
    stream: args.lane or the thread names "main stream" / "side stream" (this module's files), else
    "stream N" from args.stream (torch.profiler), else the thread name, else "tid N". lanes: "auto"
    renames a case's one or two lanes, if neither is main or lora, to "main" (first to start) and
    "lora", noted in meta["lanes"] (new -> old); a dict old -> new; None: as read. details: records
    also carry cat and args. meta: as exported by this module, else source file, pid and labels.
    A ``torch.profiler`` trace of the layer run with ``profile.profiler.Annotator`` (its stages marked)
    is read by stage instead: one record per stage and stream, each kernel tied to its stage (see
    ``profile.profiler.kineto_cases``), and the kernels under "kernels".
    """
    if not (lanes in (None, "auto") or isinstance(lanes, dict)):
        raise TypeError(f"lanes: expected 'auto', None or a dict old name -> new name, got {lanes!r}")
    if not (categories in (None, "auto") or isinstance(categories, (str, list, tuple, set, frozenset))):
        raise TypeError(f"categories: expected 'auto', None, a cat or a collection of cats, got {categories!r}")
    path = Path(path)
    events, other = _read(path)
    if any(isinstance(e, dict) and e.get("cat") == "gpu_user_annotation" and str(e.get("name", "")).startswith(
            PREFIX + ":") for e in events):
        cases = kineto_cases(events)
        if cases:
            return {f"{path.stem} pid {pid}" if len(cases) > 1 else path.stem:
                    dict(meta=dict(source=path.name, pid=pid, profiler="torch.profiler"), **case)
                    for pid, case in cases.items()}
    procs, labels, threads = {}, {}, {}
    for e in events:
        if not (isinstance(e, dict) and e.get("ph") == "M" and isinstance(e.get("args"), dict)):
            continue
        pid, args = _key(e.get("pid")), e["args"]
        if e.get("name") == "process_name" and "name" in args:
            procs[pid] = args["name"]
        elif e.get("name") == "process_labels" and "labels" in args:
            labels[pid] = args["labels"]
        elif e.get("name") == "thread_name" and "name" in args:
            threads[(pid, _key(e.get("tid")))] = args["name"]
    complete = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]
    if not complete:
        raise ValueError(f"{path}: no complete events ('ph': 'X') among its {len(events)} events; only those are read")
    if categories == "auto":
        categories = GPU_CATEGORIES if any(e.get("cat") in GPU_CATEGORIES for e in complete) else None
    keep = None if categories is None else {categories} if isinstance(categories, str) else set(categories)
    by_pid: dict = {}
    for i, e in enumerate(complete):
        if keep is not None and e.get("cat") not in keep:
            continue
        if not (_is_number(e.get("ts")) and _is_number(e.get("dur")) and e["dur"] >= 0):
            raise ValueError(f"{path}: complete event {i} ({e.get('name')!r}) needs numbers ts and dur >= 0, got "
                             f"ts={e.get('ts')!r}, dur={e.get('dur')!r}")
        rec = dict(stream=_lane(e, threads), name=str(e.get("name", "")), start_us=e["ts"],
                   end_us=round(e["ts"] + e["dur"], 6))
        extra = {"cat": e.get("cat"), "args": e.get("args", {})} if details else {}
        by_pid.setdefault(_key(e.get("pid")), []).append(rec | extra)
    if not by_pid:
        raise ValueError(f"{path}: no complete event has a category in {sorted(keep)}; pass categories=None to "
                         "read them all")
    ours = other.get("producer") == PRODUCER and isinstance(other.get("cases"), dict)
    traces = {}
    for pid, records in by_pid.items():
        records.sort(key=lambda r: r["start_us"])
        name = str(procs.get(pid, f"pid {pid}"))
        if ours and name in other["cases"]:
            meta = dict(other["cases"][name])
        else:
            name = f"{name} ({labels[pid]})" if pid in labels else name
            meta = dict(source=path.name, pid=pid, **({"labels": labels[pid]} if pid in labels else {}))
        renamed = _rename_lanes(records, lanes)
        if renamed:
            back = {old: new for new, old in renamed.items()}
            records = [r | {"stream": back.get(r["stream"], r["stream"])} for r in records]
            meta["lanes"] = renamed
        traces[name if name not in traces else f"{name} #{pid}"] = dict(meta=meta, records=records)
    return traces
