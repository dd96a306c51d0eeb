"""pdmask_lab.power: the smallest paired difference a seed design detects, checked against the
sign-flip test it simulates and against the paired t-test's closed form for normal noise."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdmask_lab.power import _check, _PowerCurve, _prepare, detectable_shift
from pdmask_lab.significance import sign_flip_test

NORMAL = np.random.default_rng(1).normal(size=4000)


def power_at(d, shift: float, *, n: int | None = None, alpha: float = 0.05, n_sim: int = 2000,
             seed: int = 0) -> float:
    """The share of simulated ``n``-seed designs (noise resampled from the centred ``d``,
    true shift ``shift``) whose two-sided sign-flip p is ``<= alpha``: the curve
    detectable_shift inverts, evaluated at one shift."""
    d, n = _prepare(d, n)
    _check(alpha, 0.5, n_sim)
    return _PowerCurve(d - d.mean(), n, alpha, n_sim, seed)(float(shift))


def test_normal_noise_sits_just_above_the_paired_t_answer():
    # (t_{0.975,7} + t_{0.8,7}) / sqrt(8) = (2.3646 + 0.8960) / 2.8284 = 1.1528 sigma; the exact
    # sign-flip test is a little less powerful, never more than ~15% here
    r = detectable_shift(NORMAL, n=8)
    t_answer = (2.364624 + 0.896030) / math.sqrt(8) * r.noise_sd
    assert t_answer * 0.98 < r.shift < t_answer * 1.15
    assert r.reason == "" and r.n == 8


def test_the_shift_is_where_power_crosses():
    r = detectable_shift(NORMAL, n=8)
    assert power_at(NORMAL, r.shift, n=8) >= 0.8
    assert power_at(NORMAL, 0.95 * r.shift, n=8) < 0.8
    # no shift: the rejection rate is the test's size, 12/256 = 0.047 for n = 8, up to MC error
    assert abs(power_at(NORMAL, 0.0, n=8, n_sim=8000) - 12 / 256) < 0.012


def test_power_matches_the_sign_flip_test_draw_by_draw():
    # the naive equivalent of the module docstring, with the same draws
    d = np.array([0.05, -0.02, 0.01, 0.07, -0.04, 0.03, 0.0, 0.02])
    noise = d - d.mean()
    rng = np.random.default_rng([0, 2])
    draws = noise[rng.integers(0, d.size, size=(300, 8))]
    naive = np.mean([sign_flip_test(x + 0.03).p <= 0.05 for x in draws])
    assert power_at(d, 0.03, n_sim=300) == pytest.approx(naive, abs=1e-12)


def test_scale_equivariance_and_more_seeds_detect_less():
    a = detectable_shift(NORMAL[:50], n=8).shift
    assert detectable_shift(3 * NORMAL[:50], n=8).shift == pytest.approx(3 * a, rel=2e-3)
    assert detectable_shift(NORMAL[:50] + 7.0, n=8).shift == pytest.approx(a, rel=2e-3)  # the mean is removed
    assert detectable_shift(NORMAL[:50], n=16).shift < 0.8 * a


def test_too_few_seeds_detect_nothing_and_equal_differences_need_no_shift():
    r = detectable_shift(NORMAL[:5])
    assert r.shift == math.inf and "2/2^5" in r.reason
    z = detectable_shift([0.1, 0.1, 0.1, 0.1, 0.1, 0.1])
    assert z.shift == 0.0 and "all equal" in z.reason


@pytest.mark.parametrize("kw, msg", [(dict(alpha=1.5), "alpha"), (dict(power=0.0), "power"),
                                     (dict(n_sim=0), "n_sim"), (dict(n=0), "n")])
def test_bad_arguments_are_named(kw, msg):
    with pytest.raises(ValueError, match=rf"^{msg}:"):
        detectable_shift(NORMAL[:8], **kw)


def test_bad_differences_are_named():
    with pytest.raises(ValueError, match="^d: needs at least 2"):
        detectable_shift([0.1])
    with pytest.raises(ValueError, match="^d: contains nan"):
        detectable_shift([0.1, float("nan"), 0.2])
