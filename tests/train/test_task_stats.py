"""``pdmask task-stats``: the measurements agree with their definitions on a tiny model."""

import json

import pytest

from pdmask.train.config import TrainConfig
from pdmask_lab.task_stats import task_stats, task_stats_md, write_task_stats

TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, train_size=300,
            eval_size=8, sft_steps=0, prompts_per_step=2, group_size=4, max_new_tokens=6, threads=1,
            reward="answer+format")


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    cfg = TrainConfig(**TINY, top_k=300, cache_dir=str(cache)).validate()  # K = V: nothing beyond the top-K
    return task_stats(cfg, precisions=["fp32", "fp8-bf16"], batches=2)


def test_with_k_equal_to_v_the_tail_is_empty_and_topk_kl_is_the_full_kl(doc):
    for prec, s in doc["precisions"].items():
        assert s["n_batches"] == 2 and s["n_responses"] == 16 and s["n_tokens"] > 0
        assert s["tail_beyond_topk"]["mean"] < 1e-5 and s["tail_over_1pct"] == 0.0
        # (the untrained tiny model is near uniform: both KLs are at float32 rounding, ~1e-6)
        assert s["topk_kl"]["mean"] == pytest.approx(s["full_kl"]["mean"], abs=1e-5)
        assert 0.0 <= s["accuracy"] <= 1.0 and 0.0 <= s["groups_with_signal"] <= 1.0
        assert 0.0 <= s["finished"] <= 1.0 and 0 < s["response_length"] <= 6
        q = [s["topk_kl"][k] for k in ("q10", "q25", "q50", "q75", "q90", "q95", "q99")]
        assert q == sorted(q)
        # |pi_k - mu_k| (DRPO's distance) is at most 1 and at most the full TV
        tv = [s["binary_tv"][k] for k in ("q10", "q50", "q90", "q99")]
        assert tv == sorted(tv) and 0.0 <= tv[0] and tv[-1] <= 1.0
    # fp32 engine at the trainer's weights: no mismatch
    assert max(doc["precisions"]["fp32"][k]["mean"] for k in ("full_kl", "topk_kl")) < 1e-5


def test_written_files(doc, tmp_path):
    files = write_task_stats(doc, tmp_path / "ts", "pdmask task-stats --batches 2")
    j = json.loads(files[0].read_text())
    assert j["command"] == "pdmask task-stats --batches 2" and set(j["precisions"]) == {"fp32", "fp8-bf16"}
    md = files[1].read_text()
    assert md == task_stats_md(doc, "pdmask task-stats --batches 2") and "| groups with A != 0 |" in md
    assert "| binary_tv, q90 |" in md


def test_batches_must_be_positive():
    with pytest.raises(ValueError, match="^batches: must be >= 1"):
        task_stats(TrainConfig(**TINY).validate(), precisions=["fp32"], batches=0)
