"""The report's statistics: pooled over tokens with a seed-cluster bootstrap, exact tests,
every table recomputable from the per-token records."""

import numpy as np
import pytest

from pdmask_lab.audit.report import rate_table, summary_table
from pdmask_lab.audit.tables import disagreement, tables


def records(rows):
    """rows: (seed, A, c_ratio, c_pred, dD); every token is in O and in the uniform sample."""
    a = np.array(rows, dtype=np.float64)
    n = len(rows)
    rec = {"seed": a[:, 0].astype(np.int64), "A": a[:, 1], "c_ratio": a[:, 2], "c_pred-exact": a[:, 3],
           "dD_batch": a[:, 4], "in_sample": np.ones(n, dtype=bool)}
    return rec


# Two seeds, every token on the disagreement set (the ratio says outward, the predictive
# criterion inward, A = +1):
#   seed 0: 1 token,  dD < 0          -> predictive right 1/1, ratio 0/1
#   seed 1: 9 tokens, dD < 0 on 3     -> predictive right 3/9, ratio 6/9
# Per-seed means: predictive (1 + 1/3) / 2 = 66.7%, ratio (0 + 2/3) / 2 = 33.3%  (predictive "wins")
# Pooled:         predictive 4/10 = 40.0%,          ratio 6/10 = 60.0%          (the ratio is right more often)
ROWS = [(0, 1.0, 0.1, -0.1, -0.01)] + [(1, 1.0, 0.1, -0.1, -0.01)] * 3 + [(1, 1.0, 0.1, -0.1, +0.01)] * 6


def test_pooled_and_per_seed_mean_disagree_and_the_report_shows_the_pooled_rate():
    rec = records(ROWS)
    t = tables(rec, [0, 1], n_boot=500)["rates"]["batch"]
    d = t["disagreement:pred-exact"]
    assert d["n_tokens"] == 10 and d["n_seeds"] == 2
    acc_p = d["criteria"]["pred-exact"]["sign_accuracy"]
    acc_r = d["criteria"]["ratio"]["sign_accuracy"]
    assert acc_p["estimate"] == pytest.approx(0.4) and acc_p["per_cluster_mean"] == pytest.approx(2 / 3)
    assert acc_r["estimate"] == pytest.approx(0.6) and acc_r["per_cluster_mean"] == pytest.approx(1 / 3)
    assert d["vs_ratio"]["pred-exact"]["sign_accuracy"]["estimate"] == pytest.approx(-0.2)
    # unsafe-keep of the predictive criterion (it keeps every token): pooled 6/10, per seed (0 + 6/9)/2
    uk = d["criteria"]["pred-exact"]["unsafe_keep"]
    assert uk["estimate"] == pytest.approx(0.6) and uk["per_cluster_mean"] == pytest.approx(1 / 3)
    # the ratio masks every token: its unsafe-keep rate has no denominator
    assert np.isnan(d["criteria"]["ratio"]["unsafe_keep"]["estimate"])
    # the report's headline row and rate table print the pooled rates
    row = "\n".join(summary_table({"rates": {"batch": t}}, "pred-exact"))
    assert "| batch | disagreement | 10 | 2 | 40.0% [" in row and "| 60.0% [" in row
    assert "66.7%" not in row
    table = "\n".join(rate_table(d, ("ratio", "pred-exact"), "pred-exact"))
    assert "| 40.0% [" in table and "66.7%" in table  # the per-seed mean only as the secondary column


def test_exact_tests_hand_worked():
    t = tables(records(ROWS), [0, 1], n_boot=200)["rates"]["batch"]
    st = t["disagreement:pred-exact"]["vs_ratio"]["pred-exact"]["sign_test"]
    # binomial(10, 1/2), k = 4: p = 2 P(X <= 4) = 2 (1 + 10 + 45 + 120 + 210) / 1024 = 772 / 1024
    assert (st["predictive_right"], st["ratio_right"], st["n_untied"], st["n_tied"]) == (4, 6, 10, 0)
    assert st["p"] == pytest.approx(772 / 1024, abs=1e-15)
    # on O the same tokens are the discordant pairs of McNemar's test: b = 4, c = 6, same p
    m = t["out_of_region"]["vs_ratio"]["pred-exact"]["mcnemar"]
    assert (m["only_predictive_right"], m["only_ratio_right"]) == (4, 6) and m["p"] == pytest.approx(772 / 1024)
    # a lopsided case: the predictive criterion right on 1 of 10: p = 2 (1 + 10) / 1024 = 22 / 1024
    rows = [(0, 1.0, 0.1, -0.1, -0.01)] + [(s, 1.0, 0.1, -0.1, +0.01) for s in (1, 2, 3) for _ in range(3)]
    t = tables(records(rows), [0, 1, 2, 3], n_boot=200)["rates"]["batch"]
    st = t["disagreement:pred-exact"]["vs_ratio"]["pred-exact"]["sign_test"]
    assert (st["predictive_right"], st["n_untied"]) == (1, 10) and st["p"] == pytest.approx(22 / 1024, abs=1e-15)
    # a tied token (dD = 0) is neither criterion's win: n_untied drops, n_tokens does not
    rows = ROWS + [(1, 1.0, 0.1, -0.1, 0.0)]
    st = tables(records(rows), [0, 1], n_boot=200)["rates"]["batch"]["disagreement:pred-exact"]["vs_ratio"][
        "pred-exact"]["sign_test"]
    assert (st["n_untied"], st["n_tied"]) == (10, 1)


def test_mcnemar_on_O_counts_only_the_discordant_tokens():
    # On O: 1 token only the predictive criterion gets right, 6 only the ratio (the
    # disagreement tokens), plus concordant ones where both criteria point the same way
    # (A = +1, both outward): 5 with dD > 0 (both right) and 3 with dD < 0 (both wrong).
    # McNemar uses b = 1, c = 6 alone: p = 2 (C(7,0) + C(7,1)) / 2^7 = 2 * 8 / 128 = 0.125.
    # (Had the concordant pairs leaked in, e.g. as b = 1 + 3, c = 6 + 5, p would differ.)
    rows = ([(0, 1.0, 0.1, -0.1, -0.01)] + [(s, 1.0, 0.1, -0.1, +0.01) for s in (0, 1, 2) for _ in range(2)]
            + [(1, 1.0, 0.2, 0.3, +0.5)] * 5 + [(2, 1.0, 0.2, 0.3, -0.5)] * 3)
    t = tables(records(rows), [0, 1, 2], n_boot=200)["rates"]["batch"]
    o = t["out_of_region"]
    assert o["n_tokens"] == 15
    m = o["vs_ratio"]["pred-exact"]["mcnemar"]
    assert (m["only_predictive_right"], m["only_ratio_right"]) == (1, 6)
    assert m["p"] == pytest.approx(0.125, abs=1e-15)
    # pooled sign accuracy on O: predictive (1 + 5) / 15, ratio (6 + 5) / 15
    assert o["criteria"]["pred-exact"]["sign_accuracy"]["estimate"] == pytest.approx(6 / 15)
    assert o["criteria"]["ratio"]["sign_accuracy"]["estimate"] == pytest.approx(11 / 15)
    # the disagreement set's sign test sees the same 7 tokens: binomial(7, 1/2) at k = 1
    st = t["disagreement:pred-exact"]["vs_ratio"]["pred-exact"]["sign_test"]
    assert (st["predictive_right"], st["n_untied"]) == (1, 7) and st["p"] == pytest.approx(0.125, abs=1e-15)


def test_agreeing_tokens_are_outside_the_disagreement_set_and_seeds_without_tokens_count():
    rows = ROWS + [(1, -1.0, 0.2, 0.3, -0.5), (1, 1.0, -0.2, -0.3, 0.5)]  # both criteria agree here
    rec = records(rows)
    assert disagreement(rec, "pred-exact").sum() == 10
    t = tables(rec, [0, 1, 2], n_boot=300)["rates"]["batch"]  # seed 2 audited, no token
    o = t["out_of_region"]
    assert o["n_tokens"] == 12 and o["n_seeds"] == 2 and o["n_seeds_audited"] == 3
    assert o["criteria"]["ratio"]["sign_accuracy"]["n_clusters"] == 3
    # the interval resamples seeds: it contains the estimate, and is seeded
    acc = o["criteria"]["pred-exact"]["sign_accuracy"]
    assert acc["lo"] <= acc["estimate"] <= acc["hi"]
    again = tables(rec, [0, 1, 2], n_boot=300)["rates"]["batch"]["out_of_region"]["criteria"]["pred-exact"]
    assert again["sign_accuracy"] == acc


def test_instrument_kinds_use_the_sample_on_O_and_the_measured_disagreement_tokens():
    rec = records(ROWS + [(1, 1.0, 0.2, 0.3, 0.5)] * 4)
    n = rec["A"].size
    rec["in_sample"] = np.zeros(n, dtype=bool)
    rec["in_sample"][[0, 10, 11]] = True
    rec["ip"] = np.where(np.arange(n) < 12, rec["dD_batch"], np.nan)  # measured on 12 of the 14 tokens
    t = tables(rec, [0, 1], n_boot=200)["rates"]["param"]
    assert t["out_of_region"]["n_tokens"] == 3  # the uniform sample only
    assert t["disagreement:pred-exact"]["n_tokens"] == 10
    assert set(t) == {"out_of_region", "disagreement:pred-exact"}
