"""The live display of ``compare`` / ``ladder --jobs N`` (pdmask_lab.live): each running run's
step i of n, last reward and ETA, read from its metrics.jsonl as the trainer appends to it."""

import io
import json

from rich.console import Console

from pdmask_lab.live import RunsProgress, Watched, last_record


def _append(run_dir, *recs):
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "a") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")


def test_last_record_skips_a_half_written_line(tmp_path):
    assert last_record(tmp_path / "metrics.jsonl") is None  # not there yet
    _append(tmp_path, {"step": 0, "eval_accuracy": 0.1}, {"step": 1, "reward": 0.5, "wall_s": 2.0})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "rew')  # the trainer is writing the next record
    assert last_record(tmp_path / "metrics.jsonl") == {"step": 1, "reward": 0.5, "wall_s": 2.0}


def test_eta_is_the_runs_own_pace_times_the_steps_left(tmp_path):
    d = tmp_path / "run"
    w = Watched("run", d, 10, tmp_path / "run.log")
    assert w.step0 == 0 and w.state() == {"step": 0, "reward": None, "eval": None, "eta_s": None}
    _append(d, {"step": 0, "eval_accuracy": 0.2}, {"step": 1, "reward": 0.25, "wall_s": 3.0},
            {"step": 2, "reward": 0.5, "wall_s": 8.0})
    s = w.state()
    assert s["step"] == 2 and s["reward"] == 0.5
    assert s["eta_s"] == 8.0 / 2 * 8  # 4 s a step, 8 steps left
    assert w.line() == "run step 2/10 reward 0.500 ETA 32s"
    # a resumed run: its pace counts from the step it was at when started here (wall_s restarts)
    r = tmp_path / "resumed"
    _append(r, {"step": 0}, {"step": 6, "reward": 0.1, "wall_s": 60.0})
    w2 = Watched("resumed", r, 10, tmp_path / "resumed.log")
    assert w2.step0 == 6 and w2.state()["eta_s"] is None  # nothing done here yet
    _append(r, {"step": 7, "reward": 0.2, "wall_s": 5.0, "eval_accuracy": 0.4})
    assert w2.state()["eta_s"] == 5.0 * 3
    assert w2.line() == "resumed step 7/10 reward 0.200 eval 0.400 ETA 15s"


def test_plain_lines_off_a_terminal(tmp_path):
    buf = io.StringIO()
    con = Console(file=buf, force_terminal=False, width=300)
    with RunsProgress(con, 3, every=0.0) as p:
        p.started("a", tmp_path / "a", 4, tmp_path / "a.log")
        p.started("b", tmp_path / "b", 4, tmp_path / "b.log")
        _append(tmp_path / "a", {"step": 1, "reward": 1.0, "wall_s": 2.0})
        p.refresh()
        p.finished("b")
    out = buf.getvalue()
    assert f"started a (log: {tmp_path / 'a.log'})" in out
    assert "progress: 0 of 3 runs finished, 2 running, 1 waiting | a step 1/4 reward 1.000 ETA 6s | b step 0/4" in out
    assert "finished b (1 of 3 runs)" in out


def test_one_live_table_on_a_terminal(tmp_path):
    buf = io.StringIO()
    con = Console(file=buf, force_terminal=True, width=200)
    with RunsProgress(con, 2) as p:
        p.started("a", tmp_path / "a", 4, tmp_path / "a.log")
        _append(tmp_path / "a", {"step": 3, "reward": 0.75, "wall_s": 6.0})
        p.refresh()
        table = p.table()
    assert table.title == "0 of 2 runs finished, 1 running, 1 waiting"
    cells = [list(c.cells) for c in table.columns]
    assert cells[0] == ["a"] and cells[1] == ["3/4"] and cells[2] == ["0.750"] and cells[4] == ["2s"]
    assert "progress:" not in buf.getvalue()  # no plain lines on a terminal
