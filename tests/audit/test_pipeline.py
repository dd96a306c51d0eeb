"""The per-seed pipeline on a tiny bigram LM with a perturbed engine copy (no trainer)."""

import json

import numpy as np

import pytest
import torch

from audit_toy import BigramLM, audit_config, bigram_forward, perturbed, sample_batch
from pdmask_lab.audit import AuditConfig, audit_batch, run_audit, summarize_all
from pdmask_lab.audit.fidelity import effective_ks
from pdmask_lab.audit.report import write_report


@pytest.fixture(scope="module")
def setup():
    pol = BigramLM(vocab=12, dim=8)
    eng = perturbed(pol, 0.3)
    return pol, eng


def _cfg(**kw):
    base = dict(lr=1e-2, sample_tokens=6, disagreement_tokens=4, bootstrap=200, fidelity_ks=(1, 2, 5, 20))
    base.update(kw)
    return audit_config(**base)


def test_audit_batch_invariants(setup):
    pol, eng = setup
    before = {k: v.clone() for k, v in pol.state_dict().items()}
    rb, adv = sample_batch(eng, seed=0)
    r = audit_batch(pol, bigram_forward, rb, adv, _cfg(), seed=0)
    for k, v in pol.state_dict().items():  # every step was undone, bit for bit
        assert torch.equal(v, before[k]), k
    n_o = r.info["n_out_of_region"]
    assert 0 < n_o <= r.info["n_response_tokens"] == int(rb.response_mask.sum())
    for kind in ("batch", "logit"):
        for c, x in r.counts[kind]["out_of_region"].items():
            assert x["n"] == n_o and x["kept"] + x["masked"] == n_o, (kind, c)
            assert x["unsafe"] + x["corrective"] + x["ties_kept"] == x["kept"], (kind, c)
    # the logit-space step is the literal first-order claim; exact-top-K is the exact
    # derivative of the top-K KL, so its sign is always right there
    lg = r.counts["logit"]["out_of_region"]["pred-exact"]
    assert lg["sign_ok"] == lg["n"]
    assert r.info["n_sample"] == min(6, n_o) and r.info["n_disagreement_measured"] <= 4
    measured = r.tokens["measured"]
    assert measured.sum() == r.info["n_measured"] >= r.info["n_sample"]
    for col in ("ip", "ip_head", "own", "dD_isolated"):  # measured exactly on the chosen tokens
        assert np.isfinite(r.tokens[col]).tolist() == measured.tolist(), col
    assert "pip" not in r.tokens  # no optimizer state: no preconditioned instrument
    # the group split adds up (the toy has no input-embedding module: head + body)
    m = measured
    np.testing.assert_allclose(r.tokens["ip_head"][m] + r.tokens["ip_embed"][m] + r.tokens["ip_body"][m]
                               + r.tokens["ip_cross"][m], r.tokens["ip"][m], rtol=1e-12, atol=1e-15)
    # the batch step really moved D (with lr 1e-2 the change is far above float32 noise)
    assert r.info["dD_batch_abs_mean_O"] > 1e-4
    # fidelity K capped at V = 12: 20 -> 12; at K = V every estimator matches the full Ddot
    assert sorted(r.fidelity["response"]["K"]) == [1, 2, 5, 12]
    assert all(a == n for a, n in r.fidelity["response"]["K"][12].values())


@pytest.mark.usefixtures("one_thread")  # bitwise: two runs of one seeded audit, on one thread
def test_step_mode_and_seeded_sampling(setup):
    pol, eng = setup
    rb, adv = sample_batch(eng, seed=1)
    a = audit_batch(pol, bigram_forward, rb, adv, _cfg(), seed=5)
    b = audit_batch(pol, bigram_forward, rb, adv, _cfg(), seed=5)
    assert np.array_equal(a.tokens["in_sample"], b.tokens["in_sample"])
    assert a.counts == b.counts
    # masking in the step itself changes the update, hence the realized changes
    c = audit_batch(pol, bigram_forward, rb, adv, _cfg(step_mode="pdm-topk-kl"), seed=5)
    assert c.info["step_kept_frac"] < 1.0 == a.info["step_kept_frac"]
    assert not np.array_equal(a.tokens["dD_batch"], c.tokens["dD_batch"])


def test_bad_inputs_are_value_errors(setup):
    pol, eng = setup
    rb, adv = sample_batch(eng, seed=0)
    rb.rollout = rb.rollout.replace(logits=None)
    with pytest.raises(ValueError, match="return_logits"):
        audit_batch(pol, bigram_forward, rb, adv, _cfg())
    for kw, name in [({"divergence": "binary_kl"}, "divergence"), ({"estimator": "x"}, "estimator"),
                     ({"lr": 0.0}, "lr"), ({"step_mode": "nope"}, "step_mode"), ({"fidelity_ks": (0,)}, "fidelity_ks"),
                     ({"optimizer": "lion"}, "optimizer"), ({"sample_tokens": -1}, "sample_tokens"),
                     ({"disagreement_tokens": -2}, "disagreement_tokens"), ({"instruments": ("nope",)}, "instruments"),
                     ({"step_mode": "pdm-batch-topk-kl"}, "step_mode"),
                     ({"bootstrap": 0}, "bootstrap"), ({"tie_tol": float("nan")}, "tie_tol")]:
        with pytest.raises(ValueError, match=name):
            audit_config(**kw)
    rb, adv = sample_batch(eng, seed=0)
    with pytest.raises(ValueError, match="advantages"):
        audit_batch(pol, bigram_forward, rb, adv[:3], _cfg())
    assert effective_ks((1, 5, 100, 200), 50) == [1, 5, 50]


def test_run_and_report(setup, tmp_path, check_environment):
    pol, eng = setup
    cfg = _cfg(divergence="topk_tv", delta_low=0.02, delta_high=0.02)
    res = run_audit(pol, bigram_forward, lambda s: (*sample_batch(eng, seed=s), {"note": "toy"}), [0, 1], cfg,
                    progress=True)
    S = summarize_all(res, cfg)
    write_report(tmp_path, res, S, cfg, run_settings={"command": "pytest"})
    for f in ("audit.json", "audit.md", "audit_tokens.npz", "rates.png", "fidelity.png", "scatter.png"):
        assert (tmp_path / f).stat().st_size > 0, f
    doc = json.loads((tmp_path / "audit.json").read_text())
    assert doc["settings"]["audit"]["divergence"] == "topk_tv"
    check_environment(doc["environment"], threads=None)  # no trainer config: no configured threads
    assert [s["seed"] for s in doc["summary"]["per_seed"]] == [0, 1]
    o = doc["summary"]["rates"]["batch"]["out_of_region"]
    assert o["n_tokens"] == o["criteria"]["ratio"]["counts"]["n"] == sum(r.info["n_out_of_region"] for r in res)
    assert o["n_seeds"] <= 2 and o["criteria"]["ratio"]["sign_accuracy"]["n_clusters"] == 2
    md = (tmp_path / "audit.md").read_text()
    assert "## Definitions (ours)" in md and "34.2%" in md and "36.9%" in md and "unsafe-keep" in md
    assert "McNemar" in md and "binomial" in md and "seed-cluster" in md
    z = np.load(tmp_path / "audit_tokens.npz")
    assert z["D"].shape[0] == o["n_tokens"] and set(z["seed"]) == {0, 1} and list(z["seeds"]) == [0, 1]
    # every rate table, recomputed from the records alone, is the one in audit.json
    from pdmask_lab.audit.report import _jsonable, report_from_records
    again = _jsonable(report_from_records(tmp_path / "audit_tokens.npz"))
    assert again["rates"] == doc["summary"]["rates"] and again["group_shares"] == doc["summary"]["group_shares"]
    assert set(doc["summary"]["rates"]) >= {"batch", "logit", "param", "own", "isolated"}


def test_batch_step_optimizer_state_is_used_and_not_changed(setup):
    import copy

    from pdmask_lab.audit.steps import batch_step
    pol, eng = setup
    rb, adv = sample_batch(eng, seed=2)
    A = adv[:, None].expand(rb.response_mask.shape).float()
    cfg = _cfg(optimizer="adam", lr=1e-2, grad_clip=0.0)
    # an Adam state with history: second moments from 3 steps on other batches
    work = copy.deepcopy(pol)
    opt = torch.optim.Adam(work.parameters(), lr=1e-2)
    for s in range(3):
        rb2, a2 = sample_batch(eng, seed=10 + s)
        loss = -(bigram_forward(work, rb2.sequences, None, rb2.prompt_len).log_softmax(-1).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    state = opt.state_dict()
    frozen = copy.deepcopy(state)
    _, _, fresh = batch_step(pol, bigram_forward, rb, A, cfg)
    _, _, warm = batch_step(pol, bigram_forward, rb, A, cfg, optimizer_state=state)
    assert not torch.allclose(fresh, warm)  # the logits after the step differ
    assert torch.equal(state["state"][0]["exp_avg_sq"], frozen["state"][0]["exp_avg_sq"])
    assert state["state"][0]["step"] == frozen["state"][0]["step"]


@pytest.mark.parametrize("case", ["delta-too-high", "all-advantages-zero"])
def test_batch_without_out_of_region_tokens(setup, tmp_path, case):
    pol, eng = setup
    rb, adv = sample_batch(eng, seed=0)
    if case == "all-advantages-zero":  # every group had equal rewards
        adv, cfg = torch.zeros_like(adv), _cfg()
    else:
        cfg = _cfg(delta_low=50.0, delta_high=50.0)
    r = audit_batch(pol, bigram_forward, rb, adv, cfg, seed=0)
    assert r.info["n_out_of_region"] == 0
    assert r.counts["batch"]["out_of_region"]["ratio"]["n"] == 0
    S = summarize_all([r], cfg)
    assert S["rates"] == {}  # no token of O: no rate table
    write_report(tmp_path, [r], S, cfg)  # an empty audit still writes every file
    assert (tmp_path / "audit.md").exists() and (tmp_path / "fidelity.png").exists()


def test_head_only_isolated_step_follows_the_logit_direction(setup):
    """With an untied output layer h -> W h + b, the gradient of -w A log pi_k in (W, b)
    moves the logits by eta' sign(A) (|h|^2 + 1) (e_k - pi): exactly the direction the
    predictive Ddot is the derivative along. So the head-only isolated step and the
    head term of the step-free inner product must agree with the exact predictive sign
    on every token (a small step), unlike the ratio."""
    pol, eng = setup
    hits, n, ratio_hits = 0, 0, 0
    for s in range(2):
        rb, adv = sample_batch(eng, seed=s, B=10)
        r = audit_batch(pol, bigram_forward, rb, adv,
                        _cfg(sample_tokens=30, disagreement_tokens=10, instruments=("param", "isolated-head")), seed=s)
        for kind in ("isolated_head", "param_head"):
            c = r.counts[kind]["out_of_region"]
            assert c["pred-exact"]["sign_ok"] == c["pred-exact"]["n"], kind
            d = r.counts[kind]["disagreement:pred-exact"]
            assert d["pred-exact"]["sign_ok"] == d["pred-exact"]["n"], kind
            assert d["ratio"]["sign_ok"] == 0  # on disagreement tokens the ratio is then always wrong
        c = r.counts["isolated_head"]["out_of_region"]
        hits, n, ratio_hits = hits + c["pred-exact"]["sign_ok"], n + c["pred-exact"]["n"], ratio_hits + c["ratio"]["sign_ok"]
        assert "dD_isolated_head" in r.tokens and "isolated" not in r.counts
    assert n >= 40 and hits == n and ratio_hits < n


def test_delta_sweep_equals_an_audit_at_that_delta(setup):
    """An audit at delta 0.01 restricted to D > 0.06 (the sweep) gives the batch and logit
    tables of an audit run at delta 0.06 directly: the same tokens, the same numbers."""
    pol, eng = setup
    sample = lambda s: (*sample_batch(eng, seed=s), {})  # noqa: E731
    low = _cfg(delta_low=0.01, delta_high=0.01, delta_sweep=(0.06,), instruments=(), bootstrap=300)
    high = _cfg(delta_low=0.06, delta_high=0.06, instruments=(), bootstrap=300)
    S_low = summarize_all(run_audit(pol, bigram_forward, sample, [0, 1, 2], low, progress=False), low)
    S_high = summarize_all(run_audit(pol, bigram_forward, sample, [0, 1, 2], high, progress=False), high)
    sw = S_low["delta_sweep"][0.06]
    assert sw["n_out_of_region"] == S_high["rates"]["batch"]["out_of_region"]["n_tokens"] > 0
    assert sw["n_out_of_region"] < S_low["rates"]["batch"]["out_of_region"]["n_tokens"]
    for kind in ("batch", "logit"):
        for sname in ("out_of_region", "disagreement:pred-exact"):
            a, b = sw["rates"][kind][sname], S_high["rates"][kind][sname]
            assert a["n_tokens"] == b["n_tokens"]
            for c in ("ratio", "pred-exact"):
                assert a["criteria"][c]["counts"] == b["criteria"][c]["counts"], (kind, sname, c)
    with pytest.raises(ValueError, match="delta_sweep"):
        _cfg(delta_low=0.05, delta_high=0.05, delta_sweep=(0.01,))
