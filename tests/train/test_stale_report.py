"""The stale-engine comparison's report (pdmask_lab.stale_report) on constructed records with
known answers: runs grouped by label (a MODE@old variant never merged with MODE), each
criterion counted on its own with McNemar against each versus label, the paired final
accuracy / AUC, the token-pooled anchor diagnostics, the by-lag table, the answers page and
the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pdmask_lab import stale_report as sr
from pdmask_lab.same_reading import same_reading
from pdmask_lab.stale_render import answers_markdown, stale_markdown

STEPS, SYNC = 8, 4


def recs(*, finish=0.9, evals=(0.3, 0.6, 0.8), ends=(1.0, 1.0, 1.0), mb1=(0.1, 0.3), tokens=(100, 300),
         lag_q90=None, extra=None):
    """8 steps (sync every 4), evals at steps 0, 4, 8; ``finish``: a float or {step: value};
    ``mb1``/``tokens``: mb1_masked_frac and num_tokens on odd / even steps."""
    out = [{"step": 0, "eval_accuracy": evals[0], "eval_finished": ends[0]}]
    for s in range(1, STEPS + 1):
        f = finish.get(s, 0.9) if isinstance(finish, dict) else finish
        r = {"step": s, "finish_rate": f, "entropy_mean": 1.0, "mismatch_topk_kl": 0.01, "engine_lag": (s - 1) % SYNC,
             "num_tokens": tokens[s % 2 == 0], "mb1_masked_frac": mb1[s % 2 == 0],
             "start_divergence_q90": (lag_q90 or [0.02, 0.04, 0.06, 0.08])[(s - 1) % SYNC]}
        if s in (4, 8):
            i = s // 4
            r.update(eval_accuracy=evals[i], eval_finished=ends[i])
        r.update((extra or {}).get(s, {}))
        out.append(r)
    return out


def run(root: Path, label: str, seed: int, records: list[dict], *, delta=0.02, finished=True, answers=None):
    d = root / f"{label}-s{seed}"
    d.mkdir(parents=True)
    cfg = {"name": d.name, "seed": seed, "steps": STEPS, "sync_every": SYNC,
           "loss": {"mode": label.partition("@")[0], "thresholds": {"delta_low": delta, "delta_high": delta}}}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if finished:
        (d / "summary.json").write_text(json.dumps({"run": d.name}))
    if answers:
        (d / "eval_answers.jsonl").write_text("".join(json.dumps({"step": s, "answers": a}) + "\n"
                                                      for s, a in answers.items()))
    return d


BROKE = {s: 0.1 for s in range(4, STEPS + 1)}  # the finish rate falls from step 4: ending_sampled @5 (mean of 3-5)


@pytest.fixture
def cell(tmp_path):
    """4 seeds: none ends badly (finish rate falls; greedy answers stop ending at step 4) on every
    seed; dppo-topk-kl holds and learns less; dppo-topk-kl@old (same stored mode, other delta)
    learns nothing on seeds 0-1."""
    root = tmp_path / "rung"
    for s in range(4):
        run(root, "none", s, recs(finish=BROKE, evals=(0.3, 0.7, 0.9), ends=(1.0, 0.25, 0.0)))
        run(root, "dppo-topk-kl", s, recs(evals=(0.3, 0.5, 0.6)))
        old = (0.3, 0.35, 0.4) if s < 2 else (0.3, 0.5, 0.6)
        run(root, "dppo-topk-kl@old", s, recs(evals=old, mb1=(0.0, 0.0), extra={
            1: {"anchor_divergence_q90": 0.5, "mu_region_out_frac_at_start": 0.25}}), delta=0.041)
    return root


def test_labels_keep_the_variant_apart_and_order_versus_first(cell):
    rep = sr.stale_report(cell)
    assert rep["labels"] == ["none", "dppo-topk-kl", "dppo-topk-kl@old"]
    assert rep["seeds"] == {lab: [0, 1, 2, 3] for lab in rep["labels"]}


def test_each_criterion_on_its_own_with_mcnemar_against_each_versus_label(cell):
    c = sr.stale_report(cell)["criteria"]
    es = c["ending_sampled"]
    assert es["none"]["k"] == 4 and es["none"]["per_seed"] == {str(s): 5 for s in range(4)}
    assert es["dppo-topk-kl"]["k"] == 0 and es["dppo-topk-kl"]["per_seed"] == {str(s): None for s in range(4)}
    # 4 discordant seeds, all one way: exact two-sided binomial p = 2 / 2^4
    assert es["none"]["vs"]["dppo-topk-kl"] == {"n": 4, "only_mode": 4, "only_versus": 0, "p": pytest.approx(0.125)}
    assert es["dppo-topk-kl"]["vs"]["none"]["only_versus"] == 4 and "dppo-topk-kl" not in es["dppo-topk-kl"]["vs"]
    assert c["ending_greedy"]["none"]["per_seed"] == {str(s): 4 for s in range(4)}  # 0.25 <= 0.5 at step 4
    # no_learning: final < start + 0.15: 0.4 < 0.45 on seeds 0-1 of the variant only
    nl = c["no_learning"]["dppo-topk-kl@old"]
    assert nl["k"] == 2 and nl["per_seed"] == {"0": 8, "1": 8, "2": None, "3": None}
    assert nl["vs"]["dppo-topk-kl"] == {"n": 4, "only_mode": 2, "only_versus": 0, "p": pytest.approx(0.5)}
    assert c["no_learning"]["dppo-topk-kl"]["k"] == 0  # not merged with the variant's seeds
    # the anchors compared: a variant against its plain mode, nothing for a plain mode
    assert nl["vs_base"] == {"n": 4, "only_mode": 2, "only_versus": 0, "p": pytest.approx(0.5), "base": "dppo-topk-kl"}
    assert es["none"]["vs_base"] is None and es["dppo-topk-kl"]["vs_base"] is None
    assert c["accuracy"]["none"]["k"] == 0 and c["mismatch"]["none"]["k"] == 0
    assert c["entropy"]["none"]["k"] == 0  # entropy never fell
    lo, hi = es["dppo-topk-kl"]["lo"], es["dppo-topk-kl"]["hi"]
    assert lo == 0 and hi == pytest.approx(1 - 0.025 ** (1 / 4))  # Clopper-Pearson 0/4


def test_final_accuracy_and_auc_paired_with_the_power_line(cell):
    sc = sr.stale_report(cell)["scalars"]
    f = sc["eval_final"]["none"]
    assert f["mean"]["estimate"] == pytest.approx(0.9)
    d = f["vs"]["dppo-topk-kl"]
    assert d["estimate"] == pytest.approx(0.3) and (d["wins"], d["losses"], d["n"]) == (4, 0, 4)
    assert d["p"] == pytest.approx(0.125)
    assert d["detectable"]["shift"] is None and "2/2^4" in d["detectable"]["reason"]  # inf: 4 seeds cannot reach 0.05
    # AUC: trapezoid over (0, .3), (4, .5), (8, .6) / 8 = (0.8 * 2 + 1.1 * 2) / 8
    assert sc["eval_auc"]["dppo-topk-kl"]["mean"]["estimate"] == pytest.approx((0.8 * 2 + 1.1 * 2) / 8)
    v = sc["eval_final"]["dppo-topk-kl@old"]["vs"]["dppo-topk-kl"]
    assert v["estimate"] == pytest.approx(-0.1) and (v["wins"], v["losses"]) == (0, 2)
    b = sc["eval_final"]["dppo-topk-kl@old"]["vs_base"]
    assert b["base"] == "dppo-topk-kl" and b["estimate"] == pytest.approx(-0.1) and b["seeds"] == [0, 1, 2, 3]


def test_a_variant_without_its_plain_mode_has_no_anchor_pair(tmp_path):
    root = tmp_path / "rung"
    run(root, "none", 0, recs())
    run(root, "pdm-topk-kl@old", 0, recs(), delta=0.041)
    rep = sr.stale_report(root)
    assert rep["scalars"]["eval_final"]["pdm-topk-kl@old"]["vs_base"] is None
    assert rep["criteria"]["ending_sampled"]["pdm-topk-kl@old"]["vs_base"] is None


def test_anchor_shares_are_pooled_over_tokens_and_quantiles_over_steps(cell):
    a = sr.stale_report(cell)["anchor"]
    # per seed: 4 odd steps of 100 tokens at 0.1, 4 even steps of 300 tokens at 0.3
    want = (4 * 100 * 0.1 + 4 * 300 * 0.3) / (4 * 100 + 4 * 300)
    m = a["mb1_masked_frac"]["none"]
    assert m["estimate"] == pytest.approx(want) and m["tokens"] == 4 * 1600 and m["steps"] == 32
    assert m["lo"] == pytest.approx(want) and m["hi"] == pytest.approx(want)  # identical seeds
    assert a["mb1_masked_frac"]["dppo-topk-kl@old"]["estimate"] == 0
    q = a["start_divergence_q90"]["none"]
    assert q["estimate"] == pytest.approx(0.05) and q["tokens"] is None  # mean over steps of .02 .04 .06 .08
    # logged by the variant only, on one step of each seed
    assert a["anchor_divergence_q90"]["none"] is None
    assert a["anchor_divergence_q90"]["dppo-topk-kl@old"]["estimate"] == pytest.approx(0.5)
    assert "behaviour_weight_mean" not in a  # no run logs it: no column


def test_by_lag_means_over_steps_then_seeds(tmp_path):
    root = tmp_path / "rung"
    run(root, "none", 0, recs(lag_q90=[0.1, 0.2, 0.3, 0.4]))
    run(root, "none", 1, recs(lag_q90=[0.3, 0.4, 0.5, 0.6]))
    t = sr.stale_report(root)["by_lag"]["start_divergence_q90"]["none"]
    assert {g: v["mean"] for g, v in t.items()} == pytest.approx({"0": 0.2, "1": 0.3, "2": 0.4, "3": 0.5})
    assert t["0"]["seeds"] == 2


def test_unfinished_and_misnamed_runs_are_left_out_and_named(tmp_path):
    root = tmp_path / "rung"
    run(root, "none", 0, recs())
    run(root, "grpo", 0, recs()[:4], finished=False)
    d = run(root, "pdm-topk-kl", 1, recs())
    d.rename(root / "pdm-topk-kl-s9")
    rep = sr.stale_report(root)
    assert rep["labels"] == ["none"]
    assert any("grpo-s0: unfinished (step 3 of 8)" in n for n in rep["notes"])
    assert any("pdm-topk-kl-s9" in n for n in rep["notes"])
    assert any("dppo-topk-kl" in n and "nothing is compared" in n for n in rep["notes"])


def test_the_ladder_summary_and_break_table_group_by_label(cell):
    from pdmask_lab.regime import rung_breaks
    from pdmask_lab.seed_summary import seed_summary

    runs = sorted(p for p in cell.iterdir())
    s = seed_summary(runs, reference="dppo-topk-kl", n_boot=200)
    by = {g["mode"]: g for g in s["groups"]}
    assert set(by) == {"none", "dppo-topk-kl", "dppo-topk-kl@old"} and by["dppo-topk-kl@old"]["n_seeds"] == 4
    assert by["dppo-topk-kl@old"]["vs_reference"]["reference_group"] == by["dppo-topk-kl"]["group"]
    assert by["dppo-topk-kl@old"]["vs_reference"]["eval_final"]["estimate"] == pytest.approx(-0.1)
    br = rung_breaks(runs, "dppo-topk-kl")
    assert set(br["modes"]) == {"none", "dppo-topk-kl", "dppo-topk-kl@old"}


def test_markdown_prints_every_criterion_its_definition_and_the_tests(cell):
    from pdmask_lab.regime import STALE_CRITERIA, STALE_DEFINITIONS

    md = stale_markdown(sr.stale_report(cell, command="cmd"))
    for c in STALE_CRITERIA:
        assert f"### `{c}`: {STALE_DEFINITIONS[c]}" in md and f"- `{c}`: {STALE_DEFINITIONS[c]}" in md
    assert "| `none` | 4/4 [0.40, 1.00] | s0 @5, s1 @5, s2 @5, s3 @5 | - | 4 vs 0 of 4, p = 0.125 |" in md
    assert "+0.300 [+0.300, +0.300], 4 up / 0 down of 4, p = 0.125 | none | - | - |" in md
    assert md.count("| 2 vs 0 of 4, p = 0.5 | 2 vs 0 of 4, p = 0.5 |") == 1  # no_learning: vs dppo, vs its plain mode
    # token shares in percent (the at-start share too), distances as numbers
    assert "| `dppo-topk-kl@old` | 25.00% [25.00%, 25.00%] | 400 |" in md  # logged on step 1 only: 4 x 100 tokens
    assert "| `dppo-topk-kl@old` | 0.05 [0.05, 0.05] | 0.5 [0.5, 0.5] | - |" in md


def test_answers_page_shows_one_seed_per_label_with_escaped_text(tmp_path):
    root = tmp_path / "rung"
    ans = {0: ["The largest is 7.", "a | b\nc"], 4: ["7 7 7 7", ""], 8: ["7", "8"]}
    run(root, "none", 0, recs(ends=(1.0, 0.5, 0.0)), answers=ans)
    run(root, "none", 1, recs(), answers={0: ["other seed"]})
    rep = sr.stale_report(root)
    md = answers_markdown(rep, root, n=2)
    assert "## `none`, seed 0" in md and "other seed" not in md
    assert "| 0 | 0.300 | 1.00 | `The largest is 7.` | `a \\| b⏎c` |" in md
    assert "| 4 | 0.600 | 0.50 | `7 7 7 7` | (empty) |" in md
    assert "seed 1" in answers_markdown(rep, root, n=1, seed=1)


def test_cli_writes_the_report_from_a_copy_of_the_records(tmp_path, monkeypatch, capsys):
    root = tmp_path / "runs" / "rung"
    run(root, "none", 0, recs(), answers={0: ["x"]})
    run(root, "dppo-topk-kl", 0, recs(), answers={0: ["y"]})
    (root / "none-s0" / "model.safetensors").write_text("not a record")
    monkeypatch.chdir(tmp_path)
    assert sr.main(["runs/rung", "--records-to", "results/rung", "--out", "results", "--no-plot"]) == 0
    assert (tmp_path / "results" / "rung" / "none-s0" / "eval_answers.jsonl").is_file()
    assert not (tmp_path / "results" / "rung" / "none-s0" / "model.safetensors").exists()
    md = (tmp_path / "results" / "stale.md").read_text()
    assert "Written by `python -m pdmask_lab.stale_report runs/rung --records-to results/rung --out results" in md
    assert str(tmp_path) not in md and str(tmp_path) not in (tmp_path / "results" / "stale.json").read_text()
    assert "`x`" in (tmp_path / "results" / "answers.md").read_text()


@pytest.mark.parametrize("argv, want", [
    (["missing-dir"], "rung_dir: 'missing-dir' is not a directory of runs"),
    (["EMPTY"], "rung_dir: no finished run under"),
    (["EMPTY", "--answers", "-1"], "--answers: must be >= 0, got -1"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, argv, want):
    (tmp_path / "EMPTY").mkdir()
    monkeypatch.chdir(tmp_path)
    assert sr.main(argv) == 2
    out = capsys.readouterr().out
    assert out.startswith(want) and out.count("\n") == 1


def test_labels_option_selects_and_orders_and_refuses_unknown(cell):
    rep = sr.stale_report(cell, labels=["dppo-topk-kl@old", "none"])
    assert rep["labels"] == ["dppo-topk-kl@old", "none"]
    with pytest.raises(ValueError, match="labels: grpo not among"):
        sr.stale_report(cell, labels=["grpo"])


def test_the_plot_is_written(cell, tmp_path):
    rep = sr.write_report(cell, tmp_path / "out", answers=1)
    assert (tmp_path / "out" / rep["plot"]).stat().st_size > 10_000


COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "results" / "real-stale"


@pytest.mark.skipif(not (COMMITTED / "stale.json").is_file(), reason="the stale comparison's records are not committed")
def test_the_committed_report_rebuilds_from_the_committed_records(tmp_path):
    """docs/real_rl.md quotes stale.md: rebuilt from the records beside it, every number is the same."""
    assert sr.main([str(COMMITTED / "lr3e-4-sync8"), "--out", str(tmp_path), "--no-plot"]) == 0
    got = json.loads((tmp_path / "stale.json").read_text())
    want = json.loads((COMMITTED / "stale.json").read_text())
    # every number at every place (the build's command and figure aside); floats to their rounding,
    # since the bootstrap's sums may differ in the last bit by CPU model
    r = same_reading(want, got)
    assert r.shared > 1000 and not r.lost and not r.only_old and not r.only_new
    for where, old, new in r.differ:
        assert new == pytest.approx(old, rel=1e-9, abs=1e-12), where
    # the headline of docs/real_rl.md, read from the rebuilt report: answers stop ending on every
    # seed of `none` and on none of the mu-centred regions' (McNemar 8 vs 0 of 8: p = 2 / 2^8)
    for name in ("ending_sampled", "ending_greedy"):
        c = got["criteria"][name]
        assert (c["none"]["k"], c["none"]["n"]) == (8, 8)
        for label in ("grpo", "dppo-topk-kl", "pdm-topk-kl"):
            assert (c[label]["k"], c[label]["n"]) == (0, 8), (name, label)
            assert c[label]["vs"]["none"]["p"] == pytest.approx(2 / 2 ** 8)
    # the anchors compared: dppo-topk-kl@old lost its greedy answers' ending on 6 of 8 seeds, mu on 0
    g = got["criteria"]["ending_greedy"]["dppo-topk-kl@old"]
    assert (g["k"], g["vs"]["dppo-topk-kl"]["only_mode"], g["vs"]["dppo-topk-kl"]["only_versus"]) == (6, 6, 0)
    assert g["vs"]["dppo-topk-kl"]["p"] == pytest.approx(2 / 2 ** 6)
