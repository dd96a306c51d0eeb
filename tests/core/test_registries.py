"""The registries' oracles: every registered surrogate's per-token loss and every registered mode's
mask against a restatement here (:data:`SURROGATE_ORACLES`, :data:`MODE_ORACLES`; the top-K
divergences' values are restated in ``helpers.TOPK_ORACLES``), and a registration without its
oracle or its doc row fails. Registrations that would be silently wrong are refused when made."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pdmask
from pdmask.divergences import TOPK_DIVERGENCES, TopKDivergence, register_divergence, topk_kl, topk_tv_grad
from pdmask.masks import MODES, MaskMode, mask_from_stats, register_mode
from pdmask.surrogates import SURROGATES, Surrogate, register_surrogate

from .helpers import make_case, stats_of
from .registry_checks import core_modes, missing_doc_rows, missing_oracles

F64 = torch.float64
C, DELTA, EPS = 3.0, 0.1, (0.2, 0.28)


# ------------------------------------------------------------------ surrogates
def _r(logp, rlp, clamp=None):
    lr = logp - rlp
    return torch.exp(lr if clamp is None else lr.clamp(-clamp, clamp))


#: name -> per-token loss of (logp (differentiable), log mu_k, A, w) in naive torch, all tokens kept
SURROGATE_ORACLES = {
    "dppo": lambda lp, rlp, A, w: -torch.exp(lp - rlp).clamp(max=C).detach() * A * lp,
    "ppo-clip": lambda lp, rlp, A, w: torch.where(
        (A < 0) & (_r(lp, rlp).detach() > C), -A * C,
        torch.maximum(-A * _r(lp, rlp), -A * _r(lp, rlp).clamp(1 - EPS[0], 1 + EPS[1]))),
    "drpo": lambda lp, rlp, A, w: -A * _r(lp, rlp, 20) + A.abs() * rlp.exp() * (_r(lp, rlp, 20) - 1) ** 2 / (2 * DELTA),
    "spo": lambda lp, rlp, A, w: -A * _r(lp, rlp, 20) + A.abs() * (_r(lp, rlp, 20) - 1) ** 2 / (2 * DELTA),
    "smooth": lambda lp, rlp, A, w: -A * w * _r(lp, rlp, 20),
}


@pytest.mark.parametrize("name", list(SURROGATES))
def test_every_surrogate_equals_its_oracle_value_and_gradient(name):
    g = torch.Generator().manual_seed(3)
    logp0 = -torch.rand(12, generator=g, dtype=F64) * 3
    rlp = (logp0 + torch.randn(12, generator=g, dtype=F64) * 0.8).clamp(max=-1e-3)
    A = torch.randn(12, generator=g, dtype=F64)
    w = 1 + 0.3 * torch.randn(12, generator=g, dtype=F64)
    s = SURROGATES[name]
    kw = dict(surrogate=name, is_cap=C, eps_low=EPS[0], eps_high=EPS[1], delta_low=DELTA, delta_high=DELTA,
              rollout_logp=rlp, weight=w if s.needs_weight else None)
    lp1, lp2 = logp0.clone().requires_grad_(True), logp0.clone().requires_grad_(True)
    per, _ = pdmask.token_loss(lp1, (lp1 - rlp).detach(), A, torch.ones(12, dtype=torch.bool), **kw)
    want = SURROGATE_ORACLES[name](lp2, rlp, A, w)
    torch.testing.assert_close(per, want, rtol=1e-12, atol=1e-14)
    (g1,), (g2,) = torch.autograd.grad(per.sum(), lp1), torch.autograd.grad(want.sum(), lp2)
    torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------------ modes
@dataclasses.dataclass(frozen=True)
class ModeRow:
    """A mode restated: ``region`` a stat key (``D > delta``), ``"ratio-clip"`` (``r`` outside
    ``[1 - eps_low, 1 + eps_high]``) or ``"ratio-dev"`` (``|r - 1| > delta``); ``direction``
    ``"ratio"`` (``A log r > 0``), ``"predictive"`` (``A Ddot > 0`` of ``divergence``) or None
    (never outward); ``surrogate``; ``delta`` the default; ``is_bounds(eps) -> (floor, cap)`` a
    preset's IS weight bounds."""

    region: str
    direction: str | None
    divergence: str
    surrogate: str = "dppo"
    delta: float = 0.05
    is_bounds: object = None


MODE_ORACLES = {
    "grpo": ModeRow("ratio-clip", "ratio", "topk_kl", "ppo-clip"),
    "none": ModeRow("topk_kl", None, "topk_kl"),
    "cispo": ModeRow("topk_kl", None, "topk_kl", is_bounds=lambda eps: (1 - eps[0], 1 + eps[1])),
    "dppo-binary-tv": ModeRow("binary_tv", "ratio", "binary_tv", delta=0.15),
    "dppo-binary-kl": ModeRow("binary_kl", "ratio", "binary_kl"),
    "dppo-topk-kl": ModeRow("topk_kl", "ratio", "topk_kl"),
    "dppo-topk-tv": ModeRow("topk_tv", "ratio", "topk_tv", delta=0.15),
    "dppo-topk-js": ModeRow("topk_js", "ratio", "topk_js", delta=0.0125),
    "pdm-topk-kl": ModeRow("topk_kl", "predictive", "topk_kl"),
    "pdm-topk-tv": ModeRow("topk_tv", "predictive", "topk_tv", delta=0.15),
    "pdm-topk-js": ModeRow("topk_js", "predictive", "topk_js", delta=0.0125),
    "pdm-full-kl": ModeRow("full_kl", "predictive", "full_kl"),
    "pdm-full-tv": ModeRow("full_tv", "predictive", "full_tv", delta=0.15),
    "drpo": ModeRow("binary_tv", "ratio", "binary_tv", "drpo", delta=0.15),
    "spo": ModeRow("ratio-dev", "ratio", "topk_kl", "spo", delta=0.2),
    "pdm-smooth-topk-kl": ModeRow("topk_kl", "predictive", "topk_kl", "smooth"),
    "pdm-smooth-topk-tv": ModeRow("topk_tv", "predictive", "topk_tv", "smooth", delta=0.15),
}


@pytest.mark.parametrize("name", core_modes())
def test_every_mode_equals_its_oracle_row(name):
    row, m = MODE_ORACLES[name], MODES[name]
    assert (m.surrogate, m.divergence, m.default_delta) == (row.surrogate, row.divergence, row.delta)
    c = make_case(40, 30, 5, seed=5, scale=2.0, mismatch=0.8)
    st = stats_of(c)
    A = torch.randn(40, generator=torch.Generator().manual_seed(1), dtype=F64)
    A[::7] = 0.0
    delta = float(st[row.divergence].median()) if row.region not in ("ratio-clip", "ratio-dev") else 0.1
    th = pdmask.Thresholds(delta, delta, *EPS)
    r = st["log_ratio"].exp()
    out = {"ratio-clip": (A != 0) & ((r > 1 + EPS[1]) | (r < 1 - EPS[0])),
           "ratio-dev": (A != 0) & ((r - 1).abs() > delta)}.get(row.region)
    out = (A != 0) & (st.get(row.region, st["topk_kl"]) > delta) if out is None else out
    direction = {"ratio": st["log_ratio"], "predictive": st[pdmask.ddot_key(row.divergence)]}.get(row.direction)
    outward = torch.zeros_like(out) if direction is None else A * direction > 0
    smooth = SURROGATES[row.surrogate].smooth is not None
    want = torch.ones_like(out) if smooth else ~(out & outward)
    got = mask_from_stats(st, A, name, thresholds=th)
    assert torch.equal(got.keep, want) and torch.equal(got.out_of_region, out)
    assert 0 < int(out.sum()) < 40  # the case tests something
    if row.is_bounds is not None:  # the preset, read from the resolved spec
        corr = pdmask.PolicyLoss(mode=name, thresholds=th).corrections
        assert (corr.is_floor, corr.is_cap) == pytest.approx(row.is_bounds(EPS))
    else:
        assert m.corrections is None


# ------------------------------------------------------------------ every registration has its oracle and row
def test_every_registration_has_its_oracle_and_its_doc_row():
    assert missing_oracles() == {}
    assert missing_doc_rows() == {}


# ------------------------------------------------------------------ silently wrong registrations are refused
def test_a_divergence_without_its_derivative_or_with_a_wrong_one_is_refused():
    js = TOPK_DIVERGENCES["topk_js"]
    with pytest.raises(pdmask.SpecError, match="^grad: divergence 'topk_x' needs a callable grad"):
        register_divergence(dataclasses.replace(js, name="topk_x", grad=None))
    with pytest.raises(pdmask.SpecError, match="^grad: divergence 'topk_x': Ddot from grad differs"):
        register_divergence(dataclasses.replace(js, name="topk_x", grad=topk_tv_grad))
    with pytest.raises(pdmask.SpecError, match="^default_delta"):
        register_divergence(TopKDivergence("topk_x", topk_kl, js.grad, None))
    with pytest.raises(pdmask.SpecError, match="topk_<name>"):
        register_divergence(dataclasses.replace(TOPK_DIVERGENCES["topk_kl"], name="kl2"))
    assert "topk_x" not in TOPK_DIVERGENCES


def test_a_surrogate_without_its_declaration_or_breaking_it_is_refused():
    drpo = SURROGATES["drpo"]
    cases = [(dict(weight_bound=None), "^weight_bound: "), (dict(accepts={"delta"}), "^accepts: "),
             (dict(accepts=frozenset({"delta", "temperature"})), "^accepts: "),
             (dict(accepts=frozenset()), "^smooth: "),  # a smooth weight reads delta
             (dict(smooth=None, accepts=frozenset()), "the loss raised"),  # its loss reads delta
             (dict(weight_bound=lambda cap, d, lp: 1.0), "weight_bound must bound it"),
             (dict(loss=lambda a: (a.logp, a.keep.float())), "must return")]
    for change, msg in cases:
        with pytest.raises(pdmask.SpecError, match=msg):
            register_surrogate(dataclasses.replace(drpo, name="x", **change))
    with pytest.raises(pdmask.SpecError, match="^surrogate: 'dppo' is already registered"):
        register_surrogate(SURROGATES["dppo"])
    assert "x" not in SURROGATES


def test_a_mode_its_parts_cannot_serve_is_refused():
    region = pdmask.divergence_region("topk_kl")
    for mode, msg in [
        (MaskMode("x", region, pdmask.ratio_sign(), "topk_kld"), "^divergence: unknown value 'topk_kld'"),
        (MaskMode("x", region, pdmask.ratio_sign(), "topk_kl", surrogate="sapo"), "^surrogate: unknown value 'sapo'"),
        (MaskMode("x", pdmask.ratio_region(), pdmask.ratio_sign(), "topk_kl", surrogate="smooth"), "^surrogate: 'smooth'"),
        (MaskMode("x", region, None, "topk_kl", corrections={"is_cap": 2.0}), "^corrections: "),
    ]:
        with pytest.raises(pdmask.SpecError, match=msg):
            register_mode(mode)
    assert "x" not in MODES


def test_a_preset_mode_refuses_another_value_of_what_it_sets_and_keeps_the_same():
    with pytest.raises(pdmask.SpecError, match=r"^is_cap: mode 'cispo' sets it to 1.28"):
        pdmask.PolicyLoss(mode="cispo", thresholds=pdmask.Thresholds(eps_high=0.28), corrections=pdmask.Corrections(
            is_cap=5.0))
    spec = pdmask.PolicyLoss(mode="cispo", thresholds=pdmask.Thresholds(eps_high=0.28),
                             corrections=pdmask.Corrections(is_cap=1.28, is_floor=0.8, rejection="token_k1",
                                                            rejection_threshold=3.0))
    assert (spec.corrections.is_floor, spec.corrections.is_cap, spec.corrections.rules[0].name) == (0.8, 1.28,
                                                                                                   "token_k1")
