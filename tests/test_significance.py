"""pdmask_lab.significance: hand-worked values, independent brute-force references, properties."""

import itertools
import math
from fractions import Fraction

import pytest

np = pytest.importorskip("numpy")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pdmask_lab.significance import (  # noqa: E402
    binomial_test,
    format_interval,
    format_p,
    format_rate,
    mcnemar_exact,
    min_sign_flip_p,
    paired_difference,
    paired_ratio_difference,
    pooled_ratio,
    sign_flip_test,
)


# ------------------------------------------------------------------ exact binomial / McNemar
def test_binomial_n10_k2_hand_worked():
    # X ~ Bin(10, 1/2), pmf C(10, i) / 1024:  i = 0..10 -> 1 10 45 120 210 252 210 120 45 10 1
    # P(X = 2) = 45/1024. Outcomes no likelier than that: i in {0, 1, 2, 8, 9, 10}
    # p = (1 + 10 + 45 + 45 + 10 + 1) / 1024 = 112 / 1024 = 0.109375
    assert binomial_test(2, 10) == 112 / 1024
    assert binomial_test(8, 10) == 112 / 1024
    # k = 5 is the mode: every outcome is no likelier, p = 1
    assert binomial_test(5, 10) == 1.0


def test_mcnemar_b1_c9_hand_worked():
    # 10 discordant pairs, 1 goes to A: Bin(10, 1/2) at 1
    # p = P(0) + P(1) + P(9) + P(10) = (1 + 10 + 10 + 1) / 1024 = 22 / 1024 = 0.021484375
    assert mcnemar_exact(1, 9) == 22 / 1024
    assert mcnemar_exact(9, 1) == 22 / 1024
    # no discordant pairs: nothing to test, p = 1
    assert mcnemar_exact(0, 0) == 1.0


def test_binomial_general_p_hand_worked():
    # X ~ Bin(4, 1/4), pmf * 256: i = 0..4 -> 81 108 54 12 1
    # k = 3 (12/256): outcomes no likelier are i = 3, 4 -> p = 13/256 = 0.05078125
    assert binomial_test(3, 4, 0.25) == pytest.approx(13 / 256, rel=1e-12)
    # k = 0 (81/256): no likelier: 0, 2, 3, 4 -> (81 + 54 + 12 + 1)/256 = 148/256
    assert binomial_test(0, 4, 0.25) == pytest.approx(148 / 256, rel=1e-12)
    # a degenerate binomial: certain or impossible observations
    assert binomial_test(0, 5, 0.0) == 1.0 and binomial_test(1, 5, 0.0) == 0.0


def _binom_reference(k, n, p):
    """The definition, in exact rationals (p given as a Fraction)."""
    pmf = [math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(n + 1)]
    return float(sum(q for q in pmf if q <= pmf[k]))


@pytest.mark.parametrize("k,n,p", [(37, 100, Fraction(1, 2)), (0, 1, Fraction(1, 2)), (13, 40, Fraction(1, 3)),
                                   (7, 30, Fraction(1, 10)), (29, 30, Fraction(9, 10))])
def test_binomial_matches_exact_rationals(k, n, p):
    assert binomial_test(k, n, float(p)) == pytest.approx(_binom_reference(k, n, p), rel=1e-10)


def test_binomial_large_n_uses_log_space_and_agrees():
    # above the integer path (n > 5000): log-space pmf; p = 1/2 is symmetric so the
    # two-sided p is 2 P(X <= k) for k < n/2; check against an exact rational computed here
    n, k = 6000, 2900
    tail = sum(math.comb(n, i) for i in range(k + 1))
    assert binomial_test(k, n) == pytest.approx(2 * tail / 2 ** n, rel=1e-9)


@pytest.mark.parametrize("call,msg", [
    (lambda: binomial_test(11, 10), "k:"), (lambda: binomial_test(-1, 10), "k:"), (lambda: binomial_test(2.5, 10), "k:"),
    (lambda: binomial_test(2, 10, 1.5), "p:"), (lambda: mcnemar_exact(-1, 3), "b:"),
    (lambda: pooled_ratio([1, 2], [1]), "num, den"), (lambda: pooled_ratio([1], [-1]), "den:"),
    (lambda: pooled_ratio([float("nan")], [1]), "num:"), (lambda: pooled_ratio([1], [1], level=1.0), "level:"),
    (lambda: paired_difference([1, 2], [1, 2], n_boot=0), "n_boot:"),
    (lambda: paired_difference([[1, 2]], [[1, 2]]), "x:"), (lambda: sign_flip_test([]), "d:"),
])
def test_bad_input_names_the_argument(call, msg):
    with pytest.raises(ValueError, match=msg):
        call()


# ------------------------------------------------------------------ sign flip
def test_sign_flip_four_seeds_enumerated_by_hand():
    # d = (1, 2, 3, -0.5), observed sum 5.5. The 16 sums +-1 +-2 +-3 +-0.5 are
    #   +-6.5 (1+2+3+.5), +-5.5 (1+2+3-.5), +-4.5 (-1+2+3+.5), +-3.5, +-2.5 (1-2+3+.5), +-1.5,
    #   +-0.5 (1+2-3+.5; -1-2+3+.5), +-0.5 again, ... ; |sum| >= 5.5 only for +-6.5 and +-5.5
    # p = 4 / 16 = 0.25
    r = sign_flip_test([1, 2, 3, -0.5])
    assert (r.p, r.method, r.n_assignments, r.min_p) == (0.25, "exact", 16, 0.125)
    # all four of one sign: only the observed assignment and its mirror, p = 2/16
    assert sign_flip_test([1, 2, 3, 4]).p == 0.125 == min_sign_flip_p(4)
    # zero differences carry no sign: d = (0, 0, 1) -> sums +-1, p = 1
    assert sign_flip_test([0.0, 0.0, 1.0]).p == 1.0
    assert sign_flip_test([0.0, 0.0]).p == 1.0


def _brute_sign_flip(d):
    d = [float(v) for v in d]
    obs = abs(sum(d))
    tol = 1e-9 * sum(abs(v) for v in d)
    hits = sum(abs(sum(s * v for s, v in zip(signs, d))) >= obs - tol
               for signs in itertools.product((1, -1), repeat=len(d)))
    return hits / 2 ** len(d)


@pytest.mark.parametrize("n", [1, 3, 8, 12])
def test_sign_flip_exact_matches_itertools(n):
    d = np.random.default_rng(n).normal(0.4, 1.0, n)
    assert sign_flip_test(d).p == pytest.approx(_brute_sign_flip(d), abs=1e-15)


def test_sign_flip_monte_carlo_matches_exact_within_its_error():
    # n = 18 > 16: Monte Carlo. Exact answer by enumerating 2^18 assignments here.
    d = np.random.default_rng(5).normal(0.35, 1.0, 18)
    bits = (np.arange(2 ** 18)[:, None] >> np.arange(18)) & 1
    t = np.abs((1 - 2 * bits) @ d)
    exact = float((t >= abs(d.sum()) - 1e-9 * np.abs(d).sum()).mean())
    r = sign_flip_test(d, n_perm=50_000, seed=3)
    assert r.method == "monte-carlo" and r.n_assignments == 50_000
    se = math.sqrt(exact * (1 - exact) / 50_000)
    assert abs(r.p - exact) < 5 * se + 1 / 50_001
    # deterministic given the seed
    assert sign_flip_test(d, n_perm=50_000, seed=3).p == r.p
    # all-positive, 20 pairs: exact p would be 2/2^20; MC counts the observed draw: p >= 1/(1+draws)
    r = sign_flip_test(np.ones(20), n_perm=1000)
    assert r.p == pytest.approx(1 / 1001, abs=3 / 1001) and r.p >= 1 / 1001


def test_paired_difference_hand_worked():
    # d = x - y = (0.10, 0.05, -0.02, 0.07): mean 0.05, 3 wins 1 loss, observed sum 0.20.
    # Sign flips: with 0.10, 0.05, 0.07 all +, the sum is 0.22 +- 0.02 = 0.24 or 0.20 (both
    # >= 0.20); flipping any of the three leaves at most 0.22 - 2*0.05 + 0.02 = 0.14 < 0.20.
    # So 2 assignments and their 2 mirrors reach |sum| >= 0.20: p = 4/16 = 0.25
    x = np.array([0.80, 0.75, 0.70, 0.77])
    y = np.array([0.70, 0.70, 0.72, 0.70])
    r = paired_difference(x, y)
    assert r.estimate == pytest.approx(0.05) and (r.wins, r.losses, r.n) == (3, 1, 4)
    assert r.p == 0.25 and r.min_p == 0.125
    assert r.lo <= r.estimate <= r.hi
    # the bootstrap mean of 4 seeds can only take values in [min d, max d]
    assert -0.02 - 1e-12 <= r.lo and r.hi <= 0.10 + 1e-12
    # one seed: no interval, and the sign-flip test cannot reject (p = 2/2 = 1)
    one = paired_difference([0.8], [0.7])
    assert math.isnan(one.lo) and math.isnan(one.hi) and one.p == 1.0


def test_paired_difference_bootstrap_equals_naive_loop():
    d = np.array([0.3, -0.1, 0.25, 0.4, 0.05])
    r = paired_difference(d, np.zeros(5), n_boot=2000, seed=11)
    idx = np.random.default_rng(11).integers(0, 5, size=(2000, 5))
    means = [d[i].sum() / 5 for i in idx]
    lo, hi = np.quantile(means, [0.025, 0.975])
    assert (r.lo, r.hi) == pytest.approx((lo, hi), abs=1e-15)


# ------------------------------------------------------------------ pooled ratios
def test_pooled_and_per_seed_mean_disagree():
    # seed 0: 1 of 1 token; seed 1: 10 of 100 tokens.
    # per-seed mean of rates: (1/1 + 10/100)/2 = 0.55 -- the one-token seed weighs as much
    # as the hundred-token one. Pooled: (1 + 10)/(1 + 100) = 11/101 = 0.1089...
    r = pooled_ratio([1, 10], [1, 100])
    assert r.estimate == 11 / 101 and r.per_cluster_mean == pytest.approx(0.55)
    assert (r.num, r.den, r.n_clusters) == (11, 101, 2)
    # two clusters: resamples {0,0} -> 1, {0,1} -> 11/101, {1,1} -> 0.1, each at least
    # 1/4 of the time, so the 2.5% and 97.5% quantiles are 0.1 and 1.0
    assert (r.lo, r.hi) == (0.1, 1.0)
    assert format_rate(r.estimate, r.lo, r.hi, n_units=r.den, n_seeds=r.n_clusters) == \
        "0.109 [0.100, 1.000] (101 tokens, 2 seeds)"


def test_pooled_ratio_bootstrap_equals_naive_loop():
    num = np.array([3, 0, 7, 2, 5.0])
    den = np.array([40, 10, 60, 20, 45.0])
    r = pooled_ratio(num, den, n_boot=3000, seed=7)
    idx = np.random.default_rng(7).integers(0, 5, size=(3000, 5))
    vals = [num[i].sum() / den[i].sum() for i in idx]
    assert (r.lo, r.hi) == pytest.approx(tuple(np.quantile(vals, [0.025, 0.975])), abs=1e-15)
    assert r.n_undefined == 0 and r.estimate == 17 / 175


def test_pooled_ratio_zero_denominator_resamples_are_counted_not_hidden():
    # only seed 0 has tokens; a resample without it has sum(den) = 0: P = (2/3)^3 = 8/27
    r = pooled_ratio([1, 0, 0], [2, 0, 0], n_boot=20_000, seed=0)
    assert r.estimate == 0.5 and r.lo == r.hi == 0.5  # every defined resample is 1/2 (or 2/4, 3/6)
    expect, sd = 20_000 * 8 / 27, math.sqrt(20_000 * (8 / 27) * (19 / 27))
    assert abs(r.n_undefined - expect) < 5 * sd
    # no tokens at all: no rate, no interval
    z = pooled_ratio([0, 0], [0, 0])
    assert math.isnan(z.estimate) and math.isnan(z.lo) and math.isnan(z.per_cluster_mean)


def test_paired_ratio_difference_hand_worked():
    # unsafe-keep counts on 3 seeds: predictive 2/10, 1/5, 3/15 (pooled 6/30 = 0.2);
    # ratio 4/10, 2/5, 6/15 (pooled 12/30 = 0.4). Every seed's difference is -0.2, and
    # every resample's pooled difference is too: a zero-width interval at -0.2.
    r = paired_ratio_difference([2, 1, 3], [10, 5, 15], [4, 2, 6], [10, 5, 15])
    assert r.estimate == pytest.approx(-0.2) and (r.a, r.b) == pytest.approx((0.2, 0.4))
    assert r.lo == pytest.approx(-0.2) and r.hi == pytest.approx(-0.2)
    assert (format_interval(r.estimate, r.lo, r.hi, sign=True), format_p(mcnemar_exact(1, 9))) == (
        "-0.200 [-0.200, -0.200]", "p = 0.0215")


def test_paired_ratio_difference_equals_naive_loop():
    na, da = np.array([5, 2, 9, 4.0]), np.array([20, 10, 30, 25.0])
    nb, db = np.array([7, 2, 8, 9.0]), np.array([20, 10, 30, 25.0])
    r = paired_ratio_difference(na, da, nb, db, n_boot=1000, seed=2)
    idx = np.random.default_rng(2).integers(0, 4, size=(1000, 4))
    vals = [na[i].sum() / da[i].sum() - nb[i].sum() / db[i].sum() for i in idx]
    assert (r.lo, r.hi) == pytest.approx(tuple(np.quantile(vals, [0.025, 0.975])), abs=1e-15)


def test_deterministic_given_seed():
    g = np.random.default_rng(0)
    den = g.integers(50, 500, 12).astype(float)
    num = np.floor(den * g.uniform(0.05, 0.3, 12))
    a, b = pooled_ratio(num, den, n_boot=500, seed=4), pooled_ratio(num, den, n_boot=500, seed=4)
    assert a == b
    c = pooled_ratio(num, den, n_boot=500, seed=5)  # another seed: other resamples
    assert (a.lo, a.hi) != (c.lo, c.hi) and a.estimate == c.estimate


# ------------------------------------------------------------------ formatting
def test_formatting():
    assert format_p(112 / 1024) == "p = 0.109"
    assert format_p(0.0625) == "p = 0.0625"
    assert format_p(1.0) == "p = 1"
    assert format_p(3.2e-7) == "p = 3.2e-07"
    assert format_p(0.0) == "p < 1e-300" and format_p(float("nan")) == "p = n/a"
    assert format_rate(0.5, 0.25, 0.75, n_units=1234, n_seeds=1) == "0.500 [0.250, 0.750] (1,234 tokens, 1 seed)"
    assert format_rate(0.034, 0.02, 0.05, n_units=800, n_seeds=8, spec=".1%") == "3.4% [2.0%, 5.0%] (800 tokens, 8 seeds)"
    assert format_interval(1e-4, float("nan"), float("nan"), spec=".2e") == "1.00e-04 [n/a]"
    r = paired_difference([0.8, 0.75, 0.7, 0.77], [0.7, 0.7, 0.72, 0.7])
    assert format_p(r.p) == "p = 0.25" and format_interval(r.estimate, r.lo, r.hi, sign=True).startswith("+0.050 [")


# ------------------------------------------------------------------ properties
counts = st.integers(min_value=0, max_value=200)


@settings(max_examples=200, deadline=None)
@given(counts, counts, st.sampled_from([0.5, 0.1, 0.3, 0.9]))
def test_binomial_p_in_unit_interval_and_symmetric(a, b, p):
    k, n = min(a, b), max(a, b)
    v = binomial_test(k, n, p)
    assert 0.0 <= v <= 1.0
    # Bin(n, p) at k is Bin(n, 1 - p) at n - k
    assert v == pytest.approx(binomial_test(n - k, n, 1 - p), rel=1e-9, abs=1e-300)
    assert mcnemar_exact(a, b) == mcnemar_exact(b, a)


finite = st.floats(min_value=-5, max_value=5, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(finite, finite), min_size=1, max_size=10))
def test_paired_difference_properties(pairs):
    x, y = np.array(pairs).T
    r = paired_difference(x, y, n_boot=300)
    s = paired_difference(y, x, n_boot=300)
    assert 0.0 <= r.p <= 1.0 and r.p == s.p  # swapping the conditions flips every sign: same p
    assert r.estimate == pytest.approx(-s.estimate, abs=1e-12)
    if len(pairs) >= 2:  # the same resamples, mirrored
        assert (r.lo, r.hi) == pytest.approx((-s.hi, -s.lo), abs=1e-9)
        assert r.lo - 1e-12 <= r.estimate <= r.hi + 1e-12


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(1, 50), st.integers(0, 50)), min_size=2, max_size=8))
def test_pooled_ratio_properties(rows):
    num = np.array([min(a, d) for a, d, _ in rows], float)
    den = np.array([d for _, d, _ in rows], float)
    numb = np.array([min(b, d) for _, d, b in rows], float)
    r = pooled_ratio(num, den, n_boot=300)
    assert 0.0 <= r.lo <= r.estimate <= r.hi <= 1.0  # counts within their tokens: a rate
    d = paired_ratio_difference(num, den, numb, den, n_boot=300)
    e = paired_ratio_difference(numb, den, num, den, n_boot=300)
    assert d.estimate == pytest.approx(-e.estimate, abs=1e-12)
    assert (d.lo, d.hi) == pytest.approx((-e.hi, -e.lo), abs=1e-9)
    assert d.lo - 1e-12 <= d.estimate <= d.hi + 1e-12


# ------------------------------------------------------------------ Clopper-Pearson
def test_clopper_pearson_hand_worked():
    from pdmask_lab.significance import clopper_pearson

    # k = 0: lo = 0 and P(X = 0 | hi) = (1 - hi)^n = 0.025  ->  hi = 1 - 0.025^(1/n)
    lo, hi = clopper_pearson(0, 8)
    assert lo == 0.0 and hi == pytest.approx(1 - 0.025 ** (1 / 8), abs=1e-12)  # 0.3694
    # k = n: hi = 1 and P(X = n | lo) = lo^n = 0.025  ->  lo = 0.025^(1/n)
    lo, hi = clopper_pearson(8, 8)
    assert hi == 1.0 and lo == pytest.approx(0.025 ** (1 / 8), abs=1e-12)  # 0.6306
    # k = 1, n = 2: P(X >= 1 | lo) = 1 - (1 - lo)^2 = 0.025 -> lo = 1 - sqrt(0.975); by symmetry hi = sqrt(0.975)
    lo, hi = clopper_pearson(1, 2)
    assert (lo, hi) == pytest.approx((1 - math.sqrt(0.975), math.sqrt(0.975)), abs=1e-12)
    assert all(math.isnan(v) for v in clopper_pearson(0, 0))


@pytest.mark.parametrize("k,n", [(1, 10), (4, 8), (3, 7), (6, 8), (17, 40)])
def test_clopper_pearson_solves_its_defining_equations(k, n):
    from pdmask_lab.significance import clopper_pearson

    def cdf(j, p):  # P(X <= j), exact rationals of the binomial coefficients
        return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(j + 1))

    lo, hi = clopper_pearson(k, n)
    assert 0 < lo < k / n < hi < 1
    assert 1 - cdf(k - 1, lo) == pytest.approx(0.025, abs=1e-10)  # P(X >= k | lo)
    assert cdf(k, hi) == pytest.approx(0.025, abs=1e-10)  # P(X <= k | hi)
    lo90, hi90 = clopper_pearson(k, n, level=0.90)
    assert lo < lo90 and hi90 < hi  # a lower level gives a narrower interval


def test_clopper_pearson_bad_input():
    from pdmask_lab.significance import clopper_pearson

    with pytest.raises(ValueError, match="k: must be <= n"):
        clopper_pearson(3, 2)
    with pytest.raises(ValueError, match="level"):
        clopper_pearson(1, 2, level=1.5)
