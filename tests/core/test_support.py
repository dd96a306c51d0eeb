"""Issue 31 item 2: the support of the top-K divergences. ``support="topk+sampled"`` (the
default) is ``S' = topK ∪ {k}``; ``support="topk"`` is the rollout's top-K alone, the sampled
token in the tail bucket when it is outside: the DPPO reference code, Stable-RL's
``compute_topk_kl`` (restated below as the oracle). The exact Ddots for that support against
autograd in float64, and the option's checks."""

import math

import pytest
import torch

import pdmask
from pdmask.keys import ESTIMATORS, TOPK_DIVERGENCES

from .helpers import F64, ddot_autograd, make_case, stats_of, topk_divergence_fn

TOPK = "topk"


# ------------------------------------------------------------------ the oracle
def stable_rl_topk_kl_tv(logits, topk_ids, topk_logprobs):
    """Stable-RL's top-K KL and TV, restated from sail-sg/Stable-RL, file
    ``verl/workers/actor/utils.py``, function ``compute_topk_kl`` (the DPPO reference code).

    In words: q = softmax(logits); on the rollout's K top ids take p (the rollout's
    probabilities) and q; each side's "rest" is 1 minus its top-K mass; all four masses
    (top-K and rest of p and q) are clamped from below at 1e-12. KL(p || q) is
    ``sum_topK p (log p - log q) + rest_p (log rest_p - log rest_q)``, TV is half of
    ``sum_topK |p - q| + |rest_p - rest_q|``. The sampled token plays no part. Stable-RL casts
    everything to float32 first; here the input's dtype is kept (float64 in the tests), a
    difference of precision only (the float32 cast is asserted in
    ``test_stable_rl_float32_rest_differs_where_the_tail_is_tiny``)."""
    log_q = torch.log_softmax(logits, -1)
    q_top_log = log_q.gather(-1, topk_ids)
    q_top = q_top_log.exp()
    p_top = topk_logprobs.exp()
    rest_q = (1.0 - q_top.sum(-1)).clamp(min=1e-12)
    rest_p = (1.0 - p_top.sum(-1)).clamp(min=1e-12)
    kl = (p_top * (topk_logprobs - q_top_log)).sum(-1) + rest_p * (rest_p.log() - rest_q.log())
    tv = ((p_top - q_top).abs().sum(-1) + (rest_p - rest_q).abs()) / 2.0
    return kl, tv


def random_batch(B=4, T=8, V=1000, K=20, seed=0, dtype=F64):
    """A mismatched rollout (mu's logits = pi's plus noise), k sampled from mu: some inside
    the top-K, most outside."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, V, generator=g, dtype=F64) * 2.0
    y = z + torch.randn(B, T, V, generator=g, dtype=F64) * 1.0
    lmu = torch.log_softmax(y, -1)
    top = lmu.topk(K, -1)
    k = torch.multinomial(lmu.reshape(-1, V).exp(), 1, generator=g).reshape(B, T)
    k[:, ::3] = top.indices[:, ::3, 2]  # a third of the positions sample inside the top-K
    r = pdmask.Rollout(k, lmu.gather(-1, k[..., None])[..., 0], top.indices, top.values)
    return z.to(dtype), r


def test_topk_support_equals_stable_rl_on_random_batches():
    z, r = random_batch()
    inside = (r.topk_ids == r.sampled_ids[..., None]).any(-1)
    assert inside.any() and (~inside).any()
    kl, tv = stable_rl_topk_kl_tv(z, r.topk_ids, r.topk_logprobs)
    st = pdmask.token_stats(z, r, support=TOPK)
    torch.testing.assert_close(st["topk_kl"], kl, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(st["topk_tv"], tv, rtol=1e-12, atol=1e-14)
    # the default support differs exactly where k is outside the top-K (and agrees inside)
    d = pdmask.token_stats(z, r)
    torch.testing.assert_close(d["topk_kl"][inside], kl[inside], rtol=1e-12, atol=1e-14)
    assert ((d["topk_kl"] - kl).abs()[~inside] > 1e-9).all()
    # (TV differs only where mu_k - pi_k and the rest's mu_T - pi_T have opposite signs)
    assert ((d["topk_tv"] - tv).abs()[~inside] > 1e-9).any()
    # and S ∪ {k} is the finer partition: its divergences are never below the top-K's own
    assert (d["topk_kl"] >= st["topk_kl"] - 1e-12).all() and (d["topk_tv"] >= st["topk_tv"] - 1e-12).all()


@pytest.mark.parametrize("impl", ["torch", "auto"])
@pytest.mark.parametrize("seed", [1, 2])
def test_topk_support_equals_stable_rl_on_every_path(impl, seed):
    z, r = random_batch(B=2, T=5, seed=seed)
    kl, tv = stable_rl_topk_kl_tv(z, r.topk_ids, r.topk_logprobs)
    st = pdmask.token_stats(z, r, support=TOPK, compute=pdmask.Compute(impl=impl))
    torch.testing.assert_close(st["topk_kl"], kl, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(st["topk_tv"], tv, rtol=1e-12, atol=1e-14)
    out = pdmask.policy_loss_from_hidden(z, torch.eye(z.shape[-1], dtype=F64), r, torch.ones(2, dtype=F64),
                                         mode="dppo-topk-kl", support=TOPK)
    torch.testing.assert_close(out.stats["topk_kl"], kl, rtol=1e-12, atol=1e-14)


def issue_example():
    """The issue's token: mu_k = 0.00255 (0.0026 rounded), r = 199, k outside the top-K.

    The trainer moved mass onto k alone: pi = (1 - lam) mu + lam e_k, so pi/mu is one
    constant off k and every divergence depends only on mu_k, r and the top-K's mu mass
    M_K = 0.636 (the issue's figures fix it). V = 1000, K = 20."""
    V, K, mu_k, r, M_K = 1000, 20, 0.00255, 199.0, 0.636
    g = torch.Generator().manual_seed(0)
    w_top = torch.rand(K, generator=g, dtype=F64) + 1.0
    w_tail = torch.rand(V - K - 1, generator=g, dtype=F64)
    mu = torch.cat([M_K * w_top / w_top.sum(), torch.tensor([mu_k], dtype=F64),
                    (1 - M_K - mu_k) * w_tail / w_tail.sum()])
    assert mu[K + 1:].max() < mu_k < mu[:K].min()  # k ranks 21st: outside the top-20
    lam = (r - 1) * mu_k / (1 - mu_k)
    pi = (1 - lam) * mu
    pi[K] += lam
    perm = torch.randperm(V, generator=g)  # ids in no particular order
    mu_v, pi_v = torch.empty_like(mu), torch.empty_like(pi)
    mu_v[perm], pi_v[perm] = mu, pi
    k = perm[K]
    lmu = mu_v.log()
    top = lmu.topk(K)
    rollout = pdmask.Rollout(k.view(1, 1), lmu[k].view(1, 1), top.indices.view(1, 1, K), top.values.view(1, 1, K))
    return pi_v.log().view(1, 1, V), rollout


def test_issue_example_default_and_stable_rl_support():
    z, r = issue_example()
    d = pdmask.token_stats(z, r)
    assert d["ratio"].item() == pytest.approx(199.0, rel=1e-9)
    assert d["topk_kl"].item() == pytest.approx(0.690, abs=5e-4)
    assert d["topk_tv"].item() == pytest.approx(0.505, abs=5e-4)
    s = pdmask.token_stats(z, r, support=TOPK)
    assert s["topk_kl"].item() == pytest.approx(0.218, abs=5e-4)
    assert s["topk_tv"].item() == pytest.approx(0.322, abs=5e-4)
    kl, tv = stable_rl_topk_kl_tv(z, r.topk_ids, r.topk_logprobs)
    assert s["topk_kl"].item() == pytest.approx(kl.item(), rel=1e-12)
    assert s["topk_tv"].item() == pytest.approx(tv.item(), rel=1e-12)
    # at delta 0.454 with A > 0 the default masks the token and the top-K support keeps it
    th = pdmask.Thresholds(delta_low=0.454, delta_high=0.454)
    for mode in ("dppo-topk-kl", "dppo-topk-tv"):
        assert not pdmask.trust_region_mask(z, r, torch.ones(1, dtype=F64), mode=mode, thresholds=th).item()
        assert pdmask.trust_region_mask(z, r, torch.ones(1, dtype=F64), mode=mode, thresholds=th,
                                        support=TOPK).item()


def test_stable_rl_float32_rest_differs_where_the_tail_is_tiny():
    """The deliberate differences, asserted: Stable-RL's float32 ``1 - sum q`` and its 1e-12
    floor on the rest masses. Where pi leaves ~1e-14 outside the top-K, pdmask (any dtype)
    keeps log pi_T accurate; the float32 restatement does not."""
    z, r = random_batch(B=1, T=4, seed=3)
    z = z.clone()
    z[0, :, :] = z[0, :, :].scatter_add(-1, r.topk_ids[0], torch.full((4, 20), 40.0, dtype=F64))  # pi_T ~ 1e-15
    st64 = pdmask.token_stats(z, r, support=TOPK)
    st32 = pdmask.token_stats(z.float(), r, support=TOPK)
    assert (st64["policy_tail_mass"] < 1e-12).all()
    torch.testing.assert_close(st32["topk_kl"].double(), st64["topk_kl"], rtol=1e-5, atol=1e-4)
    kl64, _ = stable_rl_topk_kl_tv(z, r.topk_ids, r.topk_logprobs)
    kl32, _ = stable_rl_topk_kl_tv(z.float(), r.topk_ids.int().long(), r.topk_logprobs.float())
    assert ((kl64 - st64["topk_kl"]).abs() > 1e-2).all()  # the 1e-12 floor on rest_q
    assert ((kl32.double() - st64["topk_kl"]).abs() > 1e-2).all()  # and float32 rounds rest_q to 0 first


# ------------------------------------------------------------------ Ddot of the top-K-only divergence
def topk_only_fn(c, kind):
    """The top-K-only divergence as a function of the full pi (autograd's input): S = topK,
    the sampled token wherever it falls, the rest one bucket."""
    return topk_divergence_fn(c, kind, with_sampled=False)


SHAPES = [(8, 30, 4, 1.5, 0.5, 0), (8, 50, 3, 4.0, 1.0, 3), (6, 12, 1, 1.0, 1.0, 0), (10, 25, 8, 2.0, 0.8, 0)]


@pytest.mark.parametrize("shape", SHAPES)
def test_topk_support_values_and_exact_ddot_equal_autograd(shape):
    N, V, K, sc, mm, pk = shape
    c = make_case(N, V, K, scale=sc, mismatch=mm, peaked_rows=pk, seed=12)
    outside = ~(c["topk_ids"] == c["sampled_ids"][:, None]).any(-1)
    assert outside.any()  # the rows the support changes
    st = stats_of(c, support=TOPK)
    pi = torch.softmax(c["logits"], -1)
    for name in TOPK_DIVERGENCES:  # every registered one, on the support "topk"
        fn = topk_only_fn(c, name)
        torch.testing.assert_close(st[name], fn(None, pi), rtol=1e-9, atol=1e-12)
        want = ddot_autograd(fn, c["logits"], c["sampled_ids"])
        torch.testing.assert_close(st[f"ddot_{name}_exact"], want, rtol=1e-7, atol=1e-11)
    # the tail now holds k: pi_T and mu_T include pi_k and mu_k where k is outside
    d = stats_of(c)
    pk_ = c["rollout_logprob"].exp()
    torch.testing.assert_close(st["policy_tail_mass"][outside],
                               d["policy_tail_mass"][outside] + st["logp"][outside].exp(), rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(st["rollout_tail_mass"][outside], d["rollout_tail_mass"][outside] + pk_[outside],
                               rtol=1e-10, atol=1e-14)


def test_topk_support_ddot_finite_difference():
    """Independent of autograd: (D(z + h u) - D(z - h u)) / 2h with u = e_k - pi."""
    c = make_case(6, 25, 3, seed=12)
    st = stats_of(c, support=TOPK)
    z, k = c["logits"], c["sampled_ids"]
    pi = torch.softmax(z, -1)
    u = -pi
    u[torch.arange(len(k)), k] += 1
    h = 1e-6
    fn = topk_only_fn(c, "kl")
    fd = (fn(None, torch.softmax(z + h * u, -1)) - fn(None, torch.softmax(z - h * u, -1))) / (2 * h)
    torch.testing.assert_close(st["ddot_topk_kl_exact"], fd, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("seed", range(2))
def test_topk_support_with_k_equal_v_every_estimator_is_the_full_ddot(seed):
    c = make_case(7, 16, 16, seed=seed, scale=2.0)
    st = stats_of(c, support=TOPK)
    for kind in ("kl", "tv"):
        for est in ESTIMATORS:
            torch.testing.assert_close(st[f"ddot_topk_{kind}_{est}"], st[f"ddot_full_{kind}"], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(st[f"topk_{kind}"], st[f"full_{kind}"], rtol=1e-9, atol=1e-12)


def test_topk_support_estimators_differ_only_through_the_tail():
    """METHOD.md's table holds for the top-K support too, with |S| = K and P2 the tail's."""
    c = make_case(6, 40, 3, seed=5, mismatch=1.0)
    st = stats_of(c, support=TOPK)
    pT, mT = st["policy_tail_mass"], st["rollout_tail_mass"]
    agg, trunc, uni = (st[f"ddot_topk_kl_{e}"] for e in ("aggregated", "truncated", "uniform"))
    torch.testing.assert_close(agg - trunc, pT * (mT - pT), rtol=1e-9, atol=1e-13)
    torch.testing.assert_close(uni - trunc, pT * (mT - pT) / (40 - 3), rtol=1e-9, atol=1e-13)


# ------------------------------------------------------------------ the option's checks
@pytest.mark.parametrize("call", [
    lambda z, r: pdmask.token_stats(z, r, support="sampled"),
    lambda z, r: pdmask.policy_loss(z, r, torch.ones(1, dtype=F64), support="sampled"),
    lambda z, r: pdmask.trust_region_mask(z, r, torch.ones(1, dtype=F64), support="sampled"),
    lambda z, r: pdmask.policy_loss_from_hidden(z, torch.eye(z.shape[-1], dtype=F64), r, torch.ones(1, dtype=F64),
                                                support="sampled"),
    lambda z, r: pdmask.PolicyLoss(support="sampled"),
])
def test_unknown_support_is_one_line_listing_the_valid_values(call):
    z, r = issue_example()
    with pytest.raises(ValueError, match=r"^support: unknown value 'sampled'; valid values are: topk\+sampled, "
                                         r"topk$"):
        call(z, r)


def test_support_refused_where_it_cannot_apply():
    import pdmask_lab.batchmask  # noqa: F401  (registers the pdm-batch-* modes)

    with pytest.raises(ValueError, match=r"^support: mode 'pdm-batch-topk-kl' works on the support topk\+sampled "
                                         r"only, not 'topk'"):
        pdmask.PolicyLoss(mode="pdm-batch-topk-kl", support=TOPK)
    spec = pdmask.PolicyLoss(mode="dppo-topk-kl", support=TOPK)
    z, r = issue_example()
    st = pdmask.token_stats(z, r, support=TOPK)
    with pytest.raises(ValueError, match=r"^support: from_stats takes statistics already computed"):
        spec.from_stats(st, torch.ones(1, dtype=F64), torch.ones(1, 1, dtype=torch.bool))


def test_trainer_config_carries_the_support():
    from pdmask.train.config import TrainConfig, load_config

    assert TrainConfig(loss={"mode": "dppo-topk-kl", "support": TOPK}).loss.support == TOPK
    assert TrainConfig().loss.support == "topk+sampled"
    with pytest.raises(ValueError, match=r"^support: unknown value 'x'; valid values are: topk\+sampled, topk$"):
        load_config(None, ["support=x"])
    with pytest.raises(ValueError, match=r"^loss.support: mode 'pdm-batch-topk-kl'"):
        load_config(None, ["loss.mode=pdm-batch-topk-kl", f"loss.support={TOPK}"])


def test_default_support_unchanged_by_the_option():
    """``support="topk+sampled"`` is the default everywhere: passing it changes nothing."""
    z, r = random_batch(B=1, T=6, seed=4)
    a, b = pdmask.token_stats(z, r), pdmask.token_stats(z, r, support="topk+sampled")
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert math.isfinite(a["topk_kl"].sum().item())


@pytest.mark.parametrize("support", ["topk+sampled", TOPK])
def test_sampled_token_with_zero_probability_and_an_empty_tail_stays_finite(support):
    """k outside the top-K with a -inf logit, and every other tail logit -inf: pi_k = pi_T = 0
    (for ``"topk"`` the tail's share pi_k / pi_T is 0/0, taken as 0)."""
    z = torch.tensor([[[1.0, 2.0, -math.inf, -math.inf]]], dtype=F64)
    r = pdmask.Rollout(torch.tensor([[2]]), torch.tensor([[math.log(0.1)]], dtype=F64), torch.tensor([[[1, 0]]]),
                       torch.tensor([[[math.log(0.5), math.log(0.3)]]], dtype=F64))
    st = pdmask.token_stats(z, r, support=support)
    assert st["policy_tail_mass"].item() == 0.0
    for key, v in st.items():
        if v.dtype.is_floating_point and key not in ("logp", "log_ratio"):
            assert torch.isfinite(v).all(), key
