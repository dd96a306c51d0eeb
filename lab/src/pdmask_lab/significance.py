"""The project's statistics: pooled ratios over seeds, exact tests, paired seed comparisons.

Pure numpy (no scipy), deterministic for a given ``seed``. Used by the audit (pooled
token rates with a seed-cluster bootstrap, exact binomial / McNemar tests), by
``pdmask compare`` (paired per-seed differences between mask modes) and by the
batch-mask evaluation.

Conventions, stated once:

- A **cluster** is one seed (one run): tokens of a seed are not independent, so every
  interval resamples whole seeds, never tokens.
- Intervals are **percentile bootstrap** intervals: ``B`` resamples of the clusters with
  replacement, the statistic recomputed on each, and the ``(1 - level) / 2`` and
  ``(1 + level) / 2`` quantiles of those values (numpy's default linear interpolation
  between order statistics). With fewer than 2 clusters there is no interval (``nan``).
  With a handful of seeds a percentile interval is narrower than it should be; it
  describes the seeds at hand, it does not make them more.
- p-values are two-sided and exact where the brief allows: the binomial/McNemar tests
  by summing the binomial pmf, the sign-flip test by enumerating all ``2**n``
  assignments for ``n <= 16`` (Monte Carlo above that, with the observed assignment
  counted: ``(1 + hits) / (1 + draws)``).

Every result object has ``to_dict()`` (JSON-ready) and the ``format_*`` helpers print
them the same way everywhere: ``0.109 [0.050, 0.200] (101 tokens, 2 seeds)`` and
``p = 0.0215``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

#: bootstrap resamples used when a caller does not say
DEFAULT_N_BOOT = 10_000
#: two-sided coverage of the intervals
DEFAULT_LEVEL = 0.95
#: the sign-flip test enumerates all 2**n assignments up to this many pairs
EXACT_SIGN_FLIP_MAX_N = 16
#: Monte Carlo sign-flip draws above EXACT_SIGN_FLIP_MAX_N pairs
DEFAULT_N_PERM = 100_000
#: relative tolerance for "as extreme as the observed" (pmf ties, statistic ties)
_TIE_RTOL = 1e-7
#: binomial_test(p=0.5) sums exact integers C(n, i) up to this n (log-space pmf above)
_EXACT_INT_MAX_N = 5_000
#: cap on the elements of one resampling chunk (keeps memory flat for many clusters)
_CHUNK_ELEMS = 2_000_000


# ------------------------------------------------------------------ input checks
def _vec(name: str, x, *, min_len: int = 1) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array (one value per seed), got shape {a.shape}")
    if a.size < min_len:
        raise ValueError(f"{name}: expected at least {min_len} value(s), got {a.size}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name}: contains NaN or inf at index {int(np.flatnonzero(~np.isfinite(a))[0])}")
    return a


def _same_len(**arrays: np.ndarray) -> None:
    lens = {k: v.size for k, v in arrays.items()}
    if len(set(lens.values())) > 1:
        raise ValueError(f"{', '.join(lens)}: must have the same length (one entry per seed), got {lens}")


def _check_boot(n_boot: int, level: float) -> None:
    if not isinstance(n_boot, (int, np.integer)) or n_boot < 1:
        raise ValueError(f"n_boot: must be a positive integer, got {n_boot!r}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level: must be in (0, 1), got {level!r}")


def _nonneg(name: str, a: np.ndarray) -> None:
    if np.any(a < 0):
        raise ValueError(f"{name}: must be >= 0 (counts or weights), got {a.min()!r} at index {int(a.argmin())}")


def _resample_sums(cols: list[np.ndarray], n_boot: int, seed: int):
    """Yield, chunk by chunk, the column sums of ``B`` cluster resamples.

    Resample b draws ``n`` cluster indices uniformly with replacement; for each column c
    it yields ``sum_i c[idx_b[i]]``. Chunking keeps memory at O(chunk * n)."""
    n = cols[0].size
    rng = np.random.default_rng(seed)
    chunk = max(1, _CHUNK_ELEMS // n)
    done = 0
    while done < n_boot:
        m = min(chunk, n_boot - done)
        idx = rng.integers(0, n, size=(m, n))  # (m, n) cluster indices
        yield [c[idx].sum(axis=1) for c in cols]
        done += m


def _percentile(values: np.ndarray, level: float) -> tuple[float, float]:
    if values.size == 0:
        return math.nan, math.nan
    lo, hi = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


# ------------------------------------------------------------------ pooled ratios
@dataclass(frozen=True)
class PooledRatio:
    """``estimate = sum(num) / sum(den)`` over clusters, with its cluster-bootstrap interval."""

    estimate: float  #: sum(num) / sum(den); nan when sum(den) == 0
    lo: float  #: percentile bootstrap bounds (nan with < 2 clusters)
    hi: float
    num: float  #: sum(num)
    den: float  #: sum(den) (e.g. tokens)
    n_clusters: int  #: seeds
    per_cluster_mean: float  #: secondary: mean over clusters with den > 0 of num_i / den_i
    level: float
    n_boot: int
    n_undefined: int  #: resamples with sum(den) == 0, left out of the quantiles

    def to_dict(self) -> dict:
        return asdict(self)


def pooled_ratio(num, den, *, n_boot: int = DEFAULT_N_BOOT, level: float = DEFAULT_LEVEL,
                 seed: int = 0) -> PooledRatio:
    """Pooled ratio over clusters with a seed-cluster percentile bootstrap interval.

    Formula: ``R = sum_i num_i / sum_i den_i`` (i over clusters, e.g. seeds; ``num_i`` the
    count of hits of seed i, ``den_i`` its token count). A seed with 9 tokens weighs 9
    times a seed with 1, unlike the per-seed mean ``mean_i(num_i / den_i)``, which is
    returned as ``per_cluster_mean`` for reference only.

    Interval: draw ``n`` cluster indices with replacement ``n_boot`` times, recompute
    ``R* = sum num[idx] / sum den[idx]``; the interval is the percentile interval of the
    ``R*``. A resample whose ``sum den[idx]`` is 0 has no ratio: it is left out and
    counted in ``n_undefined`` (the interval is then conditional on a non-empty
    denominator; a large ``n_undefined`` says the data cannot carry the rate).

    Naive equivalent: ``num.sum() / den.sum()`` and a Python loop over resamples.

    Args:
        num: (n,) per-cluster numerators (finite).
        den: (n,) per-cluster denominators (finite, >= 0).
        n_boot: bootstrap resamples.
        level: two-sided coverage, e.g. 0.95.
        seed: seed of the resampling generator (results are deterministic given it).
    """
    num, den = _vec("num", num), _vec("den", den)
    _same_len(num=num, den=den)
    _nonneg("den", den)
    _check_boot(n_boot, level)
    N, D = float(num.sum()), float(den.sum())
    est = N / D if D > 0 else math.nan
    pos = den > 0
    pcm = float(np.mean(num[pos] / den[pos])) if pos.any() else math.nan
    lo = hi = math.nan
    undefined = 0
    if num.size >= 2 and D > 0:
        vals = []
        for sn, sd in _resample_sums([num, den], n_boot, seed):
            ok = sd > 0
            undefined += int((~ok).sum())
            vals.append(sn[ok] / sd[ok])
        lo, hi = _percentile(np.concatenate(vals), level)
    return PooledRatio(est, lo, hi, N, D, int(num.size), pcm, level, int(n_boot), undefined)


@dataclass(frozen=True)
class RatioDifference:
    """``R_a - R_b`` of two pooled ratios measured on the same clusters, paired bootstrap."""

    estimate: float  #: sum(num_a)/sum(den_a) - sum(num_b)/sum(den_b)
    lo: float
    hi: float
    a: float  #: R_a
    b: float  #: R_b
    den_a: float
    den_b: float
    n_clusters: int
    level: float
    n_boot: int
    n_undefined: int  #: resamples where either denominator sums to 0 (left out)

    def to_dict(self) -> dict:
        return asdict(self)


def paired_ratio_difference(num_a, den_a, num_b, den_b, *, n_boot: int = DEFAULT_N_BOOT,
                            level: float = DEFAULT_LEVEL, seed: int = 0) -> RatioDifference:
    """Difference of two pooled ratios on the same seeds, with a paired cluster bootstrap.

    Formula: ``Delta = sum num_a / sum den_a - sum num_b / sum den_b`` (e.g. the pooled
    unsafe-keep rate of the predictive criterion minus that of the ratio, both counted on
    the same seeds' tokens). The bootstrap draws one set of seed indices per resample and
    uses it for **both** ratios, so what the two share (the same tokens, the same seed's
    luck) cancels in the difference. Resamples with a zero denominator on either side
    are left out and counted in ``n_undefined``.

    Args: (n,) arrays, index i = the same seed in all four; ``den_*`` >= 0. Other
    arguments as in :func:`pooled_ratio`.
    """
    na, da, nb, db = (_vec(k, v) for k, v in (("num_a", num_a), ("den_a", den_a), ("num_b", num_b), ("den_b", den_b)))
    _same_len(num_a=na, den_a=da, num_b=nb, den_b=db)
    _nonneg("den_a", da)
    _nonneg("den_b", db)
    _check_boot(n_boot, level)
    Da, Db = float(da.sum()), float(db.sum())
    ra = float(na.sum()) / Da if Da > 0 else math.nan
    rb = float(nb.sum()) / Db if Db > 0 else math.nan
    lo = hi = math.nan
    undefined = 0
    if na.size >= 2 and Da > 0 and Db > 0:
        vals = []
        for sna, sda, snb, sdb in _resample_sums([na, da, nb, db], n_boot, seed):
            ok = (sda > 0) & (sdb > 0)
            undefined += int((~ok).sum())
            vals.append(sna[ok] / sda[ok] - snb[ok] / sdb[ok])
        lo, hi = _percentile(np.concatenate(vals), level)
    return RatioDifference(ra - rb, lo, hi, ra, rb, Da, Db, int(na.size), level, int(n_boot), undefined)


# ------------------------------------------------------------------ exact tests
def _int_arg(name: str, v, lo: int = 0) -> int:
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        v = int(v)
    elif isinstance(v, (float, np.floating)) and float(v).is_integer():
        v = int(v)
    else:
        raise ValueError(f"{name}: must be an integer count, got {v!r}")
    if v < lo:
        raise ValueError(f"{name}: must be >= {lo}, got {v}")
    return v


def binomial_test(k: int, n: int, p: float = 0.5) -> float:
    """Exact two-sided binomial test p-value.

    Definition (the standard one, as R's ``binom.test``): with ``X ~ Binomial(n, p)``,
    ``p-value = sum over i in 0..n with P(X = i) <= P(X = k) of P(X = i)``, i.e. the
    probability of an outcome no more likely than the one observed (ties within a
    relative 1e-7). For ``p = 0.5`` this is ``min(1, 2 P(X <= min(k, n - k)))``.

    As a sign test: ``k`` = pairs where A wins, ``n`` = pairs that are not tied.
    For ``p = 0.5`` and ``n <= 5000`` the sum is taken in exact integers (correctly
    rounded); otherwise the pmf is evaluated in log space (``lgamma``), so large ``n``
    neither overflows nor loses the tails. Equivalent to scipy's
    ``binomtest(k, n, p).pvalue`` (scipy is not a dependency).
    """
    k, n = _int_arg("k", k), _int_arg("n", n)
    if k > n:
        raise ValueError(f"k: must be <= n = {n}, got {k}")
    if not 0.0 <= p <= 1.0 or math.isnan(p):
        raise ValueError(f"p: must be in [0, 1], got {p!r}")
    if n == 0:
        return 1.0
    if p == 0.0 or p == 1.0:  # a degenerate binomial: the observation is certain or impossible
        return 1.0 if k == (0 if p == 0.0 else n) else 0.0
    if p == 0.5 and n <= _EXACT_INT_MAX_N:
        # symmetric pmf C(n, i) / 2**n: the outcomes no likelier than k are the two tails
        # beyond min(k, n - k); integer arithmetic, so the result is correctly rounded
        m = min(k, n - k)
        c, tail = 1, 0
        for i in range(m + 1):
            tail += c
            c = c * (n - i) // (i + 1)
        return min(1.0, 2 * tail / 2 ** n)
    i = np.arange(n + 1, dtype=np.float64)
    lg = np.vectorize(math.lgamma, otypes=[np.float64])
    logpmf = lg(n + 1.0) - lg(i + 1.0) - lg(n - i + 1.0) + i * math.log(p) + (n - i) * math.log1p(-p)
    keep = logpmf <= logpmf[k] + math.log1p(_TIE_RTOL)
    return float(min(1.0, math.fsum(np.exp(logpmf[keep]))))


def mcnemar_exact(b: int, c: int) -> float:
    """McNemar's exact test from the two discordant counts.

    ``b`` = pairs where only A is right, ``c`` = pairs where only B is right (the
    concordant pairs carry no information). Under H0 each discordant pair is A's with
    probability 1/2: ``p-value = binomial_test(b, b + c, 0.5)`` (two-sided, symmetric
    in b and c).
    """
    b, c = _int_arg("b", b), _int_arg("c", c)
    return binomial_test(b, b + c, 0.5)


def _binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed in log space (no overflow for large n)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    lp, lq = math.log(p), math.log1p(-p)
    return min(1.0, math.fsum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
                                       + i * lp + (n - i) * lq) for i in range(k + 1)))


def clopper_pearson(k: int, n: int, *, level: float = DEFAULT_LEVEL) -> tuple[float, float]:
    """Exact (Clopper-Pearson) two-sided interval of a binomial proportion ``k / n``.

    ``lo`` is the ``p`` with ``P(X >= k | p) = (1 - level) / 2`` (0 when ``k = 0``) and
    ``hi`` the ``p`` with ``P(X <= k | p) = (1 - level) / 2`` (1 when ``k = n``), found by
    bisection on the exact binomial CDF (scipy's ``beta.ppf`` gives the same numbers).
    Hand-worked: ``k = 0, n = 8`` at 95% gives ``hi = 1 - 0.025 ** (1 / 8) = 0.3694``.
    Used for rates over seeds (e.g. the fraction of seeds whose run collapsed), where the
    unit is the seed and a bootstrap of 0/8 would give the empty interval [0, 0].
    ``n = 0`` has no interval: ``(nan, nan)``.
    """
    k, n = _int_arg("k", k), _int_arg("n", n)
    if k > n:
        raise ValueError(f"k: must be <= n = {n}, got {k}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level: must be in (0, 1), got {level!r}")
    if n == 0:
        return math.nan, math.nan
    a = (1 - level) / 2

    def solve(f) -> float:  # f decreasing in p on [0, 1]; the p where f(p) = a
        lo, hi = 0.0, 1.0
        for _ in range(200):
            mid = (lo + hi) / 2
            if f(mid) > a:
                lo = mid
            else:
                hi = mid
            if hi - lo < 1e-15:
                break
        return (lo + hi) / 2

    lower = 0.0 if k == 0 else 1.0 - solve(lambda p: 1.0 - _binom_cdf(k - 1, n, 1.0 - p))
    upper = 1.0 if k == n else solve(lambda p: _binom_cdf(k, n, p))
    return lower, upper


# ------------------------------------------------------------------ paired seed scalars
@dataclass(frozen=True)
class SignFlip:
    """Two-sided sign-flip (paired permutation) test of ``mean(d) = 0``."""

    p: float
    method: str  #: "exact" (all 2**n assignments) or "monte-carlo"
    n_assignments: int  #: 2**n when exact, else the number of random draws
    min_p: float  #: smallest p this test can return for these n (2 / 2**n exact; 1/(1+draws) MC)

    def to_dict(self) -> dict:
        return asdict(self)


def sign_flip_test(d, *, n_perm: int = DEFAULT_N_PERM, seed: int = 0) -> SignFlip:
    """Two-sided sign-flip permutation p-value for paired differences ``d``.

    Under H0 (no difference between the paired conditions) each ``d_i`` is as likely to
    have the opposite sign. Statistic ``T(s) = |sum_i s_i d_i|`` over sign vectors
    ``s in {-1, +1}^n``; ``p = #{s : T(s) >= T(1)} / #assignments`` where ``T(1)`` is
    the observed statistic (ties within 1e-9 * sum|d| count as "as extreme").

    - ``n <= 16``: every one of the ``2**n`` assignments, the observed one included, so
      ``p`` is exact and a multiple of ``2 / 2**n`` (its smallest value: n = 4 seeds can
      never reach p < 0.125, n = 6 first reaches 0.031).
    - ``n > 16``: ``n_perm`` random sign vectors, ``p = (1 + hits) / (1 + n_perm)``
      (the observed assignment counted once, so ``p > 0``).

    Zero differences contribute nothing whatever their sign; all-zero ``d`` gives 1.
    """
    d = _vec("d", d)
    n = d.size
    tol = 1e-9 * float(np.abs(d).sum())
    t_obs = abs(float(d.sum()))
    if n <= EXACT_SIGN_FLIP_MAX_N:
        bits = (np.arange(2 ** n)[:, None] >> np.arange(n)) & 1  # (2^n, n); row 0 = observed
        t = np.abs((1 - 2 * bits).astype(np.float64) @ d)
        t_obs = t[0]
        hits = int((t >= t_obs - tol).sum())
        return SignFlip(hits / 2 ** n, "exact", 2 ** n, 2 / 2 ** n)
    if not isinstance(n_perm, (int, np.integer)) or n_perm < 1:
        raise ValueError(f"n_perm: must be a positive integer, got {n_perm!r}")
    rng = np.random.default_rng([seed, 1])  # a stream apart from the bootstrap's default_rng(seed)
    hits, done, chunk = 0, 0, max(1, _CHUNK_ELEMS // n)
    while done < n_perm:
        m = min(chunk, n_perm - done)
        s = rng.integers(0, 2, size=(m, n)) * 2 - 1  # (m, n) random signs
        hits += int((np.abs(s.astype(np.float64) @ d) >= t_obs - tol).sum())
        done += m
    return SignFlip((1 + hits) / (1 + n_perm), "monte-carlo", int(n_perm), 1 / (1 + n_perm))


@dataclass(frozen=True)
class PairedDifference:
    """Mean paired difference ``mean(x - y)`` over seeds, its interval and test."""

    estimate: float  #: mean_i (x_i - y_i)
    lo: float  #: seed-bootstrap percentile interval of the mean (nan with n < 2)
    hi: float
    p: float  #: two-sided sign-flip p-value (see :func:`sign_flip_test`)
    p_method: str
    min_p: float  #: the smallest p attainable with these n
    n: int  #: pairs (seeds)
    wins: int  #: pairs with x > y
    losses: int  #: pairs with x < y
    level: float
    n_boot: int

    def to_dict(self) -> dict:
        return asdict(self)


def paired_difference(x, y, *, n_boot: int = DEFAULT_N_BOOT, level: float = DEFAULT_LEVEL, seed: int = 0,
                      n_perm: int = DEFAULT_N_PERM) -> PairedDifference:
    """Paired per-seed comparison of two conditions (e.g. final accuracy of mode X vs the
    reference mode, seed by seed on identical data).

    Formula: ``d_i = x_i - y_i``; estimate ``mean(d)``; interval: percentile bootstrap of
    ``mean(d[idx])`` over ``n_boot`` resamples of the seeds; p-value: the two-sided
    sign-flip test of :func:`sign_flip_test` on ``d``. Naive equivalent:
    ``(x - y).mean()`` plus loops over resamples and sign vectors.

    Args:
        x, y: (n,) per-seed values; index i is the same seed in both.
        n_boot, level, seed: as in :func:`pooled_ratio` (``seed`` also seeds the Monte
            Carlo sign flips when n > 16).
        n_perm: Monte Carlo draws when n > 16.
    """
    x, y = _vec("x", x), _vec("y", y)
    _same_len(x=x, y=y)
    _check_boot(n_boot, level)
    d = x - y
    lo = hi = math.nan
    if d.size >= 2:
        sums = np.concatenate([ch[0] for ch in _resample_sums([d], n_boot, seed)])
        lo, hi = _percentile(sums / d.size, level)
    sf = sign_flip_test(d, n_perm=n_perm, seed=seed)
    return PairedDifference(float(d.mean()), lo, hi, sf.p, sf.method, sf.min_p, int(d.size),
                            int((d > 0).sum()), int((d < 0).sum()), level, int(n_boot))


def min_sign_flip_p(n: int) -> float:
    """Smallest two-sided p-value an exact sign-flip test on ``n`` pairs can reach: ``2 / 2**n``
    (all differences of one sign; n = 5 gives 0.0625, n = 6 gives 0.031)."""
    n = _int_arg("n", n, lo=1)
    return 2.0 / 2.0 ** n


# ------------------------------------------------------------------ formatting
def format_p(p: float) -> str:
    """``p = 0.109``: three significant digits; ``p < 1e-300`` below that; ``p = n/a`` for nan."""
    if p is None or (isinstance(p, float) and math.isnan(p)):
        return "p = n/a"
    if p < 1e-300:
        return "p < 1e-300"
    return f"p = {p:.3g}"


def _num(v, spec: str, sign: bool = False) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return format(v, ("+" if sign else "") + spec)


def format_interval(estimate: float, lo: float, hi: float, *, spec: str = ".3f", sign: bool = False) -> str:
    """``0.109 [0.050, 0.200]`` (``spec`` a format spec: ``.3f``, ``.1%``, ``.2e``;
    ``sign`` prefixes + for differences). Without an interval: ``0.109 [n/a]``."""
    if lo is None or hi is None or math.isnan(lo) or math.isnan(hi):
        return f"{_num(estimate, spec, sign)} [n/a]"
    return f"{_num(estimate, spec, sign)} [{_num(lo, spec, sign)}, {_num(hi, spec, sign)}]"


def format_rate(estimate: float, lo: float, hi: float, *, n_units: float | None = None, n_seeds: int | None = None,
                unit: str = "tokens", spec: str = ".3f") -> str:
    """``rate [lo, hi] (n tokens, n seeds)``: e.g. ``0.109 [0.050, 0.200] (101 tokens, 2 seeds)``."""
    parts = []
    if n_units is not None:
        parts.append(f"{int(round(n_units)):,} {unit}")
    if n_seeds is not None:
        parts.append(f"{n_seeds} seed{'s' if n_seeds != 1 else ''}")
    return format_interval(estimate, lo, hi, spec=spec) + (f" ({', '.join(parts)})" if parts else "")
