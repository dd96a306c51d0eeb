"""pdmask compare: the run plan, and a tiny end-to-end comparison."""

import json

import pytest

from pdmask_lab.compare import plan_runs
from pdmask.train.config import comparable, load_config
from pdmask.train.logging import read_jsonl


def test_plan_runs_modes_seeds_deltas():
    cfg = load_config(None, ["seed=3"])
    runs = plan_runs(cfg, ["grpo", "dppo-topk-kl", "pdm-topk-kl"], 2, [0.05, 0.15], "out")
    names = [r.run_name for r in runs]
    # grpo (a ratio clip) is not swept over deltas; every other mode is, per seed
    assert names == ["grpo-s3", "grpo-s4", "dppo-topk-kl-s3-d0.05", "dppo-topk-kl-s4-d0.05",
                     "pdm-topk-kl-s3-d0.05", "pdm-topk-kl-s4-d0.05", "dppo-topk-kl-s3-d0.15",
                     "dppo-topk-kl-s4-d0.15", "pdm-topk-kl-s3-d0.15", "pdm-topk-kl-s4-d0.15"]
    d = {r.run_name: r for r in runs}
    th = d["pdm-topk-kl-s4-d0.15"].loss.thresholds
    assert th.delta_low == th.delta_high == 0.15
    assert d["grpo-s3"].loss_fields["thresholds"]["delta_high"] is None and all(r.out_dir == "out" for r in runs)
    # identical data: everything but mode/seed/delta/name is shared
    skip = {"loss.mode", "seed", "name", "loss.thresholds.delta_low", "loss.thresholds.delta_high"}
    a, b = comparable(runs[2].to_dict()), comparable(runs[-1].to_dict())
    assert {k: v for k, v in a.items() if k not in skip} == {k: v for k, v in b.items() if k not in skip}


def test_compare_smoke(tmp_path, cache_dir, smoke_config, cli, check_environment):
    run_cli, _ = cli
    out = tmp_path / "cmp"
    run_cli(["compare", "--config", smoke_config, "--modes", "dppo-topk-kl,pdm-topk-kl", "--seeds", "1",
             "--out", out, f"cache_dir={cache_dir}", "progress=false", "tensorboard=false"], cwd=tmp_path)
    res = json.loads((out / "summary.json").read_text())
    assert {r["mode"] for r in res["runs"]} == {"dppo-topk-kl", "pdm-topk-kl"}
    ratio = res["step_time_ratio_interleaved"]["pdm-topk-kl/dppo-topk-kl"]
    assert ratio["ratio"] > 0 and ratio["median_a_s"] > 0
    assert "pdm-topk-kl/dppo-topk-kl" in res["step_time_ratio_runs"]
    # identical data and seeds: the two runs see the same step-1 rollout (same reward)
    a = read_jsonl(out / "dppo-topk-kl-s0" / "metrics.jsonl")
    b = read_jsonl(out / "pdm-topk-kl-s0" / "metrics.jsonl")
    assert a[1]["reward"] == b[1]["reward"] and a[1]["mismatch_topk_kl"] == b[1]["mismatch_topk_kl"]
    assert (out / "report" / "overview.png").exists() and (out / "summary.md").exists()
    # the environment: the compare's (threads: the config's), each run's once, one line in summary.md
    check_environment(res["environment"], threads=1)
    [group] = res["runs_environments"]
    check_environment(group["environment"], threads=1)
    assert sorted(group["runs"]) == ["dppo-topk-kl-s0", "pdm-topk-kl-s0"]
    assert all("environment" not in r for r in res["runs"])
    md = (out / "summary.md").read_text()
    env = res["environment"]
    assert md.splitlines()[0].startswith(f"Environment: torch {env['packages']['torch']}, transformers ")
    assert f"CPU capability {env['cpu_capability']}, 1 torch thread(s) per run" in md
    # no machine path in the compare's records (its out dir and the cache are absolute here)
    for f in (out / "summary.json", out / "summary.md"):
        assert str(tmp_path) not in f.read_text(), f
    assert res["plots"][0].startswith("report/")


@pytest.mark.slow
def test_compare_jobs_2_progress_and_no_checkpoints(tmp_path, cache_dir, smoke_config, cli):
    """``--jobs 2``: each run's start names its log, its end counts the finished runs (the live
    display's events; its lines are tested in test_live.py); ``--keep-checkpoints 0`` leaves
    no checkpoint once a run has finished, and a second call runs nothing that finished."""
    run_cli, _ = cli
    out = tmp_path / "cmp"
    args = ["compare", "--config", smoke_config, "--modes", "dppo-topk-kl,pdm-topk-kl", "--seeds", "1", "--jobs", "2",
            "--no-timing", "--keep-checkpoints", "0", "--out", "cmp", f"cache_dir={cache_dir}", "tensorboard=false"]
    r = run_cli(args, cwd=tmp_path)
    assert "its checkpoints in cmp/<run>/checkpoints/ (none once it has finished" in r.stdout
    for run in ("dppo-topk-kl-s0", "pdm-topk-kl-s0"):
        assert f"started {run} (log: cmp/{run}.log)" in r.stdout
        assert (out / f"{run}.log").exists() and (out / run / "summary.json").exists()
        assert (out / run / "checkpoints").is_dir() and not any((out / run / "checkpoints").iterdir())
    assert "finished" in r.stdout and "(2 of 2 runs)" in r.stdout
    again = run_cli(args, cwd=tmp_path)
    assert "done dppo-topk-kl-s0 (its summary.json exists" in again.stdout and "started" not in again.stdout
    assert json.loads((out / "summary.json").read_text())["runs"]
