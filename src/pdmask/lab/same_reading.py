"""Do two builds of a report read the same records the same way?

A sweep runs for days from a worktree pinned at one commit while the code moves on; its
report is rebuilt by the final code. This compares two such builds of one report folder
(``ladder.json`` and every rung's ``summary.json``): every number found at the same place in
both must be equal. Places only one build has (a column the final code added) are counted,
not compared; the run environment and the wall-clock fields are skipped (they describe the
build, not the records).

    python -m pdmask.lab.same_reading OLD_DIR NEW_DIR

Exit status 0 when nothing differs, 1 otherwise; one line per file, then the differences.
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


def _walk(a, b, path: str, r: Reading) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
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
    elif isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        r.shared += 1
        if a != b and not (math.isnan(a) and math.isnan(b)):
            r.differ.append((path, a, b))


def same_reading(old: dict, new: dict) -> Reading:
    """Compare two builds of one JSON report (see the module docstring)."""
    r = Reading()
    _walk({k: v for k, v in old.items() if k not in SKIPPED}, {k: v for k, v in new.items() if k not in SKIPPED},
          "", r)
    return r


def report_files(folder: Path) -> list[Path]:
    """The JSON files of a ladder report folder, relative to it."""
    return [Path("ladder.json")] + sorted(p.relative_to(folder) for p in folder.glob("*/summary.json"))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m pdmask.lab.same_reading OLD_DIR NEW_DIR", file=sys.stderr)
        return 2
    old, new = map(Path, argv)
    bad = 0
    for rel in report_files(old):
        if not (new / rel).is_file():
            print(f"{rel}: missing in {new}")
            bad += 1
            continue
        r = same_reading(json.loads((old / rel).read_text()), json.loads((new / rel).read_text()))
        print(f"{rel}: {r.shared} numbers read by both, {len(r.differ)} differ; "
              f"{len(r.only_new)} places only the new build has, {len(r.only_old)} only the old")
        for d in r.differ[:20]:
            print(f"  {d[0]}: {d[1]!r} -> {d[2]!r}")
        bad += bool(r.differ)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
