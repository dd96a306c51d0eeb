"""Every closed form against autograd / finite differences in float64. The top-K tests run over
every registered top-K divergence (:data:`pdmask.keys.TOPK_DIVERGENCES`): a divergence is tested
the moment it is registered, and its value against the restatement in ``helpers.TOPK_ORACLES``."""

import pytest
import torch

from pdmask.keys import ESTIMATORS, TOPK_DIVERGENCES

from .helpers import (
    F64, TOPK_ORACLES, ddot_autograd, full_divergence_fn, full_kl_fn, full_tv_fn, make_case, stats_of,
    topk_divergence_fn,
)

TOPK = list(TOPK_DIVERGENCES)

SHAPES = [  # (N, V, K, scale, mismatch, peaked_rows)
    (8, 30, 4, 1.5, 0.5, 0),  # generic
    (8, 30, 4, 0.05, 0.02, 0),  # flat distributions
    (8, 50, 3, 4.0, 1.0, 3),  # peaked and very peaked rows
    (6, 12, 1, 1.0, 1.0, 0),  # K = 1
    (6, 20, 20, 1.0, 0.7, 0),  # K = V
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_divergence_values_match_direct_formulas(shape, temperature):
    N, V, K, sc, mm, pk = shape
    c = make_case(N, V, K, scale=sc, mismatch=mm, peaked_rows=pk, seed=1, temperature=temperature)
    st = stats_of(c)
    pi = torch.softmax(c["logits"] / temperature, -1)
    mu = c["logmu"].exp()
    torch.testing.assert_close(st["full_kl"], full_kl_fn(mu, pi), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(st["full_tv"], full_tv_fn(mu, pi), rtol=1e-9, atol=1e-12)
    for name in TOPK:
        want = topk_divergence_fn(c, name)(None, pi)
        torch.testing.assert_close(st[name], want, rtol=1e-8, atol=1e-12)
        # Top-K forms are lower bounds of the full divergence (a coarsening of the vocabulary).
        assert (st[name] <= full_divergence_fn(TOPK_ORACLES[name])(mu, pi) + 1e-12).all()


def test_every_registered_divergence_has_its_oracle():
    """A registration without a restatement of its value in tests/core/helpers.py fails here."""
    assert set(TOPK) == set(TOPK_ORACLES), set(TOPK) ^ set(TOPK_ORACLES)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_full_ddot_equals_autograd(shape, temperature):
    N, V, K, sc, mm, pk = shape
    c = make_case(N, V, K, scale=sc, mismatch=mm, peaked_rows=pk, seed=2, temperature=temperature)
    st = stats_of(c)
    mu = c["logmu"].exp()
    for name, fn in (("kl", full_kl_fn), ("tv", full_tv_fn)):
        want = ddot_autograd(fn, c["logits"], c["sampled_ids"], mu, temperature=temperature)
        torch.testing.assert_close(st[f"ddot_full_{name}"], want, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("name", TOPK)
@pytest.mark.parametrize("shape", SHAPES)
def test_exact_topk_ddot_equals_autograd_of_topk_divergence(shape, name):
    """The exact estimator is the derivative of the very divergence the proximity test uses."""
    N, V, K, sc, mm, pk = shape
    c = make_case(N, V, K, scale=sc, mismatch=mm, peaked_rows=pk, seed=3)
    st = stats_of(c)
    want = ddot_autograd(topk_divergence_fn(c, name), c["logits"], c["sampled_ids"])
    torch.testing.assert_close(st[f"ddot_{name}_exact"], want, rtol=1e-7, atol=1e-11)


def test_ddot_is_a_directional_derivative_finite_difference():
    """Independent of autograd: (D(z + h u) - D(z - h u)) / 2h with u = e_k - pi."""
    c = make_case(5, 25, 4, seed=4)
    st = stats_of(c)
    z, k = c["logits"], c["sampled_ids"]
    pi = torch.softmax(z, -1)
    u = -pi
    u[torch.arange(len(k)), k] += 1
    mu = c["logmu"].exp()
    h = 1e-6
    fns = [("full_kl", lambda p: full_kl_fn(mu, p))]
    fns += [(f"{name}_exact", lambda p, name=name: topk_divergence_fn(c, name)(None, p)) for name in TOPK]
    for name, fn in fns:
        fd = (fn(torch.softmax(z + h * u, -1)) - fn(torch.softmax(z - h * u, -1))) / (2 * h)
        torch.testing.assert_close(st[f"ddot_{name}"], fd, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_with_k_equal_v_every_estimator_is_the_full_ddot(seed):
    c = make_case(7, 16, 16, seed=seed, scale=2.0)
    st = stats_of(c)
    mu = c["logmu"].exp()
    for name in TOPK:  # the full-vocabulary derivative: the library's (kl, tv) or autograd's
        fn = full_divergence_fn(TOPK_ORACLES[name])
        full = name.replace("topk_", "full_")
        want = st[f"ddot_{full}"] if full in st else ddot_autograd(fn, c["logits"], c["sampled_ids"], mu)
        for est in ESTIMATORS:
            torch.testing.assert_close(st[f"ddot_{name}_{est}"], want, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(st[name], fn(mu, torch.softmax(c["logits"], -1)), rtol=1e-9, atol=1e-12)


def test_estimators_differ_only_through_the_tail():
    """Hand-checked relations of the KL estimators on one case (METHOD.md's table)."""
    c = make_case(6, 40, 3, seed=5, mismatch=1.0)
    st = stats_of(c)
    pT, mT = st["policy_tail_mass"], st["rollout_tail_mass"]
    agg, trunc, uni = (st[f"ddot_topk_kl_{e}"] for e in ("aggregated", "truncated", "uniform"))
    # aggregated adds pi_T (mu_T - pi_T) to the truncated value
    torch.testing.assert_close(agg - trunc, pT * (mT - pT), rtol=1e-9, atol=1e-13)
    # uniform adds the same divided by V - |S'| (|S'| = K + 1 when k is outside the top-K)
    n = 40 - 3 - (~st["sampled_in_topk"]).to(F64)
    torch.testing.assert_close(uni - trunc, pT * (mT - pT) / n, rtol=1e-9, atol=1e-13)


def test_binary_predictive_direction_equals_ratio_direction_on_every_token():
    c = make_case(400, 30, 5, seed=6, scale=3.0, mismatch=1.5, peaked_rows=50)
    st = stats_of(c)
    ratio_sign = torch.sign(st["log_ratio"])
    for name in ("binary_tv", "binary_kl"):
        assert torch.equal(torch.sign(st[f"ddot_{name}"]), ratio_sign), name
        # and the closed form is the true derivative of the binary divergence
        k = c["sampled_ids"]
        mu_k = c["rollout_logprob"].exp()

        def fn(_mu, pi, name=name):
            pk = pi.gather(1, k[:, None]).squeeze(1)
            if name == "binary_tv":
                return (pk - mu_k).abs()
            return mu_k * torch.log(mu_k / pk) + (1 - mu_k) * torch.log((1 - mu_k) / (1 - pk))

        want = ddot_autograd(fn, c["logits"], k)
        ok = torch.isfinite(want)  # the naive oracle is 0 * log 0 = NaN where mu_k rounds to 1
        assert ok.float().mean() > 0.95
        torch.testing.assert_close(st[f"ddot_{name}"][ok], want[ok], rtol=1e-6, atol=1e-12)


def test_ddot_autograd_accepts_any_divergence():
    """A divergence with no closed form in the library (squared Hellinger) has the general-form
    derivative ``pi_k (g_k - gbar) - sum pi^2 (g - gbar)`` with g = dD/dpi."""
    c = make_case(5, 20, 3, seed=7)
    mu = c["logmu"].exp()

    def hellinger(m, p):
        return 0.5 * ((m.sqrt() - p.sqrt()) ** 2).sum(-1)

    got = ddot_autograd(hellinger, c["logits"], c["sampled_ids"], mu)
    pi = torch.softmax(c["logits"], -1)
    g = 0.5 * (1 - (mu / pi).sqrt())  # dD/dpi
    gbar = (pi * g).sum(-1, keepdim=True)
    k = c["sampled_ids"][:, None]
    want = (pi.gather(1, k) * (g.gather(1, k) - gbar)).squeeze(1) - (pi**2 * (g - gbar)).sum(-1)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)


@pytest.mark.usefixtures("one_thread")  # bitwise: row-wise ops, the same per row at any chunk, on one thread
def test_chunking_does_not_change_any_statistic():
    c = make_case(13, 37, 4, seed=8)
    a = stats_of(c)
    for chunk in (1, 5, 13, 100):
        b = stats_of(c, chunk_size=chunk)
        for key in a:
            if key != "logp":
                assert torch.equal(a[key], b[key]), (key, chunk)
