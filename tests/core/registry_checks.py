"""What the three registries (top-K divergences, surrogates, modes) require of an addition besides
its registration: its oracle test and its row in docs/core.md. Each function returns what is
missing, so that a test can assert "nothing" for the library and "exactly the new names" for a
scripted addition (tests/core/test_core_budget.py)."""

from __future__ import annotations

import re
from pathlib import Path

from pdmask.keys import TOPK_DIVERGENCES
from pdmask.masks import MODES
from pdmask.surrogates import SURROGATES

DOCS = Path(__file__).resolve().parents[2] / "docs"
CORE_MD = DOCS / "core.md"
#: the table of docs/core.md each registry's rows live in: the header of its first column
DOC_TABLES = {"divergence": "divergence", "surrogate": "surrogate", "mode": "mode"}


def core_modes() -> list[str]:
    """The registered modes restated here: all but those that read caller-supplied tensors (the
    lab's batch modes, restated in tests/batchmask)."""
    return [name for name, m in MODES.items() if not m.extras]


def md_tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every markdown table of ``text``: (header cells, rows of cells)."""
    out, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[-| :]+\|$", lines[i + 1]):
            head = _cells(lines[i])
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            out.append((head, rows))
        else:
            i += 1
    return out


def _cells(line: str) -> list[str]:
    # a cell may hold `|x|` inside backticks: split on bars outside backticks
    cells, cur, tick = [], "", False
    for ch in line.strip().strip("|"):
        if ch == "`":
            tick = not tick
        if ch == "|" and not tick:
            cells.append(cur.strip())
            cur = ""
        else:
            cur += ch
    cells.append(cur.strip())
    return cells


def doc_rows(kind: str, text: str | None = None) -> dict[str, list[str]]:
    """``{name: row}`` of the docs/core.md table of ``kind`` (its first cell's backticked name)."""
    text = CORE_MD.read_text() if text is None else text
    rows = {}
    for head, body in md_tables(text):
        if head and head[0] == DOC_TABLES[kind]:
            for row in body:
                for name in re.findall(r"`([^`]+)`", row[0]):
                    rows[name] = row
    return rows


def registered() -> dict[str, set[str]]:
    return {"divergence": set(TOPK_DIVERGENCES), "surrogate": set(SURROGATES), "mode": set(core_modes())}


def missing_doc_rows() -> dict[str, set[str]]:
    """Registered names without their row in docs/core.md, by registry (empty sets dropped)."""
    out = {kind: names - set(doc_rows(kind)) for kind, names in registered().items()}
    return {k: v for k, v in out.items() if v}


def missing_oracles() -> dict[str, set[str]]:
    """Registered names without their oracle test, by registry (empty sets dropped)."""
    from .helpers import TOPK_ORACLES
    from .test_registries import MODE_ORACLES, SURROGATE_ORACLES

    have = {"divergence": set(TOPK_ORACLES), "surrogate": set(SURROGATE_ORACLES), "mode": set(MODE_ORACLES)}
    out = {kind: names - have[kind] for kind, names in registered().items()}
    return {k: v for k, v in out.items() if v}
