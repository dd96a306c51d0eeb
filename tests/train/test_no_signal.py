"""A batch with no token of A != 0 is reported, not trained or audited on in silence: the
trainer warns in one line with counts, and the audit refuses to write empty tables."""

import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
TINY = ["vocab_size=300", "hidden_size=32", "intermediate_size=64", "num_layers=1", "num_heads=2",
        "train_size=300", "eval_size=8", "sft_steps=0", "prompts_per_step=2",
        "group_size=4", "max_new_tokens=6", "threads=1", "top_k=5"]


def _run(args, tmp_path):
    (tmp_path / "zero_reward.py").write_text("def zero(response, answer):\n    return 0.0\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "PDMASK_CACHE": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, "-m", "pdmask.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=tmp_path)


def test_training_on_a_flat_batch_warns_with_counts(tmp_path):
    res = _run(["train", "--config", str(SRC.parent / "configs" / "smoke.yaml"), *TINY, "steps=2",
                "reward=zero_reward:zero", f"out_dir={tmp_path}", "progress=false", "eval_every=100",
                "checkpoint_every=0"], tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout + res.stderr
    lines = [x for x in out.splitlines() if "no token with A != 0" in x]
    assert len(lines) == 2, out[-2000:]  # one per step
    assert "step 0:" in lines[0] and "all 2 groups are flat (0 of 8 samples rewarded" in lines[0]


def test_the_audit_refuses_empty_tables(tmp_path):
    out = tmp_path / "audit"
    args = ["audit", "--out", str(out), "--seeds", "2", "--delta", "1e-4", "--sample-tokens", "2",
            "--bootstrap", "50", "--no-progress", "--no-plots", "--set", "reward=zero_reward:zero"]
    for kv in TINY:
        args += ["--set", kv]
    res = _run(args, tmp_path)
    assert res.returncode != 0
    err = res.stderr.strip().splitlines()
    assert err[-1].startswith("error: audit: 0 tokens with A != 0 in 2 seeds"), res.stderr[-2000:]
    assert sum("Traceback" in x for x in err) == 0
    assert sum("seed 0: no token with A != 0" in x for x in err) == 1  # the per-seed warning came first
    assert not (out / "audit.json").exists() and not (out / "audit.md").exists()
