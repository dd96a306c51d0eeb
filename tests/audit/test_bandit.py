"""The softmax bandit: one position whose logits are the parameters themselves.

There the gradient of a token's loss ``-w A log pi_k`` with respect to the parameters
is ``-w A (e_k - pi)`` (T = 1), so a small gradient step moves the logits exactly along
the direction whose first-order effect ``Ddot`` predicts: the realized sign must equal
the predictive sign on essentially every token. The ratio direction sees only the
local term and must be wrong where the global term dominates.
"""

import math

import numpy as np

import pytest
import torch

import pdmask

from audit_toy import audit_config, Bandit, bandit_forward
from tests.flat import token_stats
from pdmask_lab.audit import AuditConfig, audit_batch, classify, isolated_param_changes, logit_step_changes
from pdmask.engine.base import RolloutBatch

F64 = torch.float64


def bandit_batch(z_mu: torch.Tensor, k: torch.Tensor, K: int) -> RolloutBatch:
    """N one-token rollouts: prompt = the row id, response = the sampled token k."""
    N, V = z_mu.shape
    logm = torch.log_softmax(z_mu, -1)
    tk_lp, tk_ids = logm.topk(K, -1)
    seq = torch.stack([torch.arange(N), k], 1)
    return RolloutBatch(sequences=seq, attention_mask=torch.ones_like(seq, dtype=torch.bool), prompt_len=1,
                        rollout=pdmask.Rollout(k[:, None], logm.gather(1, k[:, None]), tk_ids[:, None], tk_lp[:, None],
                                               torch.ones(N, 1, dtype=torch.bool), logits=z_mu[:, None]))


def random_bandits(N=300, V=8, K=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    z_pi = torch.randn(N, V, generator=g, dtype=F64) * 1.5
    z_mu = z_pi + torch.randn(N, V, generator=g, dtype=F64)  # a real mismatch
    k = torch.multinomial(torch.softmax(z_mu, -1), 1, generator=g).squeeze(1)
    A = torch.where(torch.rand(N, generator=g) < 0.5, -1.0, 1.0).to(F64)
    return z_pi, z_mu, k, A, bandit_batch(z_mu, k, K)


def stats_of(z_pi, rb):
    return pdmask.token_stats(z_pi[:, None], rb.rollout)


@pytest.mark.parametrize("divergence,ddot_key", [("full_kl", "ddot_full_kl"), ("topk_kl", "ddot_topk_kl_exact"),
                                                 ("full_tv", "ddot_full_tv")])
def test_isolated_step_sign_equals_predictive_sign(divergence, ddot_key):
    z_pi, z_mu, k, A, rb = random_bandits()
    cfg = AuditConfig(divergence=divergence, isolated_step=1e-5)
    tokens = torch.stack([torch.arange(len(k)), torch.zeros_like(k)], 1)
    model = Bandit(z_pi)
    before = model.z.detach().clone()
    dD = isolated_param_changes(model, bandit_forward, rb, A[:, None], tokens, cfg)
    assert torch.equal(model.z.detach(), before)  # the caller's model is untouched
    ddot = stats_of(z_pi, rb)[ddot_key][:, 0]
    pred = torch.sign(A * ddot)
    clear = ddot.abs() > 1e-9  # |Ddot| ~ 0 means the first order says nothing
    assert clear.float().mean() > 0.97
    assert torch.equal(torch.sign(dD)[clear], pred[clear])
    # the ratio direction is wrong on some of these same tokens (the global term)
    ratio = torch.sign(A * stats_of(z_pi, rb)["log_ratio"][:, 0])
    assert (ratio[clear] != pred[clear]).sum() >= 5
    # In the bandit the parameter step IS the logit step: the same numbers.
    r = rb.rollout
    rows = pdmask.Rollout(k, r.sampled_logprob[:, 0], r.topk_ids[:, 0], r.topk_logprobs[:, 0], logits=z_mu)
    dl = logit_step_changes(z_pi, rows, A, divergence=divergence, step=1e-5)
    torch.testing.assert_close(dD, dl, rtol=1e-9, atol=1e-15)
    if divergence.endswith("kl"):  # smooth: first-order magnitude eta * sign(A) Ddot / |e_k - pi|
        u = -torch.softmax(z_pi, -1)
        u[torch.arange(len(k)), k] += 1
        first = 1e-5 * torch.sign(A) * ddot / u.norm(dim=-1)
        torch.testing.assert_close(dD, first, rtol=1e-3, atol=1e-10)


def constructed_case():
    """V = 3, sampled token k = 0, A = +1.

    pi = (0.20, 0.79, 0.01), mu = (0.10, 0.20, 0.70).
    Ratio: r = pi_0 / mu_0 = 2 > 1 and A > 0, so the ratio calls the update outward:
    "raising pi_0 moves it further above mu_0".
    Predictive (KL): Ddot = (pi_k - mu_k) + sum_i pi_i mu_i - sum_i pi_i^2
        local  = 0.20 - 0.10                                   = +0.1000
        sum pi mu = 0.20*0.10 + 0.79*0.20 + 0.01*0.70 = 0.020 + 0.158 + 0.007 = 0.1850
        sum pi^2  = 0.04 + 0.6241 + 0.0001                      = 0.6642
        global = 0.1850 - 0.6642                                = -0.4792
        Ddot   = 0.1000 - 0.4792                                = -0.3792 < 0
    so A * Ddot < 0: inward. The global term dominates: raising pi_0 takes mass from
    token 1, which pi over-weights (0.79 vs 0.20) far more than it over-weights token 0,
    so KL(mu || pi) falls. KL(mu || pi) = 0.1 ln 0.5 + 0.2 ln(0.2/0.79) + 0.7 ln 70
    = -0.0693 - 0.2747 + 2.9740 = 2.630 > delta: the token is out of the region.
    """
    pi = torch.tensor([[0.20, 0.79, 0.01]], dtype=F64)
    mu = torch.tensor([[0.10, 0.20, 0.70]], dtype=F64)
    return pi.log(), mu.log(), torch.tensor([0]), torch.tensor([1.0], dtype=F64)


def test_constructed_case_ratio_wrong_predictive_right():
    z_pi, z_mu, k, A = constructed_case()
    rb = bandit_batch(z_mu, k, K=3)
    st = stats_of(z_pi, rb)
    assert st["full_kl"].item() == pytest.approx(2.630, abs=1e-3)
    assert st["ddot_full_kl"].item() == pytest.approx(-0.3792, abs=1e-12)
    assert st["ddot_topk_kl_exact"].item() == pytest.approx(-0.3792, abs=1e-12)  # K = V: exact = full
    assert st["log_ratio"].item() == pytest.approx(math.log(2.0), abs=1e-12)
    for div in ("full_kl", "topk_kl"):
        dD = isolated_param_changes(Bandit(z_pi), bandit_forward, rb, A[:, None], torch.tensor([[0, 0]]),
                                    AuditConfig(divergence=div, isolated_step=1e-4))
        # the realized change: KL falls, as predicted; |e_k - pi| = |(0.8, -0.79, -0.01)| = 1.12436
        assert dD.item() < 0
        assert dD.item() == pytest.approx(1e-4 * -0.3792 / 1.124366, rel=1e-3)
        c = classify(dD, A, {"ratio": st["log_ratio"][:, 0], "pred": st["ddot_full_kl"][:, 0]},
                     torch.tensor([True]))
        # ratio masks a corrective token (sign wrong); predictive keeps it (sign right)
        assert c["ratio"] == dict(n=1, kept=0, masked=1, unsafe=0, corrective=0, ties_kept=0, masked_increase=0,
                                  sign_ok=0)
        assert c["pred"] == dict(n=1, kept=1, masked=0, unsafe=0, corrective=1, ties_kept=0, masked_increase=0,
                                 sign_ok=1)


def test_audit_batch_on_independent_bandits_sgd():
    """Bandits are independent rows, so an SGD batch step is each row's own (scaled)
    token step: with a small learning rate the batch step too agrees with the exact
    predictive sign on every token, while the ratio does not."""
    z_pi, z_mu, k, A, rb = random_bandits(N=200, V=6, K=6, seed=3)
    cfg = audit_config(divergence="full_kl", delta_low=1e-3, delta_high=1e-3, optimizer="sgd", lr=1e-2,
                      sample_tokens=20, disagreement_tokens=20, isolated_step=1e-5, bootstrap=100,
                      fidelity_ks=(1, 6))
    model = Bandit(z_pi)
    r = audit_batch(model, bandit_forward, rb, A, cfg, seed=0)
    assert torch.equal(model.z.detach(), z_pi)
    o = r.counts["batch"]["out_of_region"]
    n = r.info["n_out_of_region"]
    assert n > 150 and o["ratio"]["n"] == n
    # the step-free inner product of a bandit is A * Ddot itself (the parameters are the
    # logits); the own effect of an SGD step on independent rows is the row's whole change
    for kind in ("batch", "logit", "isolated", "param", "own"):
        c = r.counts[kind]["out_of_region"]
        assert c["pred-full"]["sign_ok"] == c["pred-full"]["n"], kind
        assert c["pred-exact"]["sign_ok"] == c["pred-exact"]["n"], kind  # K = V: exact = full
        assert c["pred-full"]["unsafe"] == 0, kind  # a correct criterion never keeps an increase
    assert o["ratio"]["sign_ok"] < o["ratio"]["n"]
    m = r.tokens["measured"]
    np.testing.assert_allclose(r.tokens["own"][m], r.tokens["dD_batch64"][m], rtol=1e-9, atol=1e-15)
    d = r.counts["batch"]["disagreement:pred-full"]
    assert d["ratio"]["n"] > 0 and d["ratio"]["sign_ok"] == 0 and d["pred-full"]["sign_ok"] == d["ratio"]["n"]
    # fidelity at K = V: every estimator equals the full Ddot, top-K KL = full KL
    f = r.fidelity["response"]
    assert all(a == n_ for a, n_ in f["K"][6].values())
    assert f["sums"][6]["topk_kl"] == pytest.approx(f["sums"][6]["full_kl"], rel=1e-9)
    assert f["sums"][1]["topk_kl"] < f["sums"][1]["full_kl"]  # top-1 is a strict lower bound here
