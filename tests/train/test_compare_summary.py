"""The across-seed summary of a compare, on constructed run directories whose answer is
known (see compare_toy.py for the data: 4 seeds of dppo-topk-kl, pdm-topk-kl and none)."""

import json

import pytest
from compare_toy import make_compare_dir, runs_of, write_run

from pdmask_lab.seed_summary import DETECTABLE_HEADER, resolution_note, run_scalars, seed_markdown, seed_summary


@pytest.fixture
def compare_dir(tmp_path):
    return make_compare_dir(tmp_path / "cmp")


def test_run_scalars_hand_worked(tmp_path):
    recs = [json.loads(line) for line in (write_run(tmp_path, "dppo-topk-kl", 0) / "metrics.jsonl").read_text().splitlines()]
    s = run_scalars(recs, sync_every=2)
    assert s["eval_final"] == 0.65
    # last 5 evals: steps 4..8 = 0.60, 0.60, 0.62, 0.64, 0.65 -> 3.11 / 5
    assert s["eval_last5"] == pytest.approx(3.11 / 5)
    # trapezoid on unit steps 0..8: (0.10 + 0.65)/2 + (0.40+0.50+0.55+0.60+0.60+0.62+0.64) = 4.285; / 8
    assert s["eval_auc"] == pytest.approx(4.285 / 8)
    assert s["worst_drop"] == 0.0  # monotone curve
    # sync_every 2: window = 2 * ceil(5/2) = 6 steps (3..8): 1e-3 * (3+4+5+6+7+8)/6 = 5.5e-3
    assert s["mismatch_final"] == pytest.approx(5.5e-3)
    # sync_every 1: the last 5 steps (4..8): 6e-3
    assert run_scalars(recs, sync_every=1)["mismatch_final"] == pytest.approx(6e-3)
    # 8 steps of 0.01 * 1000 masked tokens
    c = s["counts"]["masked_frac"]
    assert (c["num"], c["den"], s["masked_frac"]) == pytest.approx((80, 8000, 0.01))
    assert c["how"] == "masked_frac*num_tokens" and (s["steps"], s["evals"]) == (8, 9)
    # out of region: 0.2 of 1000 tokens per step, counted from the fraction; disagreement: its
    # denominator (num_out_of_region) is never logged, so it has no share (None, not 0)
    c = s["counts"]["out_of_region_frac"]
    assert (c["num"], c["den"], c["how"]) == pytest.approx((1600, 8000, "out_of_region_frac*num_tokens"))
    assert s["disagreement_frac"] is None and s["counts"]["disagreement_frac"] == {"num": 0.0, "den": 0.0, "how": None}
    # the collapse: best 0.60 at step 4, last 0.20 -> worst drop 0.40
    none = [json.loads(line) for line in (write_run(tmp_path, "none", 0) / "metrics.jsonl").read_text().splitlines()]
    assert run_scalars(none)["worst_drop"] == pytest.approx(0.40)
    with pytest.raises(ValueError, match="eval_accuracy"):
        run_scalars([{"step": 1, "reward": 0.0}])


def test_seed_summary_known_answers(compare_dir):
    s = seed_summary(runs_of(compare_dir), n_boot=2000)
    g = {e["group"]: e for e in s["groups"]}
    assert s["reference"] == "dppo-topk-kl" and s["n_seeds"] == 4
    ref, pdm, none = g["dppo-topk-kl"], g["pdm-topk-kl"], g["none"]
    assert ref["vs_reference"] is None and ref["seeds"] == [0, 1, 2, 3] and ref["steps"] == [8]
    # reference final accuracy: 0.65 + 0.01 * seed -> mean 0.665, range 0.65-0.68
    m = ref["metrics"]["eval_final"]
    assert (m["mean"], m["min"], m["max"]) == pytest.approx((0.665, 0.65, 0.68))

    # masked fraction of the reference pooled over seeds: sum_s 0.01 (s+1) 1000 (s+1) / sum_s 1000 (s+1)
    # = 0.01 * (1+4+9+16) / (1+2+3+4) = 0.03, while the mean of the per-seed fractions is 0.025
    mp = ref["pooled"]["masked_frac"]
    assert mp["estimate"] == pytest.approx(0.03) and mp["per_cluster_mean"] == pytest.approx(0.025)
    assert mp["den"] == 8 * 1000 * 10 and mp["lo"] <= mp["estimate"] <= mp["hi"]
    assert ref["metrics"]["masked_frac"]["mean"] == pytest.approx(0.025)  # the per-seed mean stays secondary
    # pdm logs num_masked (30 of 1000 per step): counts are used, the bogus masked_frac = 0.5 is not
    assert pdm["pooled"]["masked_frac"]["estimate"] == pytest.approx(0.03)
    # disagreement of pdm pooled over seeds: sum_s 8 * 10 (s+1) / (4 * 8 * 100) = 800 / 3200 = 0.25 of
    # 3,200 out-of-region tokens, while the per-seed shares are 0.1 (s+1) (mean 0.25 too: equal denominators)
    dg = pdm["pooled"]["disagreement_frac"]
    assert dg["estimate"] == pytest.approx(0.25) and dg["den"] == 3200 and dg["lo"] <= 0.25 <= dg["hi"]
    assert pdm["pooled"]["out_of_region_frac"]["estimate"] == pytest.approx(0.1)
    assert ref["pooled"]["disagreement_frac"]["estimate"] is None  # never counted: no share, no pairing
    assert ref["pooled"]["out_of_region_frac"]["estimate"] == pytest.approx(0.2)
    assert ref["pooled"]["corrective_frac"]["estimate"] is None  # no smooth weight in these modes

    v = pdm["vs_reference"]
    assert v["reference_group"] == "dppo-topk-kl" and v["seeds"] == [0, 1, 2, 3] and v["n"] == 4
    # final accuracy: per-seed differences = PDM_OFFSET = (0.10, 0.05, -0.02, 0.07): mean 0.05;
    # sign flips (worked in tests/test_significance.py): p = 4/16
    f = v["eval_final"]
    assert f["estimate"] == pytest.approx(0.05) and f["p"] == 0.25 and f["p_method"] == "exact"
    assert (f["wins"], f["losses"]) == (3, 1) and f["lo"] <= 0.05 <= f["hi"]
    # the power line: 4 seeds cannot reach p <= 0.05 whatever the shift
    det = f["detectable"]  # inf, written as null by json_safe
    assert det["shift"] is None and det["n"] == 4 and "2/2^4" in det["reason"]
    assert v["eval_last5"]["estimate"] == pytest.approx(0.05) and v["eval_last5"]["p"] == 0.25
    # AUC: the offset holds from step 1 on; the 0->1 trapezoid carries half of it: 7.5/8 of the offset
    assert v["eval_auc"]["estimate"] == pytest.approx(0.05 * 7.5 / 8)
    # both curves monotone: no drop, d = 0 everywhere, p = 1
    assert v["worst_drop"]["estimate"] == 0.0 and v["worst_drop"]["p"] == 1.0
    assert v["mismatch_final"]["estimate"] == pytest.approx(0.0, abs=1e-15)
    # masked: pooled 0.03 - 0.03 = 0; per-seed differences 0.03 - 0.01 (s+1) = (0.02, 0.01, 0, -0.01),
    # observed sum 0.02. The zero's sign is free (x2); of the 8 patterns a, b, c of
    # |0.02a + 0.01b - 0.01c|, all but (+, -, +) and (-, +, -) (sum 0) reach 0.02: p = 12/16 = 0.75
    mk = v["masked_frac"]
    assert mk["estimate"] == pytest.approx(0.0, abs=1e-12) and mk["p"] == pytest.approx(0.75)
    # out of region: 0.1 - 0.2 on every seed (p = 2/16); disagreement: the reference has no share
    o = v["out_of_region_frac"]
    assert o["estimate"] == pytest.approx(-0.1) and o["p"] == 0.125 and o["n"] == 4
    assert v["disagreement_frac"] is None

    w = none["vs_reference"]
    # collapse: final 0.20 + 0.01 s vs 0.65 + 0.01 s -> -0.45 on every seed; 4 of one sign: p = 2/16
    assert w["eval_final"]["estimate"] == pytest.approx(-0.45) and w["eval_final"]["p"] == 0.125
    assert w["eval_final"]["lo"] == pytest.approx(-0.45) and w["eval_final"]["hi"] == pytest.approx(-0.45)
    assert w["worst_drop"]["estimate"] == pytest.approx(0.40) and w["worst_drop"]["p"] == 0.125
    # mismatch 10x: 5.5e-2 - 5.5e-3
    assert w["mismatch_final"]["estimate"] == pytest.approx(5.5e-2 - 5.5e-3)
    assert w["masked_frac"]["estimate"] == pytest.approx(-0.03) and w["masked_frac"]["p"] == 0.125

    assert s["resolution"] == [resolution_note(4)]
    assert "2/2^4 = 0.125" in s["resolution"][0] and "no difference can reach p < 0.05" in s["resolution"][0]
    assert s["notes"] == []


def test_seed_summary_pairs_on_common_seeds_and_notes_it(compare_dir):
    import shutil

    shutil.rmtree(compare_dir / "pdm-topk-kl-s3")
    s = seed_summary(runs_of(compare_dir), n_boot=500)
    v = next(e for e in s["groups"] if e["group"] == "pdm-topk-kl")["vs_reference"]
    # seeds 0..2: offsets 0.10, 0.05, -0.02 -> mean 0.13/3
    assert v["seeds"] == [0, 1, 2] and v["eval_final"]["estimate"] == pytest.approx(0.13 / 3)
    assert any("paired on the 3 seeds" in n for n in s["notes"])
    assert sorted(s["resolution"]) == sorted([resolution_note(3), resolution_note(4)])


def test_reference_refusal_and_absence(compare_dir):
    runs = runs_of(compare_dir)
    with pytest.raises(ValueError, match=r"^reference: mode 'grpo' is not among the runs' modes"):
        seed_summary(runs, reference="grpo", require_reference=True)
    s = seed_summary(runs, reference="grpo", n_boot=200)  # not required: no paired part, said so
    assert all(e["vs_reference"] is None for e in s["groups"])
    assert s["notes"] == ["No paired differences: the reference mode grpo is not among the runs."]
    # another reference among the modes: everything is paired against it
    s = seed_summary(runs, reference="none", n_boot=200)
    v = next(e for e in s["groups"] if e["group"] == "dppo-topk-kl")["vs_reference"]
    assert v["eval_final"]["estimate"] == pytest.approx(0.45)


def test_duplicate_seed_is_refused(compare_dir, tmp_path):
    other = tmp_path / "other"
    write_run(other, "none", 0)
    with pytest.raises(ValueError, match="run_dirs: two runs of none with seed 0"):
        seed_summary(runs_of(compare_dir) + runs_of(other))


def test_resolution_note():
    assert "2/2^2 = 0.5" in resolution_note(2) and "p < 0.05" in resolution_note(2)
    n6 = resolution_note(6)
    assert "2/2^6 = 0.0312" in n6 and "no difference can reach" not in n6


def test_compare_refuses_a_reference_outside_the_modes(tmp_path, smoke_config, cli):
    run_cli, _ = cli
    out = tmp_path / "cmp"
    p = run_cli(["compare", "--config", smoke_config, "--modes", "grpo,pdm-topk-kl", "--out", out],
                cwd=tmp_path, check=False, timeout=60)
    assert p.returncode == 2
    err = p.stderr.strip().splitlines()
    assert err == ["error: reference: mode 'dppo-topk-kl' is not among the compared modes (grpo, pdm-topk-kl); "
                   "pass --reference with one of them"]
    assert not out.exists()  # refused before anything ran


def test_one_seed_has_no_interval_and_cannot_reject(tmp_path):
    root = tmp_path / "one"
    for mode in ("dppo-topk-kl", "pdm-topk-kl"):
        write_run(root, mode, 0)
    s = seed_summary(runs_of(root), n_boot=200)
    v = next(e for e in s["groups"] if e["group"] == "pdm-topk-kl")["vs_reference"]
    f = v["eval_final"]
    # one pair: d = 0.10; no bootstrap interval (None, not NaN: summary.json stays strict JSON); p = 2/2 = 1
    assert f["estimate"] == pytest.approx(0.10) and f["lo"] is None and f["hi"] is None and f["p"] == 1.0
    assert "2/2^1 = 1" in s["resolution"][0]
    json.loads(json.dumps(s), parse_constant=lambda c: pytest.fail(f"non-finite {c} in the summary"))


def test_masked_counts_only_from_steps_that_log_them():
    recs = [{"step": 0, "eval_accuracy": 0.1},
            {"step": 1, "eval_accuracy": 0.2, "num_tokens": 100.0, "num_masked": 5.0},
            {"step": 2, "eval_accuracy": 0.3, "num_tokens": 300.0, "masked_frac": 0.1},  # 30 masked
            {"step": 3, "eval_accuracy": 0.4, "num_tokens": 600.0}]  # no masked count: left out, not 0
    s = run_scalars(recs)
    c = s["counts"]["masked_frac"]
    assert (c["num"], c["den"]) == pytest.approx((35, 400))
    assert s["masked_frac"] == pytest.approx(35 / 400)
    assert c["how"] == "masked_frac*num_tokens + num_masked"
    assert run_scalars(recs[:1] + recs[3:])["masked_frac"] is None
    # a smooth weight's corrective share: fraction * tokens (no count is logged), 0.1 * 100 + 0.2 * 300
    recs[1]["corrective_frac"], recs[2]["corrective_frac"] = 0.1, 0.2
    c = run_scalars(recs)["counts"]["corrective_frac"]
    assert (c["num"], c["den"], c["how"]) == pytest.approx((70, 400, "corrective_frac*num_tokens"))
    # evals at 0..3 of 0.1..0.4 (linear): AUC = mean of the line = 0.25; eval at one step only: its value
    assert s["eval_auc"] == pytest.approx(0.25)
    assert run_scalars([{"step": 4, "eval_accuracy": 0.7}])["eval_auc"] == 0.7


def test_power_column_in_the_paired_table(compare_dir):
    s = seed_summary(runs_of(compare_dir), n_boot=200)
    md = seed_markdown(s)
    def cells(line):
        return [c.strip() for c in line.strip().strip("|").split("|")]

    header = cells(next(line for line in md.splitlines() if DETECTABLE_HEADER in line))
    col = header.index(DETECTABLE_HEADER)
    rows = {c[0]: c[col] for c in map(cells, md.splitlines()[md.splitlines().index(
        next(line for line in md.splitlines() if DETECTABLE_HEADER in line)) + 2:]) if len(c) == len(header)}
    assert rows["pdm-topk-kl"] == "none" and rows["none"] == "none"  # 4 seeds: p >= 0.125
    # the AUC gets its own power column, computed on the AUC's per-seed differences
    assert "detectable Δ AUC (80% power)" in header
    auc_det = next(e for e in s["groups"] if e["group"] == "pdm-topk-kl")["vs_reference"]["eval_auc"]["detectable"]
    assert auc_det["n"] == 4 and auc_det["shift"] is None
    assert "detectable" in s["definitions"]


def test_shares_in_the_per_mode_table(compare_dir):
    s = seed_summary(runs_of(compare_dir), n_boot=200)
    lines = seed_markdown(s).splitlines()
    header = next(line for line in lines if line.startswith("| mode | seeds |"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    row = {c[0]: c for c in ([x.strip() for x in line.strip("|").split("|")] for line in lines)
           if len(c) == len(cols) and c[0] in ("pdm-topk-kl", "dppo-topk-kl")}
    dis = cols.index("disagreement (pooled over seeds)")
    # pooled 0.25 of the out-of-region tokens, its unit named; the reference never counted it
    assert row["pdm-topk-kl"][dis].startswith("25.00% [") and "(3,200 out-of-region tokens)" in row["pdm-topk-kl"][dis]
    assert row["dppo-topk-kl"][dis] == "-"
    assert row["dppo-topk-kl"][cols.index("out of region (pooled over seeds)")].startswith("20.00% [")


def test_the_auc_power_line_reads_the_auc_differences(tmp_path):
    from pdmask_lab.power import detectable_shift

    root = tmp_path / "eight"
    for mode in ("dppo-topk-kl", "none"):
        for s in range(8):
            d = write_run(root, mode, s)
            if mode == "none":  # a bump at step 2 that varies by seed: the AUC differences vary, the final ones do not
                recs = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
                recs[2]["eval_accuracy"] += 0.03 * s * (-1) ** s
                (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    summ = seed_summary(runs_of(root), n_boot=200)
    g = next(e for e in summ["groups"] if e["group"] == "none")
    v = g["vs_reference"]
    ref = next(e for e in summ["groups"] if e["group"] == "dppo-topk-kl")
    d_auc = [g["runs"][str(s)]["eval_auc"] - ref["runs"][str(s)]["eval_auc"] for s in range(8)]
    d_fin = [g["runs"][str(s)]["eval_final"] - ref["runs"][str(s)]["eval_final"] for s in range(8)]
    # 8 seeds can reject: a finite shift, each computed from its own scalar's per-seed differences
    assert v["eval_auc"]["detectable"]["shift"] == pytest.approx(detectable_shift(d_auc, seed=0).shift)
    assert v["eval_final"]["detectable"]["shift"] == pytest.approx(detectable_shift(d_fin, seed=0).shift)
    assert v["eval_final"]["detectable"]["shift"] == 0.0  # the same -0.45 on every seed: no noise
    assert v["eval_auc"]["detectable"]["shift"] > 0.0
