"""benchmarks/bench_batch_paired.py: paired differences and collapse counts on hand-made runs."""

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("bench_batch_paired", ROOT / "benchmarks" / "bench_batch_paired.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(root: Path, mode: str, seed: int, evals: list[float], *, finished: bool = True) -> None:
    d = root / f"{mode}-s{seed}"
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"mode": mode, "seed": seed, "sync_every": 1}))
    recs = [{"step": 0, "eval_accuracy": evals[0]}]
    for i, a in enumerate(evals[1:], 1):  # one RL step per eval: 100 tokens, 2 masked
        recs.append({"step": i, "num_tokens": 100, "masked_frac": 0.02, "mismatch_topk_kl": 0.01 * i,
                     "eval_accuracy": a})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    if finished:
        (d / "summary.json").write_text("{}")


@pytest.fixture
def runs(tmp_path):
    # step-0 (SFT) accuracy 0.1 everywhere; the last entry is the final accuracy.
    curves = {
        "pdm-batch-topk-kl": [[0.1, 0.5, 0.6], [0.1, 0.7, 0.5], [0.1, 0.6, 0.7]],  # seed 1: drop 0.2 -> collapsed
        "dppo-topk-kl": [[0.1, 0.4, 0.5], [0.1, 0.5, 0.5], [0.1, 0.5, 0.6]],  # never collapses
        "pdm-topk-kl": [[0.1, 0.6, 0.7], [0.1, 0.3, 0.4], [0.1, 0.12, 0.05]],  # seed 2: final < SFT -> collapsed
    }
    for mode, cs in curves.items():
        for s, c in enumerate(cs):
            _run(tmp_path, mode, s, c)
    _run(tmp_path, "pdm-batch-topk-kl", 3, [0.1, 0.2], finished=False)  # unfinished: left out
    _run(tmp_path, "grpo", 0, [0.1, 0.2, 0.3])  # another mode: ignored
    return tmp_path


def test_paired_differences_and_collapse(runs):
    m = _script()
    res = m.paired(runs, "pdm-batch-topk-kl", ["dppo-topk-kl", "pdm-topk-kl"], 0.15)
    assert any("pdm-batch-topk-kl-s3" in n for n in res["notes"])
    assert set(res["per_mode"]) == {"pdm-batch-topk-kl", "dppo-topk-kl", "pdm-topk-kl"}
    pb = res["per_mode"]["pdm-batch-topk-kl"]
    assert pb["n_seeds"] == 3 and pb["collapsed_seeds"] == [1]
    assert pb["eval_final"] == pytest.approx((0.6 + 0.5 + 0.7) / 3)
    assert res["per_mode"]["pdm-topk-kl"]["collapsed_seeds"] == [2]
    assert res["per_mode"]["dppo-topk-kl"]["collapsed"] == 0
    assert pb["mismatch_mean"] == pytest.approx(0.015)  # steps 1, 2: 0.01, 0.02
    assert pb["masked_pooled"]["estimate"] == pytest.approx(0.02)

    vd = res["vs"]["dppo-topk-kl"]
    # final: d = (0.1, 0, 0.1): mean 0.0667; of the 8 sign vectors, the 4 with s0 = s2 reach |sum| = 0.2
    assert vd["n"] == 3
    assert vd["eval_final"]["estimate"] == pytest.approx(0.2 / 3)
    assert vd["eval_final"]["p"] == pytest.approx(0.5)
    # last-5 evals (all 3 evals here): d = (1.2 - 1.0, 1.3 - 1.1, 1.4 - 1.2) / 3 = 0.2/3 each, all positive
    assert vd["eval_last5"]["estimate"] == pytest.approx(0.2 / 3)
    assert vd["eval_last5"]["p"] == pytest.approx(0.25)  # 2 of the 8 sign vectors (all + or all -)
    assert vd["collapse"] == {"only_mode": 1, "only_reference": 0, "p": pytest.approx(1.0)}

    vp = res["vs"]["pdm-topk-kl"]
    assert vp["eval_final"]["estimate"] == pytest.approx((-0.1 + 0.1 + 0.65) / 3)
    assert vp["collapse"]["only_mode"] == 1 and vp["collapse"]["only_reference"] == 1


def test_main_writes_json_and_markdown(runs, tmp_path):
    m = _script()
    out = tmp_path / "res" / "paired"
    assert m.main([str(runs), "--out", str(out), "--label", "toy"]) == 0
    md = out.with_suffix(".md").read_text()
    assert "### toy" in md and "| dppo-topk-kl | 3 |" in md
    assert json.loads(out.with_suffix(".json").read_text())["vs"]["pdm-topk-kl"]["n"] == 3


def test_missing_reference_is_one_line(runs, tmp_path, capsys):
    m = _script()
    assert m.main([str(runs), "--references", "no-such-mode", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert "no-such-mode" in err and "\n" not in err
