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
    if "kept" in ns:  # the runnable snippet: its CPU recipe must make the mask act, as the page says
        kept = ns["kept"]
        assert len(kept) == 4 and kept[0] == kept[2] == 1.0, kept  # the generating steps are on-policy
        assert kept[3] < 0.5, f"the mask did not act on the second pass after an update: {kept}"
        zero_std = [h["frac_reward_zero_std"] for h in ns["trainer"].state.log_history if "frac_reward_zero_std" in h]
        assert zero_std == [1.0, 0.0] and kept[1] == 1.0, (zero_std, kept)  # step 1: no spread, no update


def test_the_stated_default_deltas_are_the_registrys():
    """The configuration table states the default thresholds; they live in pdmask.MODES."""
    import pdmask
    from pdmask.integrations.trl import options

    assert "mode's: 0.05 for the KL modes, 0.15 for the TV modes" in DOC.read_text()
    stated = {"kl": 0.05, "tv": 0.15}
    checked = 0
    for name in options.accepted_modes():
        kind = name.rsplit("-", 1)[-1]
        if kind in stated and pdmask.MODES[name].surrogate != "ppo-clip":
            assert pdmask.MODES[name].default_delta == stated[kind], name
            checked += 1
    assert checked >= 6
