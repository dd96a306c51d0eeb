"""Do two builds of a report read the same records the same way?

A sweep runs for days from a worktree pinned at one commit while the code moves on; its
report is rebuilt by the final code. This compares two such builds of one report folder
(``ladder.json`` and every rung's ``summary.json``): every number found at the same place in
both must be equal. Places only one build has (a column the final code added) are counted,
not compared; the run environment and the wall-clock fields are skipped (they describe the
build, not the records).

A number the old build has that the new build reads as something else (null, a string, an
object, a list, a bool) is *lost*: it is counted and fails the comparison, since a lost number
is what this check exists to catch. A number at a place where the old build had a non-number
counts as a place only the new build has. A rung folder only one build has is named: one only
the old build has fails (its summary is missing in NEW), one only the new build has is reported
and does not fail (the final code may run more rungs than the pinned one).

    python -m pdmask_lab.same_reading OLD_DIR NEW_DIR

Exit status 0 when nothing differs and nothing is lost, 1 otherwise (a file missing,
unreadable or not a JSON object, one line naming it; a number that differs or is lost), 2 for
a usage error or a folder that is not one; one line per file, then the differences.
Naive equivalent: flatten both JSON trees to ``{path: number}`` and compare the shared keys.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

#: top-level keys that describe the build, not the records
SKIPPED = ("wall", "environment", "runs_environments", "plot", "command")


@dataclass
class Reading:
    """The comparison of one file: numbers compared, differences (path, old, new), and the
    paths only one build has."""
    shared: int = 0
    differ: list[tuple[str, float, float]] = field(default_factory=list)
    only_old: list[str] = field(default_factory=list)
    only_new: list[str] = field(default_factory=list)
    #: (path, the old value, the new value) where the old build had a number (or numbers
    #: below it) and the new build has something of another kind
    lost: list[tuple[str, object, object]] = field(default_factory=list)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _kind(x) -> str:
    """dict, list, number or other (null, string, bool): pairs of one kind are compared."""
    return "dict" if isinstance(x, dict) else "list" if isinstance(x, list) else "number" if _is_number(x) else "other"


def _numbers_in(x) -> int:
    if isinstance(x, dict):
        return sum(_numbers_in(v) for v in x.values())
    if isinstance(x, list):
        return sum(_numbers_in(v) for v in x)
    return int(_is_number(x))


def _short(x) -> object:
    """A value as the report prints it: containers by their kind and size, not in full."""
    if isinstance(x, dict):
        return f"<object of {len(x)} keys>"
    if isinstance(x, list):
        return f"<list of {len(x)}>"
    return x


def _walk(a, b, path: str, r: Reading) -> None:
    if _kind(a) != _kind(b):
        if _numbers_in(a):
            r.lost.append((path, _short(a), _short(b)))
        elif _numbers_in(b):
            r.only_new.append(path)
    elif isinstance(a, dict) and isinstance(b, dict):
        for k in [*a, *(k for k in b if k not in a)]:  # the old build's order, then the new places
            if k not in b:
                r.only_old.append(f"{path}.{k}")
            elif k not in a:
                r.only_new.append(f"{path}.{k}")
            else:
                _walk(a[k], b[k], f"{path}.{k}", r)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            r.differ.append((f"{path} (length)", len(a), len(b)))
        for i, (x, y) in enumerate(zip(a, b)):
            _walk(x, y, f"{path}[{i}]", r)
    elif _is_number(a) and _is_number(b):
        r.shared += 1
        if a != b and not (math.isnan(a) and math.isnan(b)):
            r.differ.append((path, a, b))


def same_reading(old: dict, new: dict) -> Reading:
    """Compare two builds of one JSON report (see the module docstring)."""
    r = Reading()
    _walk({k: v for k, v in old.items() if k not in SKIPPED}, {k: v for k, v in new.items() if k not in SKIPPED},
          "", r)
    return r


class Unreadable(Exception):
    """A report file that cannot be compared; the message is the one line that names it."""


def load_report(path: Path) -> dict:
    """One report file as a JSON object, or :class:`Unreadable` saying why not (missing,
    empty, not text, not JSON (truncated?), or JSON of another type)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise Unreadable(f"{path}: missing") from None
    except OSError as e:
        raise Unreadable(f"{path}: cannot be read ({e.strerror or type(e).__name__})") from None
    if not raw.strip():
        raise Unreadable(f"{path}: empty")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise Unreadable(f"{path}: not a text file (binary?)") from None
    except (json.JSONDecodeError, RecursionError) as e:
        where = f" at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        raise Unreadable(f"{path}: not valid JSON{where} (truncated?)") from None
    if not isinstance(data, dict):
        raise Unreadable(f"{path}: a JSON {type(data).__name__ if data is not None else 'null'}, "
                         "not the JSON object a report holds")
    return data


def report_files(folder: Path) -> list[Path]:
    """The JSON files of a ladder report folder, relative to it."""
    return [Path("ladder.json")] + sorted(p.relative_to(folder) for p in folder.glob("*/summary.json"))


def _compare_file(old: Path, new: Path, rel: Path) -> int:
    """Print one file's comparison; 1 when it fails (unreadable, a number differs or is lost)."""
    try:
        r = same_reading(load_report(old / rel), load_report(new / rel))
    except Unreadable as e:
        print(e)  # the line names the file with its folder: which build it belongs to
        return 1
    print(f"{rel}: {r.shared} numbers read by both, {len(r.differ)} differ, {len(r.lost)} lost; "
          f"{len(r.only_new)} places only the new build has, {len(r.only_old)} only the old")
    for d in r.differ[:20]:
        print(f"  {d[0]}: {d[1]!r} -> {d[2]!r}")
    for d in r.lost[:20]:
        print(f"  lost {d[0] or '(top)'}: {d[1]!r} -> {d[2]!r}")
    return int(bool(r.differ or r.lost))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m pdmask_lab.same_reading OLD_DIR NEW_DIR", file=sys.stderr)
        return 2
    old, new = map(Path, argv)
    for side, d in (("OLD_DIR", old), ("NEW_DIR", new)):
        if not d.is_dir():
            print(f"{side} {d}: not a folder", file=sys.stderr)
            return 2
    bad = 0
    files = report_files(old)
    for rel in files:
        if rel != Path("ladder.json") and not (new / rel.parent).is_dir():
            print(f"{rel}: missing in {new} (the rung folder {rel.parent} only the old build has)")
            bad += 1
            continue
        bad += _compare_file(old, new, rel)
    for rel in sorted(set(report_files(new)) - set(files)):
        print(f"{rel}: only in {new} (the rung {rel.parent} only the new build has; not compared)")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
