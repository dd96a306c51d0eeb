"""Every default number the docs state equals the registry's (issue 42): change a default delta
in the registry and this fails until the docs agree. Read from README.md and docs/*.md:

- the family statements ("0.05 KL, 0.15 TV", "0.05 for the KL modes", "KL 0.05"), where the
  text says they are defaults (:data:`CUES` before them): KL, TV and JS are the defaults of
  ``topk_kl``, ``topk_tv`` and ``topk_js`` (and of the binary and full ones, ``FIXED_DELTAS``);
- every table with a default-delta column (a header naming delta and its default): the first
  cell's backticked modes or divergences, one number each, in order;
- "0.15 (`dppo-binary-tv`'s" and "0.15, `dppo-binary-tv`'s": that mode's default;
- the results index's reading of older records: the values frozen in ``RECORDED_BEFORE_42``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import pdmask
from pdmask.divergences import FIXED_DELTAS, default_delta
from pdmask.keys import TOPK_DIVERGENCES
from pdmask.train.loss_spec import IS_CAP_BEFORE_42, RECORDED_BEFORE_42
from tests.core.registry_checks import md_tables

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: words that make a number before "KL" / "TV" / "JS" a stated default (within the 120 characters before it)
CUES = ("default", "pdmask's (", "mode's deltas", "mode's:", "binary and full ones")
FAMILY = {"KL": "topk_kl", "TV": "topk_tv", "JS": "topk_js"}
NUM = r"(\d+\.\d+|\d+)"


def family_statements(text: str) -> list[tuple[str, float, int]]:
    """``(family, number, offset)`` of every default stated for a divergence family."""
    out = []
    for m in re.finditer(rf"(?<![\w.-]){NUM} (?:for )?(?:the )?(KL|TV|JS)\b|\b(KL|TV|JS) {NUM}(?![\w.])", text):
        if any(c in text[max(0, m.start() - 120):m.start()] for c in CUES):
            fam, num = (m.group(2), m.group(1)) if m.group(2) else (m.group(3), m.group(4))
            out.append((fam, float(num), m.start()))
    return out


def table_defaults(text: str) -> list[tuple[str, float]]:
    """``(name, number)`` of every table whose header has a default-delta column."""
    out = []
    for head, rows in md_tables(text):
        cols = [i for i, h in enumerate(head) if "delta" in h and "default" in h]
        for i in cols:
            for row in rows:
                names = re.findall(r"`([a-z0-9_-]+)`", row[0])
                nums = [float(x) for x in re.findall(r"(?<![\w.])(\d+\.\d+)", row[i].split("(")[0])]
                assert len(names) == len(nums), (head, row)
                out += list(zip(names, nums))
    return out


def default_of(name: str) -> float:
    return default_delta(name) if name in TOPK_DIVERGENCES or name in FIXED_DELTAS else pdmask.MODES[name].default_delta


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_stated_default_delta_is_the_registrys(path):
    text = path.read_text()
    for fam, num, at in family_statements(text):
        assert num == default_delta(FAMILY[fam]), (path.name, text[at - 60:at + 20])
        if fam != "JS":  # the binary and full divergences of that family share it
            assert all(v == num for k, v in FIXED_DELTAS.items() if k.endswith(fam.lower()))
    for name, num in table_defaults(text):
        assert num == default_of(name), (path.name, name)
    for m in re.finditer(rf"(?<![\w.]){NUM},? \(?`([a-z0-9-]+)`'s", text):
        assert float(m.group(1)) == pdmask.MODES[m.group(2)].default_delta, (path.name, m.group(0))


def test_the_statements_are_found():
    """The scan sees what it checks: the core page's tables and the family statements."""
    core = (ROOT / "docs" / "core.md").read_text()
    found = {name for name, _ in table_defaults(core)}
    assert {"pdm-topk-kl", "spo", "cispo", "topk_js", "pdm-smooth-topk-tv"} <= found
    assert sum(len(family_statements(p.read_text())) for p in DOCS) >= 10


def test_a_changed_default_fails_the_scan():
    """The check can fail: a stated 0.05 for KL read against a registry whose KL default is 0.04."""
    assert family_statements("(defaults: 0.05 for KL, 0.15 for TV)") == [("KL", 0.05, 11), ("TV", 0.15, 24)]
    assert table_defaults("| mode | delta (default) |\n|---|---|\n| `pdm-topk-kl` | 0.04 |\n") == [("pdm-topk-kl", 0.04)]
    assert 0.04 != default_of("pdm-topk-kl")


def test_the_results_index_reads_old_records_as_frozen():
    """docs/results/README.md states how an older record's null reads: RECORDED_BEFORE_42's values."""
    text = (ROOT / "docs" / "results" / "README.md").read_text()
    para = text[text.index("## How the records read"):]
    para = para[:para.index("\n## ", 5)]
    parts = re.split(r"(?<![\w.])(\d+\.\d+) for ", para[:para.index("a `null` IS cap")])
    stated = {}
    for num, seg in zip(parts[1::2], parts[2::2]):
        for name in re.findall(r"`([a-z0-9-]+)`", seg.split(";")[0]):
            stated[name] = float(num)
    assert stated == {m: v[2] for m, v in RECORDED_BEFORE_42.items()}
    assert f"a `null` IS cap is {IS_CAP_BEFORE_42:g}" in para


def test_every_mode_list_in_the_docs_names_every_mode():
    """The README's modes table names every registered core mode, and docs/verl.md's loss tables
    every loss the verl plugin registers (its base name; the estimator variants as ``+ _aggregated``)."""
    from pdmask.integrations.verl.losses import loss_name, verl_modes
    from tests.core.registry_checks import core_modes

    readme = (ROOT / "README.md").read_text()
    table = next(rows for head, rows in md_tables(readme) if head[:2] == ["mode", "out of region"])
    listed = {n for row in table for n in re.findall(r"`([a-z0-9-]+)`", row[0])}
    assert set(core_modes()) <= listed, set(core_modes()) - listed
    verl = (ROOT / "docs" / "verl.md").read_text()
    names = {n for head, rows in md_tables(verl) if head[0] == "loss_mode" for row in rows
             for n in re.findall(r"`(pdmask_[a-z0-9_]+)`", row[0])}
    assert {loss_name(m) for m in verl_modes()} <= names, {loss_name(m) for m in verl_modes()} - names
