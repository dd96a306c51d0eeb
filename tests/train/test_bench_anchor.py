"""benchmarks/bench_anchor_step.py: the ratios on hand-made times, and one round end to end on the
smoke preset (the trainer's own pieces, every variant from the same state)."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def bench():
    spec = importlib.util.spec_from_file_location("bench_anchor_step", ROOT / "benchmarks" / "bench_anchor_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ratios_are_medians_of_the_per_round_ratios_to_the_baseline():
    b = bench()
    times = {"rollout": {"start": [0.0, 0.0, 0.0], "updates": [2.0, 4.0, 2.0], "step": [10.0, 20.0, 10.0]},
             "old": {"start": [1.0, 1.0, 4.0], "updates": [2.0, 4.0, 2.0], "step": [11.0, 21.0, 14.0]}}
    base = {"rollout": "rollout", "old": "rollout"}
    r = b.ratios(times, base)
    assert r["rollout"] == {"train": 1.0, "updates": 1.0, "step": 1.0}
    # per round: train 3/2, 5/4, 6/2 -> median 1.5; step 1.1, 1.05, 1.4 -> 1.1 (not the ratio of medians, 14/10)
    assert r["old"]["train"] == pytest.approx(1.5) and r["old"]["step"] == pytest.approx(1.1)
    assert r["old"]["updates"] == 1.0
    md = b.table(times, base, [8.0, 9.0, 7.0])
    assert "| old | rollout | 1.00 | 2.00 | 14.00 | 1.500 | 1.100 |" in md and "median 8.00 s" in md


def test_one_round_on_the_smoke_preset(cache_dir, smoke_config, tmp_path):
    b = bench()
    res = b.main(["--config", str(smoke_config), "--prompts", "2", "--group", "2", "--rounds", "1",
                  "--variants", "rollout,old,old-cache,rollout-cache", "--out", str(tmp_path),
                  f"cache_dir={cache_dir}", "num_layers=2", "train_blocks=1"])
    assert set(res["times"]) == {"rollout", "old", "old + cache", "rollout + cache"}
    for t in res["times"].values():
        assert len(t["step"]) == 1 and t["step"][0] > t["updates"][0] > 0
    assert res["times"]["rollout"]["start"][0] < res["times"]["old"]["start"][0]  # no forward before the updates
    assert res["ratios"]["rollout"] == {"train": 1.0, "updates": 1.0, "step": 1.0}
    assert (tmp_path / "bench.md").read_text().count("\n| ") == 5 and (tmp_path / "bench.json").exists()
    # the cache changes no bit of the losses (one epoch), and the record says so
    assert res["loss_rel_diff_to_uncached"] == {"old + cache": 0.0, "rollout + cache": 0.0}
    assert "old + cache 0, rollout + cache 0." in (tmp_path / "bench.md").read_text()


def test_loss_agreement_pairs_each_cached_variant_with_its_uncached_step():
    b = bench()
    got = b.loss_agreement({"old": [2.0, -4.0], "old + cache": [2.0, -4.4], "rollout": [1.0]})
    assert got == {"old + cache": pytest.approx(0.1)}


def test_a_variant_without_its_baseline_is_refused():
    with pytest.raises(SystemExit, match="the baseline 'rollout' of a variant is not in the list"):
        bench().main(["--variants", "old"])
    with pytest.raises(SystemExit, match="unknown variant 'fast'"):
        bench().main(["--variants", "rollout,fast"])
