"""Every ``pdmask.<...>`` and ``pdmask_lab.<...>`` name the method and architecture pages point
at exists, so that the formula -> code hop of docs/METHOD.md never lands on a renamed function."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
NAME = re.compile(r"`(pdmask(?:_lab)?(?:\.\w+)+)")  # the library's names and the lab's


def resolve(dotted: str):
    """Import the longest module prefix of ``dotted`` and walk the rest as attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name and not ".".join(parts[:i]).startswith(e.name):
                raise  # a dependency of an existing module is missing: not a doc error
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def names_in(page: str) -> list[str]:
    return sorted(set(NAME.findall((DOCS / page).read_text())))


@pytest.mark.parametrize("page", ["METHOD.md", "ARCHITECTURE.md"])
def test_every_named_object_exists(page):
    names = names_in(page)
    assert len(names) >= 10  # the page does name code
    missing = []
    for n in names:
        try:
            resolve(n)
        except (ImportError, AttributeError):
            missing.append(n)
    assert missing == []


def test_resolve_fails_on_a_wrong_name():
    with pytest.raises(AttributeError):
        resolve("pdmask.divergences.ratio_direction")
    assert resolve("pdmask.divergences.log_ratio") is importlib.import_module("pdmask.divergences").log_ratio
