"""``python -m pdmask_lab.same_reading`` on damaged report folders (issue 41, causes 1 and 2):
a missing, empty, truncated, binary or wrong-type report file on either side gives one line
naming the file and exit 1, never a traceback; a number the new build reads as null, a string
or an object is counted as lost and fails; a rung folder only one build has is named."""

import json
import subprocess
import sys

import pytest

from pdmask_lab.same_reading import main, same_reading

LADDER = {"rows": [{"mode": "grpo", "final": 0.5, "n": 4}], "wall": {"s": 1.0}}
SUMMARY = {"final": {"mean": 0.25, "ci": [0.1, 0.4]}}


def _build(root, ladder=LADDER, summary=SUMMARY, rungs=("mb4",)):
    root.mkdir(parents=True, exist_ok=True)
    (root / "ladder.json").write_text(json.dumps(ladder))
    for r in rungs:
        (root / r).mkdir(exist_ok=True)
        (root / r / "summary.json").write_text(json.dumps(summary))
    return root


DAMAGE = {
    "missing": None,
    "empty": b"",
    "blank": b"  \n",
    "truncated": b'{"rows": [{"mode": "grpo", "fin',
    "binary": b"\x89PNG\r\n\x1a\n\x00\xff\xfe",
    "a list": b"[1, 2]",
    "a number": b"3",
    "null": b"null",
    "a string": b'"x"',
}


@pytest.mark.parametrize("side", ["old", "new"])
@pytest.mark.parametrize("rel", ["ladder.json", "mb4/summary.json"])
@pytest.mark.parametrize("damage", list(DAMAGE), ids=list(DAMAGE))
def test_a_damaged_report_file_gives_one_line_naming_it(tmp_path, capsys, side, rel, damage):
    dirs = {"old": _build(tmp_path / "old"), "new": _build(tmp_path / "new")}
    target = dirs[side] / rel
    if DAMAGE[damage] is None:
        target.unlink()
    else:
        target.write_bytes(DAMAGE[damage])
    if (side, rel, damage) == ("old", "mb4/summary.json", "missing"):
        # the rung's summary gone from OLD leaves the rung folder only NEW has a summary in
        assert main([str(dirs["old"]), str(dirs["new"])]) == 0
        assert "mb4/summary.json: only in" in capsys.readouterr().out
        return
    assert main([str(dirs["old"]), str(dirs["new"])]) == 1
    lines = [ln for ln in capsys.readouterr().out.splitlines() if str(target) in ln]
    assert len(lines) == 1, lines


def test_the_module_never_tracebacks_on_a_damaged_file(tmp_path):
    old, new = _build(tmp_path / "old"), _build(tmp_path / "new")
    (new / "ladder.json").write_bytes(b'{"rows": [')
    p = subprocess.run([sys.executable, "-m", "pdmask_lab.same_reading", str(old), str(new)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "Traceback" not in p.stderr + p.stdout
    assert f"{new / 'ladder.json'}: not valid JSON" in p.stdout


def test_a_folder_that_is_not_one_is_a_usage_error(tmp_path, capsys):
    old = _build(tmp_path / "old")
    assert main([str(old), str(tmp_path / "nope")]) == 2
    assert "NEW_DIR" in capsys.readouterr().err


@pytest.mark.parametrize("became", [None, "0.5", {"mean": 0.5}, [0.5], True], ids=["null", "string", "object", "list", "bool"])
def test_a_number_that_became_something_else_is_lost_and_fails(tmp_path, capsys, became):
    r = same_reading({"a": 0.5, "b": 1}, {"a": became, "b": 1})
    assert (r.shared, r.differ, [(p, old) for p, old, _ in r.lost]) == (1, [], [(".a", 0.5)])
    old = _build(tmp_path / "old")
    new = _build(tmp_path / "new", summary={"final": {"mean": became, "ci": [0.1, 0.4]}})
    assert main([str(old), str(new)]) == 1
    out = capsys.readouterr().out
    assert "mb4/summary.json: 2 numbers read by both, 0 differ, 1 lost" in out
    assert "  lost .final.mean: 0.25 -> " in out


def test_numbers_below_a_place_that_changed_kind_are_lost(tmp_path):
    r = same_reading({"ci": [0.1, 0.4], "rows": {"x": 1}}, {"ci": "n/a", "rows": [1]})
    assert [p for p, _, _ in r.lost] == [".ci", ".rows"]
    # a number where the old build had none is a place only the new build has, not a loss
    r = same_reading({"ci": None, "s": "x"}, {"ci": 0.3, "s": "y"})
    assert (r.lost, r.only_new, r.shared) == ([], [".ci"], 0)


def test_rung_folders_in_only_one_build_are_named(tmp_path, capsys):
    old = _build(tmp_path / "old", rungs=("mb4", "mb8"))
    new = _build(tmp_path / "new", rungs=("mb4", "mb16"))
    assert main([str(old), str(new)]) == 1  # mb8 only in OLD: its summary is missing in NEW
    out = capsys.readouterr().out
    assert f"mb8/summary.json: missing in {new} (the rung folder mb8 only the old build has)" in out
    assert f"mb16/summary.json: only in {new} (the rung mb16 only the new build has; not compared)" in out
    (new / "mb8").mkdir()
    (new / "mb8" / "summary.json").write_text(json.dumps(SUMMARY))
    assert main([str(old), str(new)]) == 0  # a rung only NEW has is named, not a failure
