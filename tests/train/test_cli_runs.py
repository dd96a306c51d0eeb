"""End-to-end runs through the CLI in subprocesses (tiny smoke preset)."""

import json
import signal
import time

import pytest

from pdmask.train.grpo import TIME_KEYS
from pdmask.train.logging import read_jsonl



def test_smoke_run_writes_outputs(tmp_path, cache_dir, smoke_config, cli, check_environment):
    SMOKE, (run_cli, _) = smoke_config, cli
    p = run_cli(["train", "--config", SMOKE, f"cache_dir={cache_dir}", f"out_dir={tmp_path}", "progress=false"],
                cwd=tmp_path)
    run = tmp_path / "smoke"
    recs = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in recs] == [0, 1, 2, 3, 4]
    assert recs[0]["eval_accuracy"] is not None and "reward" in recs[1]
    for r in recs[1:]:
        for k in ("reward", "mismatch_topk_kl", "kept_frac", "out_of_region_frac", "disagreement_frac",
                  "entropy_mean", "grad_norm", "tokens_per_s"):
            assert r[k] is not None and r[k] == r[k], k  # present and not NaN
        assert 0.0 <= r["kept_frac"] <= 1.0
    assert [r["step"] for r in recs if "eval_accuracy" in r] == [0, 2, 4]
    assert list((run / "tb").glob("events.out.tfevents.*"))
    assert (run / "checkpoints" / "step-000004" / "model.safetensors").exists()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["mode"] == "pdm-topk-kl"
    # the run records what it used (issue 42): the resolved deltas, the cap, the mode's parts
    import yaml

    stored = yaml.safe_load((run / "config.yaml").read_text())
    used = {k: v for k, v in stored["loss"]["thresholds"].items() if k.startswith("delta")}
    assert None not in used.values() and stored["loss"]["corrections"]["is_cap"] is not None
    assert {k: summary[k] for k in used} == used and summary["is_cap"] == stored["loss"]["corrections"]["is_cap"]
    assert stored["mode_spec"] == {"surrogate": summary["surrogate"], "divergence": summary["divergence"]} == {
        "surrogate": "dppo", "divergence": "topk_kl"}
    check_environment(summary["environment"], threads=1)  # the run's own record (threads: the config's)
    assert summary["environment"]["torch_threads"] == 1  # set by the run before it recorded
    assert "eval_accuracy_final" in p.stdout  # the final table
    # report overlays the run into PNGs
    run_cli(["report", run, "--out", tmp_path / "rep"], cwd=tmp_path)
    for name in ("eval_accuracy", "reward", "mismatch", "mask_fractions", "overview"):
        assert (tmp_path / "rep" / f"{name}.png").stat().st_size > 10_000
    # its summary (rebuilt by report, next to the PNGs) carries the run's environment once
    rep = json.loads((tmp_path / "rep" / "summary.json").read_text())
    assert rep["environment"] == summary["environment"] | {"source": "the runs"}
    assert rep["runs_environments"] == [{"environment": summary["environment"], "runs": ["smoke"]}]
    assert "environment" not in rep["runs"][0]
    assert f"Environment: torch {summary['environment']['packages']['torch']}" in (tmp_path / "rep" / "summary.md").read_text()


def test_cli_rejects_unknown_key(tmp_path, smoke_config, cli):
    SMOKE, (run_cli, _) = smoke_config, cli
    p = run_cli(["train", "--config", SMOKE, "stpes=3"], cwd=tmp_path, check=False)
    assert p.returncode == 2
    assert "stpes" in p.stderr and "valid names are" in p.stderr


def _strip(recs):
    return [{k: v for k, v in r.items() if k not in TIME_KEYS} for r in recs]


def test_resume_after_sigkill_matches_uninterrupted(tmp_path, cache_dir, smoke_config, cli):
    """Kill a run mid-step (after step 5 was logged, checkpoint at 4), resume: no lost or
    duplicated steps, and every non-timing metric equals the uninterrupted run's."""
    SMOKE, (run_cli, popen_cli) = smoke_config, cli
    common = ["train", "--config", SMOKE, f"cache_dir={cache_dir}", "progress=false", "steps=8",
              "checkpoint_every=2", "tensorboard=false", "engine_precision=fp8", "sync_every=2"]
    run_cli(common + [f"out_dir={tmp_path / 'a'}"], cwd=tmp_path)
    ref = read_jsonl(tmp_path / "a" / "smoke" / "metrics.jsonl")
    assert [r["step"] for r in ref] == list(range(9))
    assert sum(r["grad_norm"] > 0 for r in ref[5:]) >= 2  # real updates after the kill point

    out_b = tmp_path / "b"
    proc = popen_cli(common + [f"out_dir={out_b}"], cwd=tmp_path)
    metrics = out_b / "smoke" / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        if any(r["step"] == 5 for r in read_jsonl(metrics)):
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait(timeout=30)
    if proc.returncode == 0:
        pytest.fail("the run finished before it could be killed; make it longer")
    killed = read_jsonl(metrics)
    assert max(r["step"] for r in killed) < 8
    run_cli(common + [f"out_dir={out_b}", "--resume"], cwd=tmp_path)
    got = read_jsonl(metrics)
    assert [r["step"] for r in got] == list(range(9))  # nothing lost, nothing twice
    assert _strip(got) == _strip(ref)


def test_model_path_runs_without_sft(tmp_path, cache_dir, smoke_config, cli):
    """--model PATH: any local HF causal-LM directory (here the cached smoke SFT base)."""
    run_cli, _ = cli
    run_cli(["train", "--config", smoke_config, f"cache_dir={cache_dir}", f"out_dir={tmp_path}", "progress=false",
             "steps=1", "tensorboard=false"], cwd=tmp_path)
    bases = sorted(cache_dir.glob("sft-*"))
    assert bases and (bases[0] / "config.json").exists() and (bases[0] / "tokenizer.json").exists()
    run_cli(["train", "--config", smoke_config, "--model", bases[0], "sft_steps=0", f"out_dir={tmp_path}",
             "name=frompath", "progress=false", "steps=2", "tensorboard=false"], cwd=tmp_path)
    recs = read_jsonl(tmp_path / "frompath" / "metrics.jsonl")
    assert [r["step"] for r in recs] == [0, 1, 2]
