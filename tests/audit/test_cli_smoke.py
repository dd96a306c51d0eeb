"""A subprocess smoke run of ``pdmask audit`` with tiny settings produces the outputs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the audit CLI needs the 'train' extra (transformers)")
pytest.importorskip("typer", reason="the audit CLI needs the 'train' extra (typer)")

SRC = Path(__file__).resolve().parents[2] / "src"
TINY = ["vocab_size=300", "hidden_size=32", "intermediate_size=64", "num_layers=1", "num_heads=2",
        "train_size=300", "eval_size=8", "sft_steps=0", "prompts_per_step=2",
        "group_size=4", "max_new_tokens=6", "threads=1", "top_k=5"]


@pytest.mark.slow
def test_cli_smoke(tmp_path, check_environment):
    out = tmp_path / "audit"
    args = [sys.executable, "-m", "pdmask.cli", "audit", "--out", str(out), "--seeds", "2",
            "--precision", "fp8-bf16", "--delta", "1e-4", "--sample-tokens", "2", "--disagreement-tokens", "2",
            "--bootstrap", "50", "--no-progress", "--set", f"cache_dir={tmp_path / 'cache'}"]
    for kv in TINY:
        args += ["--set", kv]
    # the random tiny model never writes "answer: N": a reward that varies within a group, so
    # the batches have tokens with A != 0 (the audit refuses to write tables without them)
    (tmp_path / "sig_reward.py").write_text("def parity(response, answer):\n    return float(len(response) % 2)\n")
    args += ["--set", "reward=sig_reward:parity", "--lag", "1", "--set", "lr=0.05"]  # lag: D > delta somewhere
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "PDMASK_CACHE": str(tmp_path / "cache")}
    res = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    for f in ("audit.json", "audit.md", "audit_tokens.npz", "rates.png", "fidelity.png", "scatter.png"):
        assert (out / f).stat().st_size > 0, f
    doc = json.loads((out / "audit.json").read_text())
    assert doc["settings"]["audit"]["loss"]["thresholds"]["delta_low"] == 1e-4
    assert doc["settings"]["run"]["engine_precision"] == "fp8-bf16"
    assert len(doc["summary"]["per_seed"]) == 2
    assert doc["summary"]["per_seed"][0]["n_response_tokens"] > 0
    # the fidelity sweep's K is capped at V = 300, so 100 is the largest K
    assert max(map(int, doc["summary"]["fidelity"]["response"]["sign_agreement"])) == 100
    assert "## Definitions (ours)" in (out / "audit.md").read_text()
    check_environment(doc["environment"], threads=1)  # the trainer config's threads (TINY)
    assert f"Environment: torch {doc['environment']['packages']['torch']}" in (out / "audit.md").read_text()
    assert sorted(p.name for p in (out / "seeds").glob("seed-*")) == ["seed-000000.safetensors",
                                                                      "seed-000001.safetensors"]
    # the headline on stdout: the token counts, then the batch step's tests with their p
    s = doc["summary"]["per_seed"]
    lines = res.stdout.splitlines()
    assert lines[0] == (f"2 seeds, {sum(x['n_response_tokens'] for x in s)} response tokens, "
                        f"{sum(x['n_out_of_region'] for x in s)} out-of-region tokens, "
                        f"{sum(x['n_disagreement']['pred-exact'] for x in s)} disagreement tokens (pred-exact vs ratio)")
    assert lines[0] in (out / "audit.md").read_text()
    assert lines[1].startswith("batch step, O (") and "McNemar p" in lines[1]
    # no machine path in what it wrote (the out dir, the cache and the interpreter are absolute here)
    for f in [*out.glob("*.json"), *out.glob("*.md"), *(out / "seeds").glob("*.json")]:
        text = f.read_text()
        assert str(tmp_path) not in text and sys.executable not in text, f
    assert doc["settings"]["run"]["command"].startswith("pdmask audit --out audit --seeds 2")
    assert doc["settings"]["run"]["checkpoint"].startswith("$PDMASK_CACHE/sft-")

    # resumable per seed, in 2 worker processes: a third seed is added, the first two are reused
    res = subprocess.run(args[:args.index("--seeds")] + ["--seeds", "3", "--jobs", "2"] + args[args.index("--seeds") + 2:],
                         capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming, 2 of 3 seeds" in res.stderr
    doc3 = json.loads((out / "audit.json").read_text())
    assert [s["seed"] for s in doc3["summary"]["per_seed"]] == [0, 1, 2]
    assert doc3["summary"]["per_seed"][:2] == doc["summary"]["per_seed"]  # the same seeds, not redone
    # other settings in the same directory are refused (one line), --fresh starts over
    bad = args + ["--lr", "1e-2"]
    res = subprocess.run(bad, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert res.returncode == 2 and "error: out:" in res.stderr and "audit.lr" in res.stderr


def test_cli_bad_option_is_an_error(tmp_path):
    """`pdmask audit` (the main app's command) refuses a bad option with one line, exit 2."""
    from typer.testing import CliRunner

    from pdmask.cli import app

    res = CliRunner().invoke(app, ["audit", "--divergence", "binary_kl", "--out", str(tmp_path / "audit"),
                                   "--set", f"cache_dir={tmp_path}"])
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith("error: divergence:") and res.stderr.count("\n") == 1
    assert not (tmp_path / "audit").exists()  # refused before any work


def test_audit_of_a_run_directory(tmp_path, smoke_cache):
    """`pdmask train` (smoke preset) then `pdmask audit --model RUN_DIR`: the run's config,
    trainer weights, stale engine weights and AdamW state are picked up."""
    repo = SRC.parent
    env = {**os.environ, "PYTHONPATH": str(SRC), "PDMASK_CACHE": str(smoke_cache)}
    train = [sys.executable, "-m", "pdmask.cli", "train", "--config", str(repo / "configs" / "smoke.yaml"),
             f"out_dir={tmp_path / 'runs'}", f"cache_dir={smoke_cache}", "progress=false", "tensorboard=false",
             "steps=2", "checkpoint_every=1"]
    res = subprocess.run(train, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "runs" / "smoke"
    out = tmp_path / "audit"
    (tmp_path / "sig_reward.py").write_text("def parity(response, answer):\n    return float(len(response) % 2)\n")
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(tmp_path)])  # a reward with signal for this tiny model
    res = subprocess.run([sys.executable, "-m", "pdmask.cli", "audit", "--model", str(run), "--out", str(out),
                          "--seeds", "1", "--delta", "1e-5", "--sample-tokens", "2", "--disagreement-tokens", "1",
                          "--bootstrap", "20", "--no-progress", "--no-plots", "--set", "reward=sig_reward:parity"],
                         capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads((out / "audit.json").read_text())
    r = doc["settings"]["run"]
    assert r["kind"] == "run-directory" and r["run_checkpoint"].endswith("step-000002")
    assert r["optimizer_state"] == "the run's AdamW state"
    assert r["engine_weights"].startswith("from the checkpoint")
    assert r["vocab_size"] == 400  # the smoke preset's model, not the default one
    assert doc["settings"]["run"]["trainer_config"]["name"] == "smoke"


def test_audit_grid_smoke(tmp_path, smoke_cache):
    """`pdmask audit-grid` on two tiny cells (tied / untied): grid.json, grid.md, grid.png,
    one report per cell; a rerun reuses every seed."""
    out = tmp_path / "grid"
    # the smoke preset (a 40-step SFT base, partial-credit reward: advantages are not all 0)
    args = [sys.executable, "-m", "pdmask.cli", "audit-grid", "--out", str(out), "--ties", "tied,untied",
            "--vocab", "400", "--hidden", "32", "--seeds", "2", "--precision", "fp8-bf16", "--delta", "1e-4",
            "--lag", "1", "--sample-tokens", "2", "--bootstrap", "50", "--no-progress",
            "--config", str(SRC.parent / "configs" / "smoke.yaml"), "--set", f"cache_dir={smoke_cache}",
            "--set", "threads=1", "--set", "prompts_per_step=8"]
    env = {**os.environ, "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PDMASK_CACHE": str(smoke_cache)}
    res = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    g = json.loads((out / "grid.json").read_text())
    assert list(g["cells"]) == ["tied-V400-H32", "untied-V400-H32"]
    for name, cell in g["cells"].items():
        assert (out / name / "audit.json").exists() and cell["n_seeds"] == 2
        assert cell["head_share"] is None or 0 <= cell["head_share"] <= 1
    assert (out / "grid.png").stat().st_size > 0 and "| tied-V400-H32 |" in (out / "grid.md").read_text()
    # the untied cell really has its own output layer: its records' cross term is 0
    import numpy as np
    z = np.load(out / "untied-V400-H32" / "audit_tokens.npz")
    m = np.isfinite(z["ip_cross"])
    assert m.any() and np.all(z["ip_cross"][m] == 0)
    z = np.load(out / "tied-V400-H32" / "audit_tokens.npz")
    assert np.any(z["ip_cross"][np.isfinite(z["ip_cross"])] != 0)
    res = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert res.returncode == 0 and res.stderr.count("resuming, 2 of 2 seeds") == 2, res.stderr[-2000:]
