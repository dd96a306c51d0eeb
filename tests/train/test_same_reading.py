"""Two builds of a report read the same records the same way (pdmask_lab.same_reading), and
every committed ladder page is what the current code builds from the records beside it."""

import json
import shutil
from pathlib import Path

import pytest

from pdmask_lab.same_reading import main, report_files, same_reading

ROOT = Path(__file__).resolve().parents[2]


def test_equal_numbers_added_places_and_skipped_keys():
    old = {"a": 1, "b": [0.5, float("nan")], "c": {"x": 2.0, "gone": 3}, "wall": {"s": 10.0}, "flag": True}
    new = {"a": 1.0, "b": [0.5, float("nan")], "c": {"x": 2.0, "added": 4}, "wall": {"s": 99.0}, "flag": True}
    r = same_reading(old, new)
    # a, b[0], b[1] (NaN equals NaN), c.x; the wall time describes the build and is skipped; bools are not numbers
    assert (r.shared, r.differ) == (4, [])
    assert (r.only_old, r.only_new) == ([".c.gone"], [".c.added"])


def test_a_changed_number_and_a_changed_length_are_differences():
    r = same_reading({"rows": [{"p": 0.25}, {"p": 0.5}], "n": [1, 2]}, {"rows": [{"p": 0.25}, {"p": 0.5 + 1e-12}], "n": [1]})
    assert r.differ == [(".rows[1].p", 0.5, 0.5 + 1e-12), (".n (length)", 2, 1)]


def test_main_exit_status_and_lines(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    for d, v in ((a, 0.1), (b, 0.1)):
        (d / "rung").mkdir(parents=True)
        (d / "ladder.json").write_text(json.dumps({"x": v}))
        (d / "rung" / "summary.json").write_text(json.dumps({"y": 2}))
    assert report_files(a) == [Path("ladder.json"), Path("rung/summary.json")]
    assert main([str(a), str(b)]) == 0
    (b / "rung" / "summary.json").write_text(json.dumps({"y": 3}))
    assert main([str(a), str(b)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert "rung/summary.json: 1 numbers read by both, 1 differ, 0 lost; 0 places only the new build has, 0 only the old" in out
    assert "  .y: 2 -> 3" in out
    (b / "rung" / "summary.json").unlink()
    assert main([str(a), str(b)]) == 1 and f"{b / 'rung' / 'summary.json'}: missing" in capsys.readouterr().out
    shutil.rmtree(b / "rung")
    assert main([str(a), str(b)]) == 1
    assert f"rung/summary.json: missing in {b} (the rung folder rung only the old build has)" in capsys.readouterr().out
    assert main([str(a)]) == 2


#: committed ladder pages and the spec each was built with (real-rl-24steps is a historical
#: record built with another step count: not rebuilt)
COMMITTED = [("real-regime", "configs/real-regime.yaml"), ("real-regime-pilot", "configs/real-regime-pilot.yaml"),
             ("real-rl", "configs/real-ladder.yaml")]


@pytest.mark.parametrize("folder,spec", COMMITTED, ids=[c[0] for c in COMMITTED])
def test_committed_ladder_pages_rebuild_from_their_records(tmp_path, folder, spec):
    from pdmask_lab.ladder import load_spec
    from pdmask_lab.ladder_report import build_report

    src = ROOT / "docs" / "results" / folder
    work = tmp_path / folder
    shutil.copytree(src, work)
    build_report(load_spec(ROOT / spec), work, plot=False)
    for rel in report_files(src):
        r = same_reading(json.loads((src / rel).read_text()), json.loads((work / rel).read_text()))
        assert r.shared > 100 and r.differ == [], f"{folder}/{rel}: {r.differ[:5]}"
        assert (r.only_old, r.only_new) == ([], []), f"{folder}/{rel}: rebuild the page with the current code"
