"""examples/trl/learning_run.py without TRL: the report from synthetic records, and the grid's
resumable plan with a stand-in for train_grpo.py.

The report's numbers are recomputed here from the synthetic records (means per step, the
paired differences, McNemar's discordant counts and p-value by hand and, where scipy is
installed, by ``scipy.stats.binomtest``)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("pdmask_lab.significance", reason="the report's statistics are pdmask-lab's (pip install -e ./lab)")

from tests.test_no_machine_paths import MACHINE_PATH  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("learning_run", REPO / "examples" / "trl" / "learning_run.py")
lr = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lr)

STEPS = [0, 4, 8]
N_PROMPTS = 10
SEEDS = [0, 1, 2]


def scores(seed: int, label: str, step: int) -> list[float]:
    """0/1 per prompt. Step 0: the same for both labels (one start model), prompts 0-2 right.
    Final step: the treatment adds prompt 3 (seed 0) or 3 and 4 (seeds 1, 2), the baseline adds
    prompt 9 on seed 2: pooled over the seeds, only the treatment is right on 5 pairs, only the
    baseline on 1."""
    base = [1.0 if i < 3 else 0.0 for i in range(N_PROMPTS)]
    if step == 0:
        return base
    if label == "plain-trl":
        out = list(base)
        if seed == 2 and step == STEPS[-1]:
            out[9] = 1.0  # the one prompt only the baseline gets right
        return out
    out = list(base)
    extra = {0: [3], 1: [3, 4]}.get(seed, [3, 4]) if step == STEPS[-1] else [3]
    for i in extra:
        out[i] = 1.0
    return out


def write_run(d: Path, label: str, seed: int, *, finished: bool = True, steps=STEPS) -> None:
    d.mkdir(parents=True)
    env = {"packages": {"torch": "2.13.0+cpu", "trl": "1.16.0", "transformers": "5.24.0", "accelerate": "1.15.0"},
           "python": "3.11.7", "cpu_model": "Test CPU", "cpu_count": 2, "torch_threads": 1}
    run = {"label": label, "seed": seed, "model": "smollm2-135m", "max_steps": steps[-1], "settings": {"lr": 1e-5},
           "mask": None, "heldout": {"every": 4, "prompts": N_PROMPTS}, "trainer": "x", "processes": 1,
           "command": f"python examples/trl/train_grpo.py --seed {seed}", "environment": env, "finished": finished,
           "wall_s": 600.0 + seed}
    (d / "run.json").write_text(json.dumps(run))
    with open(d / "heldout.jsonl", "w") as f:
        for s in steps:
            sc = scores(seed, label, s)
            f.write(json.dumps({"step": s, "accuracy": sum(sc) / len(sc), "finished": 0.9, "n_prompts": len(sc),
                                "scores": sc, "eval_s": 30.0, "wall_s": 10.0 * s}) + "\n")
    with open(d / "steps.jsonl", "w") as f:
        for s in range(1, steps[-1] + 1):
            f.write(json.dumps({"step": s, "reward": 0.3, "kept": None, "clipped": 0.0,
                                "time_step_s": 10.0 + s + seed}) + "\n")


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "runs"
    for seed in SEEDS:
        for label in ("pdm-topk-kl", "plain-trl"):
            write_run(root / f"{label}-s{seed}", label, seed)
    write_run(root / "pdm-topk-kl-s3", "pdm-topk-kl", 3, finished=False)  # unfinished: not read
    return root


def test_report_numbers_from_synthetic_records(runs, tmp_path, capsys):
    out = tmp_path / "docs" / "trl-learning"
    assert lr.main(["report", "--runs", str(runs), "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["treatment"] == "pdm-topk-kl" and s["baseline"] == "plain-trl" and s["seeds"] == SEEDS
    assert s["eval_steps"] == STEPS and s["n_prompts"] == N_PROMPTS
    # accuracy per step: the mean over seeds of the per-prompt scores' means, recomputed
    for label in ("pdm-topk-kl", "plain-trl"):
        want = [np.mean([np.mean(scores(seed, label, st)) for seed in SEEDS]) for st in STEPS]
        assert s["accuracy"][label]["mean"] == pytest.approx(want, abs=1e-12)
        assert s["accuracy"][label]["per_seed"]["1"] == pytest.approx([np.mean(scores(1, label, st)) for st in STEPS])
    # paired final accuracy: d = (0.1, 0.2, 0.1) per seed; all positive with 3 seeds -> exact p = 2/2^3
    d = np.array([np.mean(scores(k, "pdm-topk-kl", 8)) - np.mean(scores(k, "plain-trl", 8)) for k in SEEDS])
    pf = s["paired_final"]
    assert pf["estimate"] == pytest.approx(d.mean()) and pf["n"] == 3 and pf["wins"] == 3 and pf["losses"] == 0
    assert pf["p"] == pytest.approx(0.25) and s["min_sign_flip_p"] == pytest.approx(0.25)
    assert s["paired_gain"]["estimate"] == pytest.approx(d.mean())  # equal starts: gain difference = final difference
    # did each label learn: its last eval against its own step 0, seed by seed
    for label in ("pdm-topk-kl", "plain-trl"):
        g = np.array([np.mean(scores(k, label, STEPS[-1])) - np.mean(scores(k, label, STEPS[0])) for k in SEEDS])
        got = s["learned"][label]
        assert got["estimate"] == pytest.approx(g.mean()) and got["n"] == 3
        assert (got["wins"], got["losses"]) == (int((g > 0).sum()), int((g < 0).sum()))
    # McNemar, pooled over seeds: only the treatment right on 1 + 2 + 2 = 5 pairs, only the baseline on 1
    mc = s["mcnemar"]
    assert (mc["b"], mc["c"], mc["n_pairs"], mc["n_prompts"], mc["n_seeds"]) == (5, 1, 30, 10, 3)
    assert mc["both"] + mc["neither"] == 24
    assert mc["p"] == pytest.approx(2 * (1 + 6) / 2 ** 6)  # 2 P(X <= 1), X ~ Bin(6, 1/2)
    stats = pytest.importorskip("scipy.stats")
    assert mc["p"] == pytest.approx(stats.binomtest(5, 6, 0.5).pvalue)
    # timing: the median of each run's seconds per step (1 + seed + 10 .. 8 + seed + 10)
    assert s["timing"]["pdm-topk-kl-s1"]["step_s_median"] == pytest.approx(np.median([10 + k + 1 for k in range(1, 9)]))
    # the page, the figure, the copied records; no machine path anywhere
    page = (out / "README.md").read_text()
    assert "![held-out accuracy per step](heldout.png)" in page and "2/2^3 = 0.25" in page and "no difference can reach p < 0.05" in page
    assert "- Learned (accuracy at the last eval - step 0" in page
    assert "only pdm-topk-kl right 5, only plain-trl right 1" in page and "Test CPU" in page
    assert (out / "heldout.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (out / "records").iterdir()) == sorted(
        f"{lab}-s{k}" for lab in ("pdm-topk-kl", "plain-trl") for k in SEEDS)
    for f in (out / "README.md", out / "summary.json"):
        assert not MACHINE_PATH.search(f.read_text()), f
    # rebuilt from the copied records alone: the same numbers
    assert lr.main(["report", "--runs", str(out / "records"), "--out", str(out)]) == 0
    again = json.loads((out / "summary.json").read_text())
    assert {k: v for k, v in again.items() if k != "written_by"} == {k: v for k, v in s.items() if k != "written_by"}


def test_report_refuses_runs_that_do_not_pair(tmp_path, capsys):
    root = tmp_path / "runs"
    write_run(root / "pdm-topk-kl-s0", "pdm-topk-kl", 0)
    write_run(root / "plain-trl-s0", "plain-trl", 0, steps=[0, 4])
    assert lr.main(["report", "--runs", str(root), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not comparable" in err and "heldout.jsonl" in err
    assert lr.main(["report", "--runs", str(tmp_path / "none"), "--out", str(tmp_path / "out")]) == 2
    assert "--runs" in capsys.readouterr().err
    only = tmp_path / "only"
    write_run(only / "pdm-topk-kl-s0", "pdm-topk-kl", 0)
    assert lr.main(["report", "--runs", str(only), "--out", str(tmp_path / "out")]) == 2
    assert "plain-trl" in capsys.readouterr().err


def test_mcnemar_is_skipped_for_scores_that_are_not_binary(runs):
    found = lr.load_runs(runs)
    rec = next(r for r in found if r["name"] == "plain-trl-s0")
    rec["heldout"][-1]["scores"][0] = 0.5
    assert lr.summarize(found)["mcnemar"] is None


FAKE = """
import argparse, json, pathlib
p = argparse.ArgumentParser()
p.add_argument('--output-dir'); p.add_argument('--seed', type=int); p.add_argument('--plain-trl', action='store_true')
a, _ = p.parse_known_args()
d = pathlib.Path(a.output_dir)
print('step 1/1  reward 0.50', flush=True)
(d / 'run.json').write_text(json.dumps({'label': 'plain-trl' if a.plain_trl else 'pdm-topk-kl', 'seed': a.seed,
                                         'finished': True}))
"""


def test_the_grid_runs_each_run_once_and_refuses_changed_settings(tmp_path, capsys):
    fake = tmp_path / "fake_example.py"
    fake.write_text(FAKE)
    runs = tmp_path / "runs"
    base = ["run", "--runs", str(runs), "--seeds", "0", "1", "--python", sys.executable, "--example", str(fake),
            "--max-steps", "2"]
    assert lr.main(base + ["--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert "4 run(s) to do" in out and "[plain-trl-s1] step 1/1  reward 0.50" in out
    for name in ("pdm-topk-kl-s0", "pdm-topk-kl-s1", "plain-trl-s0", "plain-trl-s1"):
        args = json.loads((runs / name / "grid.json").read_text())["args"]
        assert args[:4] == ["--model", "smollm2-135m", "--max-steps", "2"] and args[-2:] == ["--seed", name[-1]]
        assert ("--plain-trl" in args) == name.startswith("plain")
        assert "step 1/1" in (runs / name / "train.log").read_text()
    # an unfinished run is redone, the finished ones are skipped
    (runs / "plain-trl-s1" / "run.json").write_text(json.dumps({"finished": False}))
    assert lr.main(base) == 0
    assert "1 run(s) to do" in capsys.readouterr().out
    assert json.loads((runs / "plain-trl-s1" / "run.json").read_text())["finished"] is True
    # other settings over finished runs: one line, no run
    assert lr.main(base[:-1] + ["3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "finished with other arguments" in err


def test_a_failed_run_is_reported(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("import sys; print('Traceback: boom', flush=True); sys.exit(3)\n")
    rc = lr.main(["run", "--runs", str(tmp_path / "runs"), "--seeds", "0", "--labels", "plain-trl", "--python",
                  sys.executable, "--example", str(bad)])
    assert rc == 1
    cap = capsys.readouterr()
    assert "[plain-trl-s0] Traceback: boom" in cap.out and "plain-trl-s0 (exit 3" in cap.err
