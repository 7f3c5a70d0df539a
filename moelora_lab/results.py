"""Committed GPU measurements: where they live, what produced them, and whether they still fit the code.

Every row a benchmark writes carries its provenance (``gpu``, ``torch``, ``triton``, ``python``,
``date``, ``command``) and a stamp of the code that produced it:

* ``schema``: :data:`DATA_SCHEMA`, raised whenever a file's columns or their meaning change;
* ``config``: :func:`config_fingerprint`, a hash of the tile tables and dispatch rules (what
  ``path="auto"``, the tile rules and the layer's schedule rule return over a fixed grid of
  shapes), so a change of any rule makes every file measured under the old one stale;
* ``code``: the commit the data was measured with (:func:`code_version`).

:func:`load` refuses a file whose schema or config differs from the code's, naming the file and
the command that regenerates the whole set (:data:`REGENERATE`). A set remeasured less often than
the rules change (the two-GPU set) may be loaded with ``accept_older_rules=True`` and shown with the
label :func:`older_rules` gives it.

Shape legend: M tokens, E experts, k top-k, L adapters, r rank, K in, N out, S slices.
"""
from __future__ import annotations

import csv
import hashlib
import json
import os
import subprocess
from pathlib import Path

DATA_SCHEMA = 3
DATA_DIR = Path(__file__).parent / "data" / "h200"
HISTORY_DIR = DATA_DIR.parent / "history"   # earlier runs kept for a before/after comparison (older rules)
GPU_DIRS = (DATA_DIR, DATA_DIR.parent / "h100")   # the one-GPU data sets, the H200's first (``load_first``)
REGENERATE = "bash scripts/gpu_data.sh"     # on a CUDA machine, from the repository root
_FINGERPRINT_SMS = 132                      # the rules are fingerprinted for an H200's SM count
# Tile walks: files that time a fixed set of tiles around the rule of their day. Whoever reads one
# recomputes today's rule and says whether the walk timed it (plots.design.lora_rule_table's
# `rule_in_data`), so a walk measured under older rules is still evidence: it is loaded with that
# label (older_rules) instead of refused.
WALKS = ("lora_tune",)


class StaleDataError(RuntimeError):
    """A data file was produced by an older schema or tile configuration than the code expects."""


def _rule_table() -> list:
    """What every tile and dispatch rule returns over a fixed grid of shapes (the input of the hash)."""
    from . import rules
    from .op.dispatch import choose_path, choose_side_path, gpu_config
    from .layer.plan import gpu_schedule
    from .base_moe import gpu_gemm_tiles
    from .layer.streams import SIDE_PRIORITIES

    pairs = [1, 2, 8, 12, 16, 17, 24, 32, 64, 128, 192, 256, 512, 1024, 4096, 8192, 65536]
    ranks = [None, 8, 16, 32, 64, 128, 192, 256, 512]
    # every rule's value (rules.py), then what the rule functions return over the grid
    table: list = [sorted((name, repr(value)) for name, value in vars(rules).items()
                          if name.isupper() and not name.startswith("_")), SIDE_PRIORITIES[0]]
    table.append([gpu_schedule(p, e, in_k_columns=c) for p in pairs for e in (8, 64, 128) for c in (None, 32, 64, 256)])
    for p in pairs:
        for groups in (1, 8, 64, 512):
            table.append([choose_path(p, groups, 4, r or 16, n_out) for r in ranks for n_out in (None, 768, 2048)])
            table.append([choose_side_path(p, groups, 4, r or 16, n_out) for r in ranks for n_out in (None, 768, 2048)])
            for path in ("one_shot", "two_kernel", "small_batch"):
                for n_out, slices in ((768, 2), (2048, 1), (1408, 2)):
                    table.append([repr(gpu_config(path, p, groups, n_out, slices, _FINGERPRINT_SMS, rank=r))
                                  for r in ranks])
            for n_out, slices in ((768, 2), (2048, 1)):
                table.append([repr(gpu_config("one_shot", p, groups, n_out, slices, _FINGERPRINT_SMS, rank=r,
                                              side_stream=True)) for r in ranks])
    for per_expert in (0.5, 1, 2, 3, 8, 16, 17, 32, 33, 96, 97, 512):
        table.append([gpu_gemm_tiles(per_expert, lora=lora) for lora in (False, True)])
    return table


def config_fingerprint() -> str:
    """12 hex digits that change whenever a tile table or dispatch rule returns something else."""
    return hashlib.sha256(repr(_rule_table()).encode()).hexdigest()[:12]


def code_version() -> str:
    """The commit the code came from: ``$MOELORA_CODE_VERSION`` if set, else ``git rev-parse``
    (``-dirty`` with uncommitted changes), else ``unknown``."""
    if os.environ.get("MOELORA_CODE_VERSION"):
        return os.environ["MOELORA_CODE_VERSION"]
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "moelora_lab"],
                               cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def stamp() -> dict:
    """The three version columns every data row carries."""
    return dict(schema=DATA_SCHEMA, config=config_fingerprint(), code=code_version())


def _convert(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def read_csv(path) -> list[dict]:
    """Rows of a benchmark CSV with numbers converted back to int/float (no version check)."""
    with open(path, newline="") as f:
        return [{k: _convert(v) for k, v in row.items()} for row in csv.DictReader(f)]


def write_csv(rows: list[dict], path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def check_current(rows: list[dict], source, *, accept_older_rules: bool = False) -> list[dict]:
    """``rows`` unchanged if every one carries the current schema and config (only the schema with
    ``accept_older_rules``: the caller labels them, :func:`older_rules`); else StaleDataError."""
    if not rows:
        raise StaleDataError(f"{source}: no rows; regenerate the data with `{REGENERATE}`")
    want = (DATA_SCHEMA, config_fingerprint())
    found = sorted({(r.get("schema", "none"), want[1] if accept_older_rules else r.get("config", "none"))
                    for r in rows}, key=str)
    if found != [want]:
        got = ", ".join(f"schema {s} / config {c}" for s, c in found)
        raise StaleDataError(
            f"{source} was produced by other code ({got}) than this checkout expects (schema {want[0]} / "
            f"config {want[1]}): its numbers describe kernels or tile rules that no longer exist. "
            f"Regenerate the data on a CUDA GPU with `{REGENERATE}`, or check out the commit it names "
            f"(code {sorted({str(r.get('code', '?')) for r in rows})})")
    return rows


def older_rules(rows: list[dict]) -> str | None:
    """None if ``rows`` were measured under this checkout's rules (config), else a sentence saying
    under which they were (for a set shown with that label instead of refused)."""
    found, current = sorted({str(r.get("config", "none")) for r in rows}), config_fingerprint()
    if found == [current]:
        return None
    codes = sorted({str(r.get("code", "?")) for r in rows})
    return (f"measured under older tile and schedule rules (config {', '.join(found)}, code {', '.join(codes)}) than "
            f"this checkout's (config {current}): a stage whose kernels or schedule a rule picks may run "
            "differently now")


def load(name: str, data_dir=None, *, accept_older_rules: bool = False) -> list[dict]:
    """The committed rows of ``<data_dir>/<name>.csv`` (default :data:`DATA_DIR`), checked to fit the
    current code.

    ``accept_older_rules=True`` still refuses another schema (the columns' meaning), but returns rows
    measured under other rules; the caller must then say so (:func:`older_rules`). Meant for a set
    that is remeasured less often than the rules change (the two-GPU set, a tile walk)."""
    path = Path(DATA_DIR if data_dir is None else data_dir) / f"{name}.csv"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; regenerate the data on a CUDA GPU with `{REGENERATE}`")
    return check_current(read_csv(path), path.name, accept_older_rules=accept_older_rules)


def load_first(name: str, *, accept_older_rules: bool = False) -> list[dict]:
    """The committed rows of ``<name>.csv`` from the first folder of :data:`GPU_DIRS` that holds it (the H200's,
    else another GPU's: ``label`` names the GPU), checked as :func:`load` checks them; FileNotFoundError where
    none does."""
    for folder in GPU_DIRS:
        if (folder / f"{name}.csv").exists():
            return load(name, folder, accept_older_rules=accept_older_rules)
    raise FileNotFoundError(f"{name}.csv is in none of {', '.join(d.name for d in GPU_DIRS)}; regenerate the data on "
                            f"a CUDA GPU with `{REGENERATE}`")


def load_traces(name: str = "layer_traces", data_dir=None) -> dict:
    """The committed layer timelines (case name -> meta, records, metrics), checked to fit the code
    (``data_dir``: default :data:`DATA_DIR`)."""
    path = Path(DATA_DIR if data_dir is None else data_dir) / f"{name}.json"
    traces = json.loads(path.read_text())
    for case, t in traces.items():
        if "records" not in t or "meta" not in t:
            raise ValueError(f"{path}: case {case!r} lacks 'meta' or 'records'")
    check_current([t["meta"] for t in traces.values()], path.name)
    return traces


def label(row) -> str:
    """One line of provenance for a figure or a table: GPU, software, date and code version. Given a list
    of rows (a file whose cases ran in more than one run), the distinct dates and codes, joined."""
    rows = row if isinstance(row, (list, tuple)) else [row]
    missing = sorted({k for r in rows for k in ("gpu", "torch", "triton", "date") if k not in r})
    if missing or not rows:
        raise KeyError(f"row: provenance field(s) {', '.join(missing) or 'all'} missing; expected a row of a "
                       "committed CSV or the 'meta' of a committed trace")

    def joined(key):
        return " + ".join(dict.fromkeys(str(r.get(key, "?")) for r in rows))

    return f"{joined('gpu')}, torch {joined('torch')}, triton {joined('triton')}, {joined('date')}, code {joined('code')}"
