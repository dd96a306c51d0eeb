"""Damaged run records under ``pdmask ladder`` (issue 30, causes 3 and 4): a cell's own
``config.yaml`` or ``metrics.jsonl`` that cannot be read is one line naming the file (the
ladder and ``--plan``, exit 2); the same damage in a ``--prefix-of`` source is a
``not taking <cell>: ...`` line naming the file, and the cell runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

pytest.importorskip("transformers", reason="the ladder needs the 'train' extra")

from pdmask_lab.ladder import load_spec, plan_cells  # noqa: E402

from .test_cli_config import one_line_error  # noqa: E402

# what a damaged file holds, and the words the line must carry besides its path
DAMAGE = {
    "config not YAML": ("config.yaml", b"steps: [1,\n", "not valid YAML at line 2"),
    "config a YAML list": ("config.yaml", b"- steps\n- lr\n", "holds a list, not a mapping"),
    "config not UTF-8": ("config.yaml", b"steps: 2\n\xff\xfe\n", "cannot read"),
    "summary truncated": ("summary.json", b'{"run": ', "not valid JSON (Expecting value: line 1 column 9"),
    "summary a list": ("summary.json", b"[1, 2]", "holds a list, not a JSON object"),
    "metrics random bytes": ("metrics.jsonl", os.urandom(4096) + b"\xff", "not a JSON-lines file"),
}


def _spec(tmp_path, smoke):
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump({
        "name": "tiny", "config": str(smoke), "modes": ["none"], "seeds": 1,
        "set": {"steps": 2, "eval_every": 1, "checkpoint_every": 1, "tensorboard": False},
        "rungs": [{"name": "calm", "set": {"engine_precision": "fp32"}}]}))
    return p


def _finished_run(d, cfg, steps):
    """The three records of a finished ``steps``-step run of ``cfg`` (an evaluation each step)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.yaml").write_text(yaml.safe_dump({**cfg.to_dict(), "steps": steps}, sort_keys=False))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "eval_accuracy": 0.5, "wall_s": float(s)}) + "\n"
                                             for s in range(steps + 1)))
    (d / "summary.json").write_text(json.dumps({"sft_eval_accuracy": 0.5}))


def _cell(spec_path, out):
    cells = plan_cells(load_spec(spec_path), out)
    assert len(cells) == 1
    return cells[0]


# ---------------------------------------------------------------- the ladder's own cell
OWN = [k for k in DAMAGE if not k.startswith("summary")]  # a cell's summary.json is not read to plan


@pytest.mark.parametrize("plan", [False, True], ids=["ladder", "plan"])
@pytest.mark.parametrize("damage", OWN)
def test_a_damaged_record_of_a_cell_is_one_line_naming_it(damage, plan, tmp_path, smoke, cli_run, monkeypatch):
    from pdmask_lab import ladder

    monkeypatch.setattr(ladder, "_run_cells", lambda *a, **k: pytest.fail("a cell ran"))
    spec = _spec(tmp_path, smoke)
    out = tmp_path / "out"
    cell = _cell(spec, out)
    _finished_run(cell.cfg.run_dir, cell.cfg, 2)
    name, data, words = DAMAGE[damage]
    (cell.cfg.run_dir / name).write_bytes(data)
    code, stdout, err = cli_run(["ladder", "--spec", spec, "--out", out, *(["--plan"] if plan else [])])
    one_line_error(code, stdout, err, f"out: cell {cell.key}", str(cell.cfg.run_dir / name), words)


# ---------------------------------------------------------------- a --prefix-of source
@pytest.fixture
def prefix_ladder(tmp_path, smoke, monkeypatch):
    """A ladder (one cell, 2 steps) and a prefix source ladder whose cell finished 4 steps of
    the same config; running cells and building the report are recorded, not done."""
    from pdmask_lab import compare, ladder, ladder_report  # noqa: F401
    from pdmask.train import grpo, sft  # noqa: F401

    # grpo and compare bind ensure_sft_checkpoint at import: imported above, before the patch,
    # they keep the real one for the tests after this one
    ran = []
    monkeypatch.setattr(ladder, "_run_cells", lambda todo, *a, **k: ran.extend((c.key, st) for c, st in todo))
    monkeypatch.setattr(sft, "ensure_sft_checkpoint", lambda *a, **k: None)
    monkeypatch.setattr(ladder_report, "build_report", lambda *a, **k: None)
    spec = _spec(tmp_path, smoke)
    cell = _cell(spec, tmp_path / "out")
    src = tmp_path / "long" / "calm" / cell.cfg.run_name
    _finished_run(src, cell.cfg, 4)
    return spec, cell, src, ran


def test_an_intact_prefix_source_is_taken(prefix_ladder, tmp_path, cli_run):
    """The control: the source built here does stand in, so the damaged ones below are refused
    for their damage alone."""
    spec, cell, src, ran = prefix_ladder
    code, out, err = cli_run(["ladder", "--spec", spec, "--out", tmp_path / "out", "--prefix-of", tmp_path / "long"])
    assert code == 0, err
    assert f"took {cell.key}: the first 2 of the 4 steps of {src}\n" in out
    assert ran == []  # nothing left to run
    # Recorded relative to the run's own directory (no machine path in a record), and it resolves to the source.
    recorded = json.loads((cell.cfg.run_dir / "summary.json").read_text())["prefix_of"]["run"]
    assert not Path(recorded).is_absolute()
    assert (cell.cfg.run_dir / recorded).resolve() == src.resolve()


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_prefix_source_is_not_taken_naming_the_file_and_the_cell_runs(damage, prefix_ladder, tmp_path,
                                                                                 cli_run):
    spec, cell, src, ran = prefix_ladder
    name, data, words = DAMAGE[damage]
    (src / name).write_bytes(data)
    code, out, err = cli_run(["ladder", "--spec", spec, "--out", tmp_path / "out", "--prefix-of", tmp_path / "long"])
    assert code == 0, err
    assert "Traceback" not in out + err and err.strip() == ""
    said = [ln for ln in out.splitlines() if ln.startswith("not taking")]
    assert len(said) == 1, out
    line = said[0]
    for needle in (f"not taking {cell.key}: prefix_of: {src / name}", words):
        assert needle in line, (needle, line)
    assert ran == [(cell.key, "todo")]  # the cell runs from scratch
    assert not (cell.cfg.run_dir / "metrics.jsonl").exists()


def test_a_cell_whose_prefix_source_is_damaged_really_runs(tmp_path, smoke, smoke_cache, cli_run):
    """No mock: the refused source leaves nothing in the cell, which trains to the end."""
    from pdmask_lab.ladder import cell_status

    spec = _spec(tmp_path, smoke)
    out = tmp_path / "out"
    cell = _cell(spec, out)
    src = tmp_path / "long" / "calm" / cell.cfg.run_name
    _finished_run(src, cell.cfg, 4)
    (src / "summary.json").write_bytes(b'{"run": ')
    code, stdout, err = cli_run(["ladder", "--spec", spec, "--out", out, "--prefix-of", tmp_path / "long",
                                 f"cache_dir={smoke_cache}"])
    assert code == 0, err
    assert f"not taking {cell.key}: prefix_of: {src / 'summary.json'}: not valid JSON" in stdout
    assert cell_status(cell) == "done"  # cache_dir changes no result: the cell planned without it is this run
    summary = json.loads((cell.cfg.run_dir / "summary.json").read_text())
    assert "prefix_of" not in summary and summary["steps"] == 2
