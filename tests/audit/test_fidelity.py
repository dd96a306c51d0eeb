"""Estimator fidelity: K = V reproduces the full answers, also where pi ~ mu."""

import torch

from pdmask_lab.audit.fidelity import effective_ks, fidelity_counts, summarize_fidelity


def _case(noise: float, seed=0, B=4, T=8, V=40):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=g) * 3).float()
    rollout = logits + noise * torch.randn(B, T, V, generator=g)
    ids = torch.multinomial(torch.softmax(rollout.reshape(-1, V), -1), 1, generator=g).reshape(B, T)
    return logits, rollout, ids, torch.ones(B, T, dtype=torch.bool)


def test_k_equal_v_agrees_everywhere_even_when_pi_is_close_to_mu():
    # noise 1e-4 on float32 logits: |Ddot| ~ 1e-5..1e-9, where a float32 reduction's
    # sign is rounding; the sweep runs in float64, so at K = V every estimator equals
    # the full-vocabulary Ddot and the KL shares are 1
    logits, rollout, ids, m = _case(1e-4)
    f = fidelity_counts(logits, ids, rollout, m, {"all": m}, family="kl", ks=(1, 40))["all"]
    assert all(a == n == 32 for a, n in f["K"][40].values())
    s = f["sums"][40]
    # total KL ~ 8e-8 from terms ~1e-4 that cancel: equal up to float64 rounding (~1e-12)
    assert abs(s["topk_kl"] - s["full_kl"]) < 1e-11 and abs(s["topk_tv"] - s["full_tv"]) < 1e-11
    assert s["topk_kl"] > 1e-9  # the case really has a mismatch
    assert f["sums"][1]["topk_kl"] < s["full_kl"]


def test_fidelity_tv_family_and_summary():
    logits, rollout, ids, m = _case(0.5, seed=1)
    sets = {"all": m, "half": m & (torch.arange(8) < 4)}
    per_seed = [fidelity_counts(logits, ids, rollout, m, sets, family="tv", ks=(2, 5, 60)) for _ in range(2)]
    assert sorted(per_seed[0]["half"]["K"]) == [2, 5, 40]  # 60 capped at V = 40
    assert all(a == n == 16 for a, n in per_seed[0]["half"]["K"][40].values())
    S = summarize_fidelity(per_seed, n_boot=50)
    assert S["all"]["sign_agreement"][40]["exact"]["estimate"] == 1.0  # pooled over seeds
    assert 0 < S["all"]["kl_share"][2]["estimate"] < S["all"]["kl_share"][5]["estimate"] <= 1.0 + 1e-12
    assert effective_ks((100,), 40) == [40]
