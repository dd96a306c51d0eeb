"""The break criteria of the regime sweep (pdmask_lab.regime) on constructed curves: each
criterion fires at the step its definition names, a steady run meets none, and the rung's
verdict and the paired test read the per-seed outcomes."""

from __future__ import annotations

import json

import pytest
import yaml

from pdmask_lab import regime
from pdmask_lab.significance import mcnemar_exact


def recs(n=12, *, entropy=1.0, finish=0.9, length=20.0, mismatch=0.01, evals=None, **over):
    """``n`` steps of steady curves; ``over``: {metric: {step: value}} replaces single steps."""
    out = [{"step": 0, "eval_accuracy": 0.3}]
    for s in range(1, n + 1):
        r = {"step": s, "entropy_mean": entropy, "finish_rate": finish, "response_length": length,
             "mismatch_topk_kl": mismatch}
        for k, by_step in over.items():
            if s in by_step:
                r[k] = by_step[s]
        if evals and s in evals:
            r["eval_accuracy"] = evals[s]
        out.append(r)
    return out


def judge(r, **kw):
    return regime.judge(r, mode=kw.get("mode", "none"), seed=kw.get("seed", 0), max_new_tokens=48, sync_every=3)


def test_a_steady_run_meets_no_criterion():
    j = judge(recs(evals={6: 0.5, 12: 0.45}))  # a drop of 0.05: not 0.15
    assert not j.broken and j.broke == {}


@pytest.mark.parametrize("over, evals, want", [
    ({}, {4: 0.6, 8: 0.50, 12: 0.44}, {"accuracy": 12}),  # 0.6 -> 0.44: 0.16 below the best
    ({"entropy_mean": {s: 0.2 for s in range(6, 13)}}, None, {"entropy": 8}),  # moving mean of 6-8 first < 0.25
    ({"entropy_mean": {s: 2.5 for s in range(9, 13)}}, None, {"entropy": 11}),  # > 2x the start
    ({"finish_rate": {s: 0.3 for s in range(5, 13)}}, None, {"ending": 7}),  # < 0.5 x 0.9
    ({"response_length": {s: 47.0 for s in range(10, 13)}}, None, {"ending": 12}),  # >= 0.95 x 48
    ({"mismatch_topk_kl": {s: 0.1 for s in range(7, 13)}}, None, {"mismatch": 8}),  # cycle mean > 4 x 0.01
])
def test_each_criterion_fires_at_its_first_step(over, evals, want):
    j = judge(recs(evals=evals, **over))
    assert j.broke == want and j.broken


def test_a_dip_inside_the_first_three_steps_is_the_start_not_a_break():
    # the start is the mean of steps 1-3, the test runs from step 4 (moving mean of 2-4 onward)
    j = judge(recs(finish_rate={1: 0.2}))
    assert "ending" not in j.broke


def test_records_without_the_finish_rate_are_not_judged():
    r = recs()
    for x in r:
        x.pop("finish_rate", None)
    assert judge(r) is None


def _run(tmp_path, name, mode, seed, r):
    d = tmp_path / name
    d.mkdir()
    (d / "config.yaml").write_text(yaml.safe_dump({"loss": {"mode": mode}, "seed": seed, "max_new_tokens": 48,
                                                   "sync_every": 3}))
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in r))
    return d


def test_rung_verdict_and_the_paired_test(tmp_path):
    broke = recs(finish_rate={s: 0.1 for s in range(4, 13)})
    runs = [_run(tmp_path, f"none-s{s}", "none", s, broke) for s in range(3)]
    runs += [_run(tmp_path, f"dppo-topk-kl-s{s}", "dppo-topk-kl", s, recs()) for s in range(3)]
    out = regime.rung_breaks(runs, "dppo-topk-kl")
    assert out["verdict"] == "breaks"
    none, dppo = out["modes"]["none"], out["modes"]["dppo-topk-kl"]
    assert (none["k"], none["n"], dppo["k"]) == (3, 3, 0)
    assert none["vs_reference"] == {"reference": "dppo-topk-kl", "n": 3, "only_mode": 3, "only_reference": 0,
                                    "p": mcnemar_exact(3, 0)}
    assert none["finish_start"] == pytest.approx(0.9) and none["finish_end"] == pytest.approx(0.1)
    # the end finish rate, paired by seed: 0.1 - 0.9 on each of the 3 seeds; exact sign-flip p = 2/2^3
    fin = none["finish_end_vs_reference"]
    assert fin["estimate"] == pytest.approx(-0.8) and (fin["n"], fin["wins"], fin["losses"]) == (3, 0, 3)
    assert fin["p"] == pytest.approx(0.25) and dppo["finish_end_vs_reference"] is None
    # the guard breaking too, and a stable unguarded run
    runs.append(_run(tmp_path, "dppo-topk-kl-s3", "dppo-topk-kl", 3, broke))
    assert regime.rung_breaks(runs, "dppo-topk-kl")["verdict"] == "both break"
    assert regime.verdict({"none": {"k": 0}}) == "stable" and regime.verdict({"none": {"k": 1}}) == "no guard run"
    # a flat-keys config (run directories written before the nested loss spec) reads too
    old = _run(tmp_path, "old", "x", 0, broke)
    (old / "config.yaml").write_text(yaml.safe_dump({"mode": "none", "seed": 5, "max_new_tokens": 48}))
    j = regime.judge_run(old)
    assert (j.mode, j.seed, j.broken) == ("none", 5, True)


def test_the_report_table_has_one_row_per_rung_and_mode(tmp_path):
    runs = [_run(tmp_path, "none-s0", "none", 0, recs(finish_rate={s: 0.1 for s in range(4, 13)})),
            _run(tmp_path, "dppo-topk-kl-s0", "dppo-topk-kl", 0, recs())]
    rep = {"reference": "dppo-topk-kl", "rungs": [{"name": "hot", "breaks": regime.rung_breaks(runs, "dppo-topk-kl")},
                                                  {"name": "old", "modes": []}]}
    h, rows = regime.breaks_rows(rep)
    assert h[-2:] == ["Δ broke vs dppo-topk-kl (McNemar)", "Δ end finish rate vs dppo-topk-kl (sign-flip)"]
    assert len(rows) == 2 and rows[0][-1] == "-0.80, 0 up / 1 down of 1 seeds, p = 1" and rows[1][-1] == "-"
    assert rows[0][:5] == ["hot", "breaks", "none", "1/1 [0.02, 1.00]", "s0: ending @5"]  # 0.025 in float: 0.0249..
    assert rows[1][2:5] == ["dppo-topk-kl", "0/1 [0.00, 0.98]", "s0: -"]


# ------------------------------------------------------------------ the stale-engine criteria
def stale(r, sync_every=8):
    return regime.judge_stale(r, sync_every=sync_every)


def test_a_steady_learning_run_meets_no_stale_criterion():
    r = recs(24, evals={4: 0.4, 8: 0.5, 24: 0.6})
    for x in r:
        if "eval_accuracy" in x:
            x["eval_finished"] = 0.95
    assert stale(r) == {}


@pytest.mark.parametrize("over, evals, finished, want", [
    # the sampled finish rate: <= half its start (0.9 -> 0.45 exactly is a break: the comparison is <=)
    ({"finish_rate": {s: 0.45 for s in range(5, 25)}}, {24: 0.6}, None, {"ending_sampled": 7}),
    ({"finish_rate": {s: 0.46 for s in range(5, 25)}}, {24: 0.6}, None, {}),
    # greedy answers: at most half end at an eval after step 0 (<=)
    ({}, {8: 0.5, 24: 0.6}, {8: 0.5}, {"ending_greedy": 8}),
    ({}, {8: 0.5, 24: 0.6}, {8: 0.51}, {}),
    # accuracy 0.15 below its running best (>=), and the end below start + 0.15 (<)
    ({}, {8: 0.6, 24: 0.44}, None, {"accuracy": 24, "no_learning": 24}),
    ({}, {8: 0.8, 24: 0.64}, None, {"accuracy": 24}),
    ({}, {24: 0.44}, None, {"no_learning": 24}),
    ({}, {24: 0.45}, None, {}),
    # the mismatch: a sync cycle's mean above 10 fp8 floors (0.0931), one bar for every mode
    ({"mismatch_topk_kl": {s: 0.1 for s in range(1, 25)}}, {24: 0.6}, None, {"mismatch": 8}),
    ({"mismatch_topk_kl": {s: 0.09 for s in range(1, 25)}}, {24: 0.6}, None, {}),
])
def test_each_stale_criterion_fires_at_its_threshold(over, evals, finished, want):
    r = recs(24, evals=evals, **over)
    for x in r:
        if "eval_accuracy" in x:
            x["eval_finished"] = (finished or {}).get(x["step"], 0.95)
    assert stale(r) == want


def test_entropy_collapse_counts_only_with_another_criterion():
    collapse = {"entropy_mean": {s: 0.1 for s in range(5, 25)}}
    r = recs(24, evals={24: 0.6}, **collapse)
    assert stale(r) == {}  # collapsed, but learned and kept ending: not counted
    r = recs(24, evals={24: 0.3}, **collapse)
    assert stale(r) == {"no_learning": 24, "entropy": 7}


def test_every_stale_criterion_has_its_definition():
    assert tuple(regime.STALE_DEFINITIONS) == regime.STALE_CRITERIA
    # the fp8 floor is the task statistics' lag-0 fp8 mean top-K KL
    from pathlib import Path
    md = (Path(__file__).resolve().parents[2] / "docs/results/real-lm/task_stats.md").read_text()
    row = next(ln for ln in md.splitlines() if ln.startswith("| topk_kl, mean"))
    assert float(row.split("|")[3]) == regime.FP8_FLOOR_TOPK_KL
