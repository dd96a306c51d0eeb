"""docs/trl.md's Python blocks run as written (in the TRL environment), and its recipe for a
mask that acts on a CPU does make it act."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="needs the trl extra: pip install -e '.[trl]' (run .ci/trl.sh)")

DOC = Path(__file__).resolve().parents[2] / "docs" / "trl.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)


def test_doc_has_python_blocks():
    assert BLOCKS, "docs/trl.md has no python block"


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_doc_python_block_runs(i, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the snippet writes under out/
    ns = {"__name__": "__doc__"}
    exec(compile(BLOCKS[i], f"{DOC}:python block {i + 1}", "exec"), ns)
    if "kept" in ns:  # the runnable snippet: its CPU recipe must make the mask act
        kept = ns["kept"]
        assert len(kept) == 4 and kept[0] == 1.0, kept
        assert min(kept) < 1.0, f"the mask never acted: {kept}"
