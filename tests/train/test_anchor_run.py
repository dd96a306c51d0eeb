"""``anchor: old`` in the built-in trainer (issue 44): a smoke run writes the where-it-binds
metrics, its first mini-batch starts at pi = pi_old, config.yaml records the anchor, and the
greedy answers of the first held-out prompts are kept per eval; the mu anchor's run is the same
run as before the anchor existed (its records carry the new metrics, its numbers are unchanged)."""

import json

import pytest
import yaml

from pdmask.train.logging import read_jsonl

BINDS = ("mb1_out_of_region_frac", "mb2_out_of_region_frac", "mb1_masked_frac", "mb2_masked_frac",
         "mb1_divergence_q90", "masked_share_pos_adv", "masked_share_neg_adv", "out_before_update_frac",
         "start_divergence_mean", "start_divergence_q90", "mu_region_out_frac_at_start")


def _run(run_cli, smoke, cache_dir, out, *extra):
    run_cli(["train", "--config", smoke, f"cache_dir={cache_dir}", f"out_dir={out}", "progress=false", "steps=2",
             "minibatches=2", "eval_every=1", *extra], cwd=out)
    return read_jsonl(out / "smoke" / "metrics.jsonl")


def test_anchor_old_writes_where_the_region_binds(tmp_path, cache_dir, smoke_config, cli):
    run_cli, _ = cli
    recs = _run(run_cli, smoke_config, cache_dir, tmp_path, "anchor=old", "eval_answers=3", "delta_low=1e-4",
                "delta_high=1e-4")
    for r in recs[1:]:
        for k in BINDS + ("behaviour_weight_mean", "anchor_divergence_q90"):
            assert r[k] is not None and r[k] == r[k], k
        # mini-batch 1 is updated from pi_old itself: no token out of its region before any update
        assert r["mb1_out_of_region_frac"] == 0.0 and r["out_before_update_frac"] == 0.0
        assert r["mb1_divergence_q90"] < 1e-5 < r["mb2_divergence_q90"]
        # the engine mismatch is D(mu, pi_old), not the anchored statistics' D(pi_old, pi) = 0
        assert r["mismatch_topk_kl"] > 0 and r["mismatch_abs_log_ratio"] > 0
    cfg = yaml.safe_load((tmp_path / "smoke" / "config.yaml").read_text())
    assert cfg["loss"]["anchor"] == "old"
    # step 1 starts from the same weights and the same rollout under either anchor: the same mismatch
    (tmp_path / "mu").mkdir()
    ref = _run(run_cli, smoke_config, cache_dir, tmp_path / "mu", "delta_low=1e-4", "delta_high=1e-4")
    for k in ("mismatch_topk_kl", "mismatch_abs_log_ratio"):
        assert recs[1][k] == pytest.approx(ref[1][k], rel=1e-4), k
    answers = [json.loads(ln) for ln in (tmp_path / "smoke" / "eval_answers.jsonl").read_text().splitlines()]
    assert [a["step"] for a in answers] == [0, 1, 2] and all(len(a["answers"]) == 3 for a in answers)


def test_the_mu_anchor_warns_once_when_the_region_starts_out(tmp_path, cache_dir, smoke_config, cli):
    """A delta below the engine's own noise: most tokens are out before any update; one warning."""
    run_cli, _ = cli
    p = run_cli(["train", "--config", smoke_config, f"cache_dir={cache_dir}", f"out_dir={tmp_path}",
                 "progress=false", "steps=2", "minibatches=2", "delta_low=1e-12", "delta_high=1e-12",
                 "engine_precision=fp8"], cwd=tmp_path)
    out = p.stdout + p.stderr
    assert out.count("out of region before any update") == 1, out[-2000:]
    assert "try delta" in out
    recs = read_jsonl(tmp_path / "smoke" / "metrics.jsonl")
    assert recs[1]["out_before_update_frac"] > 0.05
    assert recs[1]["out_before_update_frac"] == recs[1]["mb1_out_of_region_frac"]
