"""pdmask ladder: the spec, the cell plan, resume without rerunning finished cells, the report and plot.

Real runs use the smoke preset (a 1-layer width-32 model, 3 steps); the report's numbers
are checked on constructed runs whose answers are known.
"""

import json
import math
import os
import shutil
import signal
import time

import pytest
import yaml

from pdmask.train.grpo import TIME_KEYS
from pdmask_lab.ladder import cell_status, load_spec, plan_cells, run_ladder
from pdmask_lab.ladder_plot import plot_data
from pdmask_lab.ladder_report import build_report
from pdmask.train.logging import read_jsonl


def write_spec(path, base, *, modes=("none", "dppo-topk-kl"), seeds=2, extra=(), rung_set=None, set_=None):
    spec = {"name": "tiny", "config": str(base), "modes": list(modes), "seeds": seeds,
            "set": set_ if set_ is not None else {"steps": 3, "eval_every": 1, "checkpoint_every": 1,
                                                  "keep_checkpoints": 5, "tensorboard": False},
            "rungs": [{"name": "calm", "set": rung_set or {"engine_precision": "fp32"}},
                      {"name": "lag", "set": {"engine_precision": "fp8", "sync_every": 2},
                       "extra_modes": list(extra)}]}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _cells_run(out):
    return [r["cell"] for r in read_jsonl(out / "ladder_log.jsonl") if r.get("event") == "cell"]


# ------------------------------------------------------------------ spec and plan
def test_plan_order_and_cell_configs(tmp_path, smoke_config):
    spec = load_spec(write_spec(tmp_path / "s.yaml", smoke_config, extra=["pdm-topk-kl"]), overrides=["lr=2e-3"])
    cells = plan_cells(spec, tmp_path / "out")
    # rung by rung, seed by seed, then mode (extra modes after the spec's): a ladder stopped
    # part-way holds whole seeds of its first rungs
    assert [c.key for c in cells] == [
        "calm/none-s0", "calm/dppo-topk-kl-s0", "calm/none-s1", "calm/dppo-topk-kl-s1",
        "lag/none-s0", "lag/dppo-topk-kl-s0", "lag/pdm-topk-kl-s0",
        "lag/none-s1", "lag/dppo-topk-kl-s1", "lag/pdm-topk-kl-s1"]
    lag = cells[4].cfg
    assert (lag.engine_precision, lag.sync_every, lag.steps, lag.lr, lag.seed) == ("fp8", 2, 3, 2e-3, 0)
    assert lag.run_dir == tmp_path / "out" / "lag" / "none-s0"
    assert cells[0].cfg.engine_precision == "fp32" and cells[0].cfg.sync_every == 1
    assert len(plan_cells(spec, tmp_path / "out", ["lag"])) == 6


def test_mode_set_overrides_one_modes_cells_last(tmp_path, smoke_config):
    """``mode_set``: a mode's own overrides (its threshold on its own scale) win over the
    spec's and the rung's, in that mode's cells only."""
    p = write_spec(tmp_path / "s.yaml", smoke_config, extra=["drpo"])
    s = yaml.safe_load(p.read_text())
    s["set"]["delta_low"] = s["set"]["delta_high"] = 0.02
    s["mode_set"] = {"drpo": {"delta_low": 0.1, "delta_high": 0.1}}
    p.write_text(yaml.safe_dump(s))
    cells = {c.key: c.cfg for c in plan_cells(load_spec(p), tmp_path / "out")}
    th = {k: (c.loss.thresholds.delta_low, c.loss.thresholds.delta_high) for k, c in cells.items()}
    assert th["lag/drpo-s0"] == th["lag/drpo-s1"] == (0.1, 0.1)
    assert {v for k, v in th.items() if "drpo" not in k} == {(0.02, 0.02)}


@pytest.mark.parametrize("edit,overrides,msg", [
    (lambda s: s.update(modes=["none", "dppo-topk"]), [], "modes: unknown value 'dppo-topk'; valid values are: grpo"),
    (lambda s: s.update(bogus=1), [], "spec: unknown key 'bogus'"),
    (lambda s: s["rungs"].append({"name": "calm"}), [], "rungs\\[2\\].name: 'calm' is empty, repeated"),
    (lambda s: s["rungs"][0]["set"].update(stpes=3), [], "rungs\\[0\\].set: unknown config key 'stpes'"),
    (lambda s: s["rungs"][0]["set"].update(seed=3), [], "'seed' is set by the ladder"),
    (lambda s: s["rungs"][1]["set"].update(sync_every=0), [], "rung lag: sync_every: must be >= 1"),
    (lambda s: None, ["sync_every=4"], "sync_every: set by the ladder's rungs \\(lag\\)"),
    (lambda s: s.update(collapse_drop=0), [], "collapse_drop: must lie in"),
    (lambda s: s.update(mode_set={"drpo": {"delta_low": 0.1}}), [], "mode_set: 'drpo' is not a mode of this ladder"),
    (lambda s: s.update(mode_set={"none": {"seed": 1}}), [], "mode_set.none: 'seed' is set by the ladder"),
    (lambda s: s.update(mode_set={"none": {"lr": 1e-3}}), ["lr=2e-3"], "lr: set by the ladder's rungs \\(mode_set.none\\)"),
    (lambda s: s.update(mode_set=[1]), [], "mode_set: expected a mapping"),
])
def test_bad_specs_are_refused_naming_the_key(tmp_path, smoke_config, edit, overrides, msg):
    p = write_spec(tmp_path / "s.yaml", smoke_config)
    s = yaml.safe_load(p.read_text())
    edit(s)
    p.write_text(yaml.safe_dump(s))
    with pytest.raises(ValueError, match=msg):
        load_spec(p, overrides=overrides)


# ------------------------------------------------------------------ resume
@pytest.mark.slow
def test_new_rungs_seeds_modes_and_partial_cells_run_only_what_is_missing(tmp_path, cache_dir, smoke_config,
                                                                          check_environment):
    out = tmp_path / "out"
    p = write_spec(tmp_path / "s.yaml", smoke_config)
    ov = [f"cache_dir={cache_dir}"]
    spec = load_spec(p, overrides=ov)
    r = run_ladder(spec, out=out, rungs=["calm"])  # a chunk: one rung
    assert r["executed"] == {"fresh": 4, "resume": 0}
    r = run_ladder(spec, out=out)  # the rest: only the other rung's cells
    assert r["executed"] == {"fresh": 4, "resume": 0}
    assert len(_cells_run(out)) == 8
    assert run_ladder(spec, out=out)["executed"] == {"fresh": 0, "resume": 0}  # all done: nothing runs
    # more seeds, then a new mode on one rung: only the new cells
    r = run_ladder(load_spec(p, seeds=3, overrides=ov), out=out)
    assert r["executed"] == {"fresh": 4, "resume": 0}
    assert sorted(_cells_run(out)[8:]) == ["calm/dppo-topk-kl-s2", "calm/none-s2", "lag/dppo-topk-kl-s2", "lag/none-s2"]
    write_spec(p, smoke_config, extra=["pdm-topk-kl"])
    spec3 = load_spec(p, seeds=3, overrides=ov)
    r = run_ladder(spec3, out=out)
    assert r["executed"] == {"fresh": 3, "resume": 0}
    assert sorted(_cells_run(out)[12:]) == [f"lag/pdm-topk-kl-s{s}" for s in range(3)]

    # a cell killed after its step-1 checkpoint: metrics cut back, no summary -> resumed, not rerun;
    # it ends with exactly the records of the uninterrupted run (deterministic on CPU)
    cell = next(c for c in plan_cells(spec3, out) if c.key == "lag/dppo-topk-kl-s1")
    run = cell.cfg.run_dir
    full = read_jsonl(run / "metrics.jsonl")
    (run / "summary.json").unlink()
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in full[:3]))  # steps 0, 1, 2 (torn)
    assert (run / "checkpoints" / "step-000001").is_dir()
    for ck in (run / "checkpoints").iterdir():
        if ck.name != "step-000001":
            shutil.rmtree(ck)
    assert cell_status(cell) == "partial"
    r = run_ladder(spec3, out=out)
    assert r["executed"] == {"fresh": 0, "resume": 1}
    assert r["status"]["lag/dppo-topk-kl-s1"] == "partial"
    got = read_jsonl(run / "metrics.jsonl")
    assert [x["step"] for x in got] == [0, 1, 2, 3]
    strip = [{k: v for k, v in x.items() if k not in TIME_KEYS} for x in got]
    assert strip == [{k: v for k, v in x.items() if k not in TIME_KEYS} for x in full]
    assert len(_cells_run(out)) == 16  # 15 cells + 1 resume; no finished cell ran twice
    assert len(set(_cells_run(out)[:15])) == 15

    # the report covers every finished cell; a changed setting is refused, not mixed
    build_report(spec3, out, plot=False)
    rep = json.loads((out / "ladder.json").read_text())
    assert [(r["name"], r["cells_done"]) for r in rep["rungs"]] == [("calm", 6), ("lag", 9)]
    assert rep["wall"]["cells_fresh"] == 15 and rep["wall"]["cells_resumed"] == 1
    # the environment: the report's, and the runs' (one here: every cell ran in this process)
    check_environment(rep["environment"], threads=None)
    [group] = rep["runs_environments"]
    check_environment(group["environment"], threads=1)
    assert len(group["runs"]) == 15 and "lag/dppo-topk-kl-s1" in group["runs"]
    assert (out / "ladder.md").read_text().splitlines()[2].startswith(
        f"Environment: torch {rep['environment']['packages']['torch']}")
    assert json.loads((out / "calm" / "summary.json").read_text())["environment"]["source"] == "the runs"
    with pytest.raises(ValueError, match=r"cell calm/none-s0 holds a run made with other settings \(lr: 0.001 -> 0.002\)"):
        run_ladder(load_spec(p, seeds=3, overrides=ov + ["lr=2e-3"]), out=out)


@pytest.mark.slow
def test_ladder_killed_mid_cell_resumes_without_rerunning(tmp_path, cache_dir, smoke_config, cli):
    """SIGKILL a ``--jobs 2`` ladder while its cells run; its training subprocesses die with
    it, and the next invocation resumes the partial cells from their checkpoints, starts
    the untouched ones and reruns nothing that finished."""
    run_cli, popen_cli = cli
    p = write_spec(tmp_path / "s.yaml", smoke_config, modes=("dppo-topk-kl",), seeds=2,
                   set_={"steps": 6, "eval_every": 2, "checkpoint_every": 1, "tensorboard": False})
    out = tmp_path / "out"
    args = ["ladder", "--spec", p, "--out", out, "--jobs", "2", f"cache_dir={cache_dir}"]
    proc = popen_cli(args, cwd=tmp_path)
    second = out / "calm" / "dppo-topk-kl-s1" / "metrics.jsonl"
    deadline = time.time() + 200
    while time.time() < deadline and proc.poll() is None:
        if any(r["step"] >= 2 for r in read_jsonl(second)):
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait(timeout=30)
    if proc.returncode == 0:
        pytest.fail("the ladder finished before it could be killed; make it longer")
    time.sleep(1.0)
    frozen = read_jsonl(second)
    time.sleep(2.0)
    assert read_jsonl(second) == frozen  # the orphaned training process died with the ladder
    before = [x["cell"] for x in read_jsonl(out / "ladder_log.jsonl") if x["event"] == "cell"]
    r = run_cli(args + ["--plan"], cwd=tmp_path)
    status = dict(line.split()[::-1] for line in r.stdout.splitlines() if line.startswith(("done", "partial", "todo")))
    assert status["calm/dppo-topk-kl-s1"] == "partial"
    done = {c for c, s in status.items() if s == "done"}
    assert set(before) <= done  # (a cell may finish between the kill and its log line: done, unlogged)
    run_cli(args, cwd=tmp_path)
    log = read_jsonl(out / "ladder_log.jsonl")
    starts = [i for i, x in enumerate(log) if x["event"] == "start"]
    assert len(starts) == 2
    after = {x["cell"]: x["how"] for x in log[starts[1]:] if x["event"] == "cell"}
    assert not set(after) & done  # nothing finished ran twice
    assert set(after) | done == set(status)  # and nothing was left out
    assert all(after[c] == {"partial": "resume", "todo": "fresh"}[status[c]] for c in after)
    for c in status:
        steps = [x["step"] for x in read_jsonl(out / c / "metrics.jsonl")]
        assert steps == list(range(7)), c  # nothing lost, nothing twice
    rep = json.loads((out / "ladder.json").read_text())
    assert rep["wall"]["invocations"] == 2 and rep["wall"]["cells_resumed"] >= 1
    assert (out / "ladder.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "ladder.md").read_text()
    assert "| lag | dppo-topk-kl | 2 |" in md and "| calm | dppo-topk-kl | 2 |" in md


# ------------------------------------------------------------------ the report on constructed runs
# rung "calm": every mode reaches 0.70 + 0.01 s and stays there.
# rung "hard": `none` rises to 0.60 and falls to 0.30 (worst drop 0.30 >= 0.15: collapsed) in seeds 0..5,
# stays flat at 0.60 in seeds 6, 7; dppo stays at 0.70 + 0.01 s, except seed 7, which drops 0.15 exactly
# (collapsed, on the threshold); pdm = dppo + 0.02 at the last eval of every seed.
SEEDS = range(8)


def _curve(rung, mode, s):
    base = 0.70 + 0.01 * s
    bonus = 0.02 if mode == "pdm-topk-kl" else 0.0  # at the last eval only
    if rung == "hard" and mode == "none":
        return [0.10, 0.60, 0.60, 0.30 if s < 6 else 0.60]
    if rung == "hard" and s == 7:
        return [0.10, base, base - 0.15, base - 0.15 + bonus]
    return [0.10, base, base, base + bonus]


def _mismatch(rung, mode, s):
    return (1e-4 if rung == "calm" else 1e-2) * (1 + 0.1 * s) * (3 if mode == "none" else 1)


def _write_cells(spec, out):
    for c in plan_cells(spec, out):
        d = c.cfg.run_dir
        d.mkdir(parents=True)
        (d / "config.yaml").write_text(yaml.safe_dump(c.cfg.to_dict(), sort_keys=False))
        acc = _curve(c.rung.name, c.mode, c.seed)
        recs = [{"step": 0, "eval_accuracy": acc[0]}]
        for t in (1, 2, 3):
            recs.append({"step": t, "eval_accuracy": acc[t], "num_tokens": 1000.0, "num_masked": 10.0,
                         "num_out_of_region": 100.0, "num_disagreement": 5.0 * (c.mode == "pdm-topk-kl"),
                         "mismatch_topk_kl": _mismatch(c.rung.name, c.mode, c.seed), "rollout_tail_mass_mean": 0.01})
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        (d / "summary.json").write_text("{}")


@pytest.fixture
def constructed(tmp_path, smoke_config):
    p = write_spec(tmp_path / "s.yaml", smoke_config, modes=("none", "dppo-topk-kl", "pdm-topk-kl"), seeds=8)
    s = yaml.safe_load(p.read_text())
    s["rungs"][1]["name"] = "hard"
    p.write_text(yaml.safe_dump(s))
    spec = load_spec(p)
    out = tmp_path / "out"
    _write_cells(spec, out)
    return spec, out


def test_report_numbers_on_constructed_runs(constructed):
    spec, out = constructed
    rep = build_report(spec, out, plot=False)
    calm, hard = rep["rungs"]
    # rung mismatch: mean over the reference (dppo) seeds of 1e-2 * (1 + 0.1 s) = 1e-2 * 1.35
    assert hard["mismatch"]["estimate"] == pytest.approx(1.35e-2)
    assert hard["mismatch"]["lo"] < 1.35e-2 < hard["mismatch"]["hi"] and hard["mismatch"]["n"] == 8
    assert calm["mismatch"]["estimate"] == pytest.approx(1.35e-4)
    assert hard["tail_mass_mean"] == pytest.approx(0.01) and hard["sft_accuracy"] == pytest.approx(0.10)
    m = {x["mode"]: x for x in hard["modes"]}
    # collapse: none 6/8, dppo 1/8 (seed 7, on the 0.15 threshold), pdm 1/8
    assert [m[k]["collapse"]["k"] for k in ("none", "dppo-topk-kl", "pdm-topk-kl")] == [6, 1, 1]
    assert m["none"]["collapse"]["per_seed"] == [True] * 6 + [False] * 2
    assert not any(x["collapse"]["k"] for x in calm["modes"])
    # McNemar none vs dppo: none alone collapsed in seeds 0..5 (6), dppo alone in seed 7 (1):
    # p = 2 * (C(7,0) + C(7,1)) / 2^7 = 16 / 128 = 0.125
    c = m["none"]["vs_reference"]["collapse"]
    assert (c["only_mode"], c["only_reference"], c["n"]) == (6, 1, 8) and c["p"] == pytest.approx(0.125)
    # final accuracy, pdm vs dppo: +0.02 on every seed -> sign-flip p = 2 / 2^8
    d = m["pdm-topk-kl"]["vs_reference"]["eval_final"]
    assert d["estimate"] == pytest.approx(0.02) and d["p"] == pytest.approx(2 / 256)
    # dppo final: seeds 0..6 at 0.70 + 0.01 s, seed 7 at 0.77 - 0.15
    want = (sum(0.70 + 0.01 * s for s in range(7)) + 0.77 - 0.15) / 8
    assert m["dppo-topk-kl"]["eval_final"]["estimate"] == pytest.approx(want)
    assert m["dppo-topk-kl"]["vs_reference"] is None
    # own mismatch of none: 3x the reference's
    assert m["none"]["mismatch_mean"] == pytest.approx(3 * 1.35e-2)
    # shares pooled over tokens: 10 of 1000 masked; 5 of 100 out-of-region tokens disagree (pdm only)
    assert m["pdm-topk-kl"]["masked_frac"] == pytest.approx(0.01)
    assert (m["pdm-topk-kl"]["disagreement_frac"], m["none"]["disagreement_frac"]) == pytest.approx((0.05, 0.0))
    md = (out / "ladder.md").read_text()
    assert "| 1.00% | 5.00% | +0.020 [" in md  # pdm's masked and disagreement columns, then its paired Δ
    assert "| hard | none | 8 |" in md and "6/8 [" in md and "6 vs 1 p = 0.125" in md
    assert "2/2^8 = 0.00781" in md and "only a difference of at least 6/8" in md
    # per-rung compare summaries for `pdmask report`
    assert json.loads((out / "hard" / "summary.json").read_text())["across_seeds"]["reference"] == "dppo-topk-kl"


@pytest.mark.slow
def test_plot_data_and_png(constructed, tmp_path):
    spec, out = constructed
    rep = build_report(spec, out)
    d = plot_data(rep)
    assert set(d) == {("main", m) for m in ("none", "dppo-topk-kl", "pdm-topk-kl")}
    none = d[("main", "none")]
    assert none["rung"] == ["calm", "hard"]  # sorted by measured mismatch
    assert none["x"] == pytest.approx([1.35e-4, 1.35e-2])  # the rung's x, not the mode's own mismatch
    assert none["coll"] == pytest.approx([0.0, 0.75])
    assert none["coll_lo"][1] < 0.75 < none["coll_hi"][1]
    assert none["acc"][1] == pytest.approx((6 * 0.30 + 2 * 0.60) / 8)
    assert all(lo <= a <= hi for a, lo, hi in zip(none["acc"], none["acc_lo"], none["acc_hi"]))
    png = out / "ladder.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert (out / "hard" / "report" / "eval_accuracy_bands.png").exists()
    # an unfinished cell is left out and named, never averaged in
    (out / "hard" / "none-s7" / "summary.json").unlink()
    rep = build_report(spec, out, plot=False)
    m = {x["mode"]: x for x in rep["rungs"][1]["modes"]}
    assert m["none"]["n"] == 7 and rep["rungs"][1]["cells_done"] == 23
    assert any("hard/none-s7: unfinished" in n for n in rep["notes"])
    assert math.isclose(m["none"]["collapse"]["rate"], 6 / 7)


def test_cli_plan_and_errors(tmp_path, smoke_config, cli):
    run_cli, _ = cli
    p = write_spec(tmp_path / "s.yaml", smoke_config)
    r = run_cli(["ladder", "--spec", p, "--out", tmp_path / "o", "--plan", "--rungs", "lag"], cwd=tmp_path)
    assert "0 done, 0 partial, 4 todo of 4 cells" in r.stdout and "todo     lag/none-s1" in r.stdout
    r = run_cli(["ladder", "--spec", p, "--plan", "--rungs", "nope"], cwd=tmp_path, check=False)
    assert r.returncode == 2 and "rungs: unknown rung 'nope'; the spec's rungs are: calm, lag" in r.stderr
    r = run_cli(["ladder", "--spec", tmp_path / "missing.yaml"], cwd=tmp_path, check=False)
    assert r.returncode == 2 and "spec:" in r.stderr and "missing.yaml" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_failed_cell_is_one_line_naming_it_its_error_and_its_log(tmp_path, smoke_config, cli):
    # the child fails after the ladder has planned and started it (this process holds the cell's
    # run-directory lock, which only the child's trainer takes): the ladder says which cell,
    # why (the child's own error line) and where the log is
    from pdmask.train.rundir import lock_run_dir

    run_cli, _ = cli
    p = write_spec(tmp_path / "s.yaml", smoke_config, modes=("none",), seeds=1)
    with lock_run_dir(tmp_path / "o" / "calm" / "none-s0"):
        r = run_cli(["ladder", "--spec", p, "--out", tmp_path / "o", "--jobs", "2", "--rungs", "calm"],
                    cwd=tmp_path, check=False)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    [line] = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert line.startswith("error: cell calm/none-s0 failed (exit 2): error: ") and str(os.getpid()) in line
    assert line.endswith(f"(log: {tmp_path / 'o' / 'calm' / 'none-s0.log'})")


def test_config_diff_tolerates_fields_added_later_at_their_default(tmp_path, smoke_config):
    from pdmask.train.config import config_diff

    spec = load_spec(write_spec(tmp_path / "s.yaml", smoke_config))
    cfg = plan_cells(spec, tmp_path / "out")[0].cfg
    stored = cfg.to_dict()
    assert config_diff(stored, cfg) == {}
    del stored["grad_clip"]  # an older run, made before the field existed
    assert config_diff(stored, cfg) == {}
    stored["out_dir"], stored["progress"] = "elsewhere", True  # results-neutral keys
    assert config_diff(stored, cfg) == {}
    # how many checkpoints stay on disk changes no result (its default changed 1 -> 2 after
    # the first ladder cells: those cells must still count as done)
    stored["keep_checkpoints"] = cfg.keep_checkpoints + 3
    assert config_diff(stored, cfg) == {}
    stored["lr"] = 1.0
    assert config_diff(stored, cfg) == {"lr": (1.0, cfg.lr)}
    from pdmask.train.config import replace

    assert config_diff({k: v for k, v in cfg.to_dict().items() if k != "grad_clip"},
                       replace(cfg, grad_clip=0.5)) == {"grad_clip": (None, 0.5)}


def test_cells_not_run_yet_are_one_note_per_rung(constructed):
    """A ladder run with fewer seeds than its spec leaves whole seeds out: the report names
    them per rung (seeds as ranges), not one line per cell, and leaves them out of every number."""
    spec, out = constructed
    for mode in ("none", "dppo-topk-kl", "pdm-topk-kl"):
        for s in (5, 6, 7):
            shutil.rmtree(out / "calm" / f"{mode}-s{s}")
    shutil.rmtree(out / "calm" / "pdm-topk-kl-s2")
    rep = build_report(spec, out, plot=False)
    assert rep["notes"] == ["calm: 10 of 24 planned cells not run yet: seeds 5-7 (every mode), pdm-topk-kl-s2; left out"]
    calm = {m["mode"]: m for m in rep["rungs"][0]["modes"]}
    assert calm["none"]["seeds"] == [0, 1, 2, 3, 4] and calm["pdm-topk-kl"]["seeds"] == [0, 1, 3, 4]
    assert rep["rungs"][0]["cells_done"] == 14
    # calm, pdm vs dppo: +0.02 on the 4 common seeds -> p = 2/2^4
    assert calm["pdm-topk-kl"]["vs_reference"]["eval_final"]["p"] == pytest.approx(0.125)
    assert "- calm: 10 of 24 planned cells not run yet" in (out / "ladder.md").read_text()


def test_rung_labels_of_close_rungs_do_not_overlap():
    from pdmask_lab.ladder_plot import _label_positions

    # width 0.1 decades: a label takes [x - 0.1, x] (left of x) or [x, x + 0.1] (right of x)
    pos = _label_positions({"fp32": 1e-8, "bf16": 1e-4, "a": 4.2e-3, "b": 6.8e-3, "c": 1.5e-2, "d": 1.9e-2},
                           width=0.1)
    # a and b are 0.21 decades apart, b and c 0.34, c and d 0.103 (> 0.1): every label fits
    # left of its x on the top level
    assert {k: v[1:] for k, v in pos.items()} == {k: (1.0, "right") for k in pos}
    pos = _label_positions({"c": 1.5e-2, "d": 1.7e-2, "e": 1.8e-2}, width=0.1)
    # d (0.054 decades from c) goes right of its x; e has neither side free: a level down
    assert pos["c"][1:] == (1.0, "right") and pos["d"][1:] == (1.0, "left")
    assert pos["e"] == (1.8e-2, pytest.approx(0.7), "right")
    # the default width is 1.8% of the span (7 decades + 1 here): 0.144
    assert _label_positions({"x": 1e-8, "y": 1e-1, "z": 1.3e-1})["z"][2] == "left"


def test_a_report_with_fewer_seeds_keeps_the_finished_runs_of_more(constructed):
    """A ``--seeds 4`` chunk rebuilds the report: the 8 finished seeds on disk stay in it,
    counted as cells (8 of 8 done, not 8 of 4)."""
    import dataclasses

    spec, out = constructed
    rep = build_report(dataclasses.replace(spec, seeds=4), out, plot=False)
    assert [(r["cells_done"], r["cells_planned"], r["cells_extra"]) for r in rep["rungs"]] == [(24, 24, 12)] * 2
    hard = {m["mode"]: m for m in rep["rungs"][1]["modes"]}
    assert hard["none"]["seeds"] == list(range(8)) and hard["none"]["collapse"]["k"] == 6
    assert rep["notes"] == []
    md = (out / "ladder.md").read_text()
    assert "4 seeds planned per cell; finished runs of further seeds" in md and "| 24/24 |" in md


# ------------------------------------------------------------------ pooled over rungs
def test_pooled_over_rungs_on_constructed_runs(constructed):
    spec, out = constructed
    rep = build_report(spec, out, plot=False)
    pooled = {r["mode"]: r for r in rep["pooled"]}
    assert set(pooled) == {"none", "pdm-topk-kl"} and pooled["none"]["rungs"] == ["calm", "hard"]
    # pdm = dppo + 0.02 at the last eval on every seed of both rungs: d_s = 0.02, 8 of 8 up, p = 2 / 2^8
    d = pooled["pdm-topk-kl"]["diff"]
    assert d["estimate"] == pytest.approx(0.02) and (d["wins"], d["losses"]) == (8, 0)
    assert d["p"] == pytest.approx(2 / 256)
    # none vs dppo: calm 0 on every seed; hard: none ends at 0.30 (s < 6) or 0.60, dppo at
    # 0.70 + 0.01 s (s < 7) and 0.62 (s = 7), so hard's differences are -0.40 - 0.01 s (s < 6),
    # -0.16, -0.02; d_s is half of that, and the mean over seeds (-2.40 - 0.15 - 0.16 - 0.02) / 16
    want = [(-0.40 - 0.01 * s) / 2 for s in range(6)] + [-0.16 / 2, -0.02 / 2]
    assert pooled["none"]["per_seed"] == pytest.approx(want)
    assert pooled["none"]["diff"]["estimate"] == pytest.approx(-2.73 / 16)
    assert pooled["none"]["diff"]["p"] == pytest.approx(2 / 256)
    md = (out / "ladder.md").read_text()
    assert "## Pooled over rungs, clustered by seed" in md
    assert "| pdm-topk-kl | 2 | 8 | +0.020 [+0.020, +0.020] | 8 / 0 | p = 0.00781 |" in md


def _rep(rungs, reference="ref"):
    """A ladder report reduced to what the pooled comparison reads: {rung: {mode: {seed: acc}}}."""
    return {"reference": reference, "rungs": [
        {"name": name, "modes": [{"mode": m, "seeds": list(acc), "eval_final": {"per_seed": list(acc.values())}}
                                 for m, acc in modes.items()]} for name, modes in rungs.items()]}


def test_pooled_flips_whole_seeds_and_keeps_a_balanced_design():
    from pdmask_lab.ladder_pooled import pooled_vs_reference

    ref = {0: 0.5, 1: 0.5, 2: 0.5, 3: 0.5, 4: 0.5}
    rep = _rep({
        # seed 0: +0.3 and -0.1 -> +0.1; seeds 1, 2: +0.1 on both rungs; seed 3: -0.1 on both
        "a": {"ref": ref, "x": {0: 0.8, 1: 0.6, 2: 0.6, 3: 0.4, 4: 0.9}, "y": {0: 0.4}},
        # seed 4 ran x only on rung a: dropped (balanced design), and counted
        "b": {"ref": ref, "x": {0: 0.4, 1: 0.6, 2: 0.6, 3: 0.4}},
    })
    rows = {r["mode"]: r for r in pooled_vs_reference(rep, n_boot=200)}
    x = rows["x"]
    assert x["rungs"] == ["a", "b"] and x["seeds"] == [0, 1, 2, 3] and x["seeds_dropped"] == [4]
    assert x["per_seed"] == pytest.approx([0.1, 0.1, 0.1, -0.1])
    # d = (+.1, +.1, +.1, -.1), |sum| = 0.2; of the 16 sign vectors only the six 2-2 splits
    # give |sum| < 0.2, so p = 10 / 16 (flipping rungs separately would test something else)
    assert x["diff"]["estimate"] == pytest.approx(0.05) and x["diff"]["p"] == pytest.approx(10 / 16)
    assert (x["diff"]["wins"], x["diff"]["losses"]) == (3, 1)
    # y ran on rung a only, seed 0 only: one rung, one seed, no interval
    y = rows["y"]
    assert y["rungs"] == ["a"] and y["seeds"] == [0] and y["per_seed"] == pytest.approx([-0.1])
    assert y["diff"]["n"] == 1 and math.isnan(y["diff"]["lo"])
    # no common seed at all: a row without a difference, never a crash
    rep2 = _rep({"a": {"ref": {0: 0.5}, "x": {1: 0.6}}})
    (r,) = pooled_vs_reference(rep2, n_boot=200)
    assert r["seeds"] == [] and r["diff"] is None and r["seeds_dropped"] == [0, 1]


# ------------------------------------------------------------------ the results page from its records
def _page(path):
    """A page without its "Written by" line (the one line that names the invocation)."""
    return [x for x in path.read_text().splitlines() if not x.startswith("Written by `pdmask ladder")]


@pytest.mark.slow
def test_report_dir_writes_the_page_with_its_records_and_report_only_rewrites_it(constructed, tmp_path, cli):
    """`--report-dir` writes the page and the records it is built from (no checkpoints) into
    a results folder; after the runs are gone, `--out <that folder> --report-only` rewrites the
    same page from the records alone."""
    run_cli, _ = cli
    spec, out = constructed
    spec_path = tmp_path / "s.yaml"
    run0 = out / "hard" / "none-s0"
    (run0 / "checkpoints").mkdir()
    (run0 / "checkpoints" / "step-3.safetensors").write_bytes(b"\0" * 1000)
    (out / "ladder_log.jsonl").write_text(json.dumps({"time": 0.0, "event": "start"}) + "\n"
                                          + json.dumps({"time": 90.0, "event": "cell", "how": "fresh"}) + "\n")
    results = tmp_path / "docs" / "results" / "ladder"
    r = run_cli(["ladder", "--spec", spec_path, "--out", out, "--report-only", "--report-dir", results], cwd=tmp_path)
    assert "copied the records of 48 runs" in r.stdout
    page = results / "ladder.md"
    first = page.read_text()
    # the command line is portable (pdmask.train.portable): paths relative to where it ran, no machine path
    assert "Written by `pdmask ladder --spec " in first and "--report-only --report-dir " in first
    assert str(tmp_path) not in first
    assert "| hard | none | 8 |" in first and "Machine time: 1.5 min over 1 invocation(s)" in first
    assert (results / "ladder.png").exists() and (results / "hard" / "summary.md").exists()
    assert sorted(p.name for p in (results / "hard" / "none-s0").iterdir()) == ["config.yaml", "metrics.jsonl",
                                                                              "summary.json"]
    assert not list(results.rglob("*.safetensors")) and not (out / "ladder.md").exists()  # OUT is not written
    shutil.rmtree(out)  # the runs are gone: only the committed records remain
    run_cli(["ladder", "--spec", spec_path, "--out", results, "--report-only"], cwd=tmp_path)
    second = page.read_text()
    assert "Written by `pdmask ladder --spec " in second and "--report-only`." in second
    assert _page(page) == [x for x in first.splitlines() if not x.startswith("Written by `pdmask ladder")]
    assert json.loads((results / "ladder.json").read_text())["rungs"][1]["cells_done"] == 24


def test_export_mirrors_every_run_and_drops_a_record_the_run_lost(constructed, tmp_path):
    from pdmask_lab.ladder_report import export_records

    spec, out = constructed
    dest = tmp_path / "results"
    assert export_records(spec, out, dest) == 48
    (out / "hard" / "none-s7" / "summary.json").unlink()  # the cell is unfinished again
    assert export_records(spec, out, dest) == 48
    assert not (dest / "hard" / "none-s7" / "summary.json").exists()
    rep = build_report(spec, dest, plot=False)
    assert any("hard/none-s7: unfinished" in n for n in rep["notes"]) and rep["rungs"][1]["cells_done"] == 23
    with pytest.raises(ValueError, match="^out: .*is not a directory"):
        export_records(spec, tmp_path / "nowhere", dest)


def test_report_dir_with_plan_is_refused(tmp_path, smoke_config, cli):
    run_cli, _ = cli
    p = write_spec(tmp_path / "s.yaml", smoke_config)
    r = run_cli(["ladder", "--spec", p, "--plan", "--report-dir", tmp_path / "r"], cwd=tmp_path, check=False)
    assert r.returncode == 2 and "report_dir: --plan writes nothing" in r.stderr
