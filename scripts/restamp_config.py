"""Carry the committed data set over to a wider data fingerprint, where that is provably the same rules.

    python scripts/restamp_config.py --old 62f0b3f691f8 --unseen NAME [NAME ...] [--absent-ok NAME ...] [--write]

When ``results.config_fingerprint`` starts to hash a rule it did not see before, every data file's ``config``
column names the old fingerprint although nothing it measured changed. This script proves that, file by file:
for each code commit a file names, it reads that commit's source (``git show``) and finds the rules the old
fingerprint did not see (``--unseen``); each must be defined there with today's value. A rule not defined at
that commit at all is refused unless listed in ``--absent-ok`` (a rule that came later with the code it steers:
say in the data README why it does not touch the file). Only then, with ``--write``, the file's ``config``
becomes today's fingerprint. Rules the old fingerprint did see need no check: an equal stamp means equal outputs
over its grid. Run from the repository root, in a clone with the history.
"""
from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def values_at(sha: str, names: list[str]) -> dict[str, object]:
    """name -> the literal value its module-level definition had at commit ``sha`` (absent names left out)."""
    found: dict[str, object] = {}
    for path in git("ls-tree", "-r", "--name-only", sha, "moelora_lab").split():
        if not path.endswith(".py"):
            continue
        for node in ast.parse(git("show", f"{sha}:{path}")).body:
            target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
            name = getattr(target, "id", "").lstrip("_")
            if name in names and getattr(node, "value", None) is not None:
                try:
                    value = ast.literal_eval(node.value)
                except ValueError:
                    continue
                if name in found and found[name] != value:
                    raise SystemExit(f"{sha}: {name} is defined twice, as {found[name]!r} and {value!r}")
                found[name] = value
    return found


def stamped_files(data_dir: Path, old: str) -> dict[Path, set[str]]:
    """Data files carrying the old stamp -> the code commits they name."""
    from moelora_lab.results import read_csv
    files: dict[Path, set[str]] = {}
    for path in sorted(data_dir.glob("*.csv")):
        rows = read_csv(path)
        if rows and rows[0].get("config") == old:
            files[path] = {str(r["code"]).removesuffix("-dirty") for r in rows}
    for path in sorted(data_dir.glob("*.json")):
        text = path.read_text()
        if f'"config": "{old}"' in text:
            files[path] = set(re.findall(r'"code": "(\w+?)(?:-dirty)?"', text))
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="the fingerprint the files carry")
    parser.add_argument("--unseen", nargs="+", required=True, help="rules the old fingerprint did not hash")
    parser.add_argument("--absent-ok", nargs="*", default=[], help="rules allowed to be undefined at a commit")
    parser.add_argument("--data", type=Path, default=ROOT / "moelora_lab" / "data" / "h200")
    parser.add_argument("--write", action="store_true", help="restamp the files (default: check only)")
    args = parser.parse_args()
    from moelora_lab import rules
    from moelora_lab.results import config_fingerprint
    new = config_fingerprint()
    today = {name: getattr(rules, name) for name in args.unseen}
    files, bad, cache = stamped_files(args.data, args.old), [], {}
    for path, shas in files.items():
        for sha in sorted(shas):
            then = cache.setdefault(sha, values_at(sha, args.unseen))
            for name, value in today.items():
                if name not in then and name not in args.absent_ok:
                    bad.append(f"{path.name} (code {sha}): {name} is not defined there")
                elif name in then and then[name] != value:
                    bad.append(f"{path.name} (code {sha}): {name} was {then[name]!r}, today {value!r}")
        print(f"{path.name}: code {', '.join(sorted(shas))}: {'differs' if any(path.name in b for b in bad) else 'same rules'}")
    if bad:
        print("not restamped:\n  " + "\n  ".join(bad))
        return 1
    if args.write:
        for path in files:
            text = path.read_text()
            if path.suffix == ".json":
                text = text.replace(f'"config": "{args.old}"', f'"config": "{new}"')
            else:
                text = re.sub(rf"(?<=,){args.old}(?=,|\r?$)", new, text, flags=re.M)
            path.write_text(text)
        print(f"{len(files)} file(s): config {args.old} -> {new}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
