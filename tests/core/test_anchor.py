"""The anchor (``PolicyLoss(anchor="old")``, :class:`pdmask.Anchor`): against an independent
restatement of the three-policy loss in float64, loss and gradient, for every registered
core mode; anchor = mu gives today's loss and gradient exactly; bad anchors get one line.

The restatement (docs/core.md, "Choosing the anchor"), written from the full distributions:
``r' = pi_k / pi_old_k``, ``rho = pi_old_k / mu_k``, the region's divergence ``D(pi_old, pi)``
on ``topK(mu) ∪ {k}`` with one tail bucket (or binary / full), ``Ddot`` by autograd, and

    dppo   -M sg(min(rho, C) min(r', C)) A log pi_k
    other  min(rho, C) * surrogate(r')   (PPO clip + dual clip, DRPO with pi_old_k, SPO, smooth)

A mode with a corrections preset bounds both weights as its preset does: ``cispo``
``clip(rho, 1 - eps_low, 1 + eps_high) clip(r', 1 - eps_low, 1 + eps_high)`` (:data:`PRESETS`).
"""

from __future__ import annotations

import math

import pytest
import torch

import pdmask
from pdmask.masks import MODES

from .helpers import ddot_autograd, full_kl_fn, full_tv_fn, make_case, support_mask

F64 = torch.float64
CORE_MODES = [m for m in MODES if not m.startswith("pdm-batch")]
B, T, V, K = 3, 5, 24, 6
CAP = 5.0
#: the IS-weight bounds (floor, cap) of the modes with a corrections preset, from (eps_low, eps_high)
PRESETS = {"cispo": lambda eps: (1 - eps[0], 1 + eps[1])}


def case(seed=0):
    """pi (trainer logits), pi_old (a step away) and mu (a mismatched engine), (B, T)."""
    c = make_case(B * T, V, K, seed=seed, mismatch=0.6, scale=2.0)
    g = torch.Generator().manual_seed(seed + 11)
    z = c["logits"].reshape(B, T, V)
    z_old = z + 0.35 * torch.randn(B, T, V, generator=g, dtype=F64)
    rollout = pdmask.Rollout(c["sampled_ids"].reshape(B, T), c["rollout_logprob"].reshape(B, T),
                             c["topk_ids"].reshape(B, T, K), c["topk_logprobs"].reshape(B, T, K),
                             torch.tensor([[1] * T, [1] * 3 + [0] * 2, [1] * 4 + [0]], dtype=torch.bool),
                             logits=c["rollout_logits"].reshape(B, T, V))
    adv = torch.tensor([1.3, -0.7, 0.9], dtype=F64)
    return z, z_old, rollout, adv, c["logmu"].reshape(B, T, V)


def restated(mode: str, z, z_old, rollout, adv, logmu, delta, eps=(0.2, 0.28)):
    """The anchored per-token loss of ``mode``, token-mean over the response (see module docstring)."""
    m = MODES[mode]
    z = z.detach().clone().requires_grad_(True)
    lp_all = torch.log_softmax(z, -1)
    lq_all = torch.log_softmax(z_old, -1)
    k = rollout.sampled_ids
    lp = lp_all.gather(-1, k[..., None])[..., 0]
    lq = lq_all.gather(-1, k[..., None])[..., 0]
    lmu = rollout.sampled_logprob
    A = adv[:, None].expand(B, T)
    valid = rollout.response_mask
    q_full = lq_all.exp().reshape(-1, V)
    S = support_mask(rollout.topk_ids.reshape(-1, K), k.reshape(-1), V)

    def topk(kind):
        def fn(_mu, pi):  # D(pi_old, pi) on S = topK(mu ids) ∪ {k}, one tail bucket
            qS, pS = torch.where(S, q_full, 0.0), torch.where(S, pi, 0.0)
            qT, pT = torch.where(S, 0.0, q_full).sum(-1), torch.where(S, 0.0, pi).sum(-1)
            if kind == "kl":
                return (torch.where(S, qS * (torch.log(q_full) - torch.log(pi)), 0.0).sum(-1)
                        + torch.where(qT > 0, qT * (torch.log(qT.clamp_min(1e-300)) - torch.log(pT)), 0.0))
            if kind == "js":  # 1/2 KL(q || m) + 1/2 KL(pi || m), m the midpoint, on the same buckets
                def kl_m(a, b):
                    return (torch.where(S, a * torch.log(2 * a / (a + b)), 0.0).sum(-1)
                            + torch.where(S, 0.0, a).sum(-1) * torch.log(2 * torch.where(S, 0.0, a).sum(-1)
                                                                          / (torch.where(S, 0.0, a + b).sum(-1))))
                return 0.5 * (kl_m(q_full, pi) + kl_m(pi, q_full))
            return 0.5 * ((qS - pS).abs().sum(-1) + (qT - pT).abs())
        return fn

    pk, qk = lp.detach().exp(), lq.exp()
    binary = {"binary_tv": lambda: (pk - qk).abs(),
              "binary_kl": lambda: qk * (lq - lp.detach()) + (1 - qk) * (torch.log1p(-qk) - torch.log1p(-pk))}
    fns = {"topk_kl": topk("kl"), "topk_tv": topk("tv"), "topk_js": topk("js"),
           "full_kl": lambda _m, pi: full_kl_fn(q_full, pi), "full_tv": lambda _m, pi: full_tv_fn(q_full, pi)}

    def value(name):
        if name in binary:
            return binary[name]()
        return fns[name](None, torch.softmax(z.detach().reshape(-1, V), -1)).reshape(B, T)

    def ddot(name):
        return ddot_autograd(fns[name], z.detach(), k).reshape(B, T)

    log_r = lp.detach() - lq  # against the anchor
    r = (lp - lq).exp()       # differentiable r'
    floor, cap = PRESETS[mode](eps) if mode in PRESETS else (0.0, CAP)
    rho_w = (lq - lmu).exp().clamp(min=floor, max=cap)
    dl = dh = delta
    region_div = getattr(m.region, "divergence", None)
    if m.surrogate == "ppo-clip":
        out = (A != 0) & ((log_r.exp() > 1 + eps[1]) | (log_r.exp() < 1 - eps[0]))
    elif m.surrogate == "spo":
        out = (A != 0) & ((log_r.exp() - 1).abs() > delta)
    else:
        out = (A != 0) & (value(region_div) > delta)
    # the direction test by the mode's name: pdm-* predictive, none without one, the rest the ratio's
    direction = ddot(m.divergence) if mode.startswith("pdm-") else log_r
    outward = A * direction > 0 if mode not in ("none", "cispo") else torch.zeros_like(out)  # no direction test
    M = ~(out & outward)
    if m.surrogate == "dppo":
        per = -(rho_w * log_r.exp().clamp(min=floor, max=cap)) * A * lp
        per = torch.where(M, per, 0.0)
    elif m.surrogate == "ppo-clip":
        per = torch.maximum(-A * r, -A * r.clamp(1 - eps[0], 1 + eps[1]))
        per = torch.where((A < 0) & (r.detach() > CAP), -A * CAP, per) * rho_w
    elif m.surrogate == "drpo":
        per = (-A * r + A.abs() * qk * (r - 1) ** 2 / (2 * delta)) * rho_w
    elif m.surrogate == "spo":
        per = (-A * r + A.abs() * (r - 1) ** 2 / (2 * delta)) * rho_w
    else:  # smooth
        w = 1 - torch.sign(A * ddot(m.divergence)) * value(region_div) / delta
        per = -A * w * r * rho_w
    loss = torch.where(valid, per, 0.0).sum() / valid.sum()
    (grad,) = torch.autograd.grad(loss, z)
    return loss.detach(), grad


def ours(mode, z, z_old, rollout, adv, delta, anchor_logits=None, **kw):
    corrections = None if mode in PRESETS else pdmask.Corrections(is_cap=CAP)  # a preset sets its own
    spec = pdmask.PolicyLoss(mode=mode, anchor="old", thresholds=pdmask.Thresholds(delta, delta, eps_high=0.28),
                             corrections=corrections, **kw)
    z = z.detach().clone().requires_grad_(True)
    r = rollout if "full" in MODES[mode].needs else rollout.replace(logits=None)
    anchor = pdmask.Anchor.from_logits(z_old if anchor_logits is None else anchor_logits, r)
    out = spec(z, r, adv, anchor=anchor)
    (grad,) = torch.autograd.grad(out.loss, z)
    return out, grad


@pytest.mark.parametrize("mode", CORE_MODES)
def test_every_mode_with_the_anchor_equals_the_restatement(mode):
    z, z_old, rollout, adv, logmu = case()
    # delta at the median of the region's divergence, so that the region binds on about half
    # the tokens (the ratio regions at 0.03)
    div = getattr(MODES[mode].region, "divergence", None)
    r = rollout if "full" in MODES[mode].needs else rollout.replace(logits=None)
    st = pdmask.token_stats(z, pdmask.Anchor.from_logits(z_old, r).rollout_for(r))
    delta = 0.03 if div is None else st[div][rollout.response_mask].quantile(0.5).item()  # 12 tokens: a midpoint
    out, grad = ours(mode, z, z_old, rollout, adv, delta)
    want, want_grad = restated(mode, z, z_old, rollout, adv, logmu, delta)
    torch.testing.assert_close(out.loss.detach(), want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-8, atol=1e-12)
    # the region binds somewhere and the behaviour weight is not 1: the case tests something
    assert 0 < out.metrics["out_of_region_frac"] < 1
    assert abs(out.metrics["behaviour_weight_mean"].item() - 1) > 1e-3


def test_every_preset_mode_has_its_restatement():
    assert {m for m in CORE_MODES if MODES[m].corrections is not None} == set(PRESETS)


@pytest.mark.parametrize("mode", CORE_MODES)
def test_anchor_equal_to_mu_gives_todays_loss_and_gradient(mode):
    """With ``pi_old = mu`` (the engine's own log-probs as the anchor) the anchored loss is
    exactly the mu-centred one, bit for bit, with the default corrections (a preset mode's own:
    its weight metrics then describe what they weigh, r today and pi_old/mu = 1 anchored)."""
    z, _, rollout, adv, logmu = case(1)
    r = rollout if "full" in MODES[mode].needs else rollout.replace(logits=None)
    th = pdmask.Thresholds(0.05, 0.05, eps_high=0.28)
    today = pdmask.PolicyLoss(mode=mode, thresholds=th)
    anchored = pdmask.PolicyLoss(mode=mode, thresholds=th, anchor="old")
    # mu's log-probs at the sampled ids and the engine's top-K ids: the anchor is mu itself
    anchor = pdmask.Anchor(r.sampled_logprob, r.topk_logprobs, None if r.logits is None else r.logits)
    z1, z2 = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    a, b = today(z1, r, adv), anchored(z2, r, adv, anchor=anchor)
    a.loss.backward()
    b.loss.backward()
    assert torch.equal(a.loss, b.loss)
    assert torch.equal(z1.grad, z2.grad)
    assert torch.equal(a.mask, b.mask)
    weight_metrics = ("is_weight_mean", "is_weight_min", "is_weight_max", "is_truncated_frac")
    for k, v in a.metrics.items():
        if not (mode in PRESETS and k in weight_metrics):
            assert torch.equal(v, b.metrics[k]), k
    assert b.metrics["behaviour_weight_mean"].item() == pytest.approx(1.0)
    assert b.metrics["anchor_divergence_mean"].item() == pytest.approx(0.0, abs=1e-12)


def test_anchor_distance_is_the_mu_to_pi_old_divergence_on_the_engine_support():
    z, z_old, rollout, adv, logmu = case(2)
    out, _ = ours("dppo-topk-kl", z, z_old, rollout, adv, 0.05)
    # D(mu, pi_old): top-K KL on topK(mu) ∪ {k}, one tail bucket, from the full distributions
    lq = torch.log_softmax(z_old, -1).reshape(-1, V)
    S = support_mask(rollout.topk_ids.reshape(-1, K), rollout.sampled_ids.reshape(-1), V)
    mu = logmu.exp().reshape(-1, V)
    muT, qT = torch.where(S, 0.0, mu).sum(-1), torch.where(S, 0.0, lq.exp()).sum(-1)
    d = torch.where(S, mu * (logmu.reshape(-1, V) - lq), 0.0).sum(-1) + muT * (muT.log() - qT.log())
    valid = rollout.response_mask.reshape(-1)
    assert out.metrics["anchor_divergence_mean"].item() == pytest.approx(d[valid].mean().item(), rel=1e-9)
    assert out.metrics["anchor_divergence_q90"].item() == pytest.approx(torch.quantile(d[valid], 0.9).item(),
                                                                         rel=1e-6)


def test_stats_path_with_behaviour_logprob_equals_the_logits_path():
    """verl's path: statistics measured against pi_old plus mu's log-probs give the same loss."""
    z, z_old, rollout, adv, _ = case(3)
    r = rollout.replace(logits=None)
    anchor = pdmask.Anchor.from_logits(z_old, r)
    spec = pdmask.PolicyLoss(mode="dppo-binary-tv", anchor="old")
    want = spec(z, r, adv, anchor=anchor)
    st = pdmask.token_stats(z, anchor.rollout_for(r))
    got = spec.from_stats(st, adv, r.response_mask, behaviour_logprob=r.sampled_logprob)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-12, atol=0)


@pytest.mark.parametrize("bad, field", [
    (dict(anchor=None), "anchor"),
    (dict(anchor_lp=torch.zeros(B, T + 1, dtype=F64)), "anchor.sampled_logprob"),
    (dict(anchor_lp=torch.full((B, T), math.nan, dtype=F64)), "anchor.sampled_logprob"),
    (dict(anchor_lp=torch.full((B, T), 0.5, dtype=F64)), "anchor.sampled_logprob"),
    (dict(anchor_tk=None), "anchor.topk_logprobs"),
    (dict(mu_lp=torch.full((B, T), math.inf, dtype=F64)), "rollout.sampled_logprob"),
])
def test_bad_anchors_get_one_line_naming_the_field(bad, field):
    z, z_old, rollout, adv, _ = case()
    r = rollout.replace(logits=None)
    a = pdmask.Anchor.from_logits(z_old, r)
    if "mu_lp" in bad:
        r = r.replace(sampled_logprob=bad["mu_lp"])
    anchor = None if "anchor" in bad else pdmask.Anchor(bad.get("anchor_lp", a.sampled_logprob),
                                                        bad.get("anchor_tk", a.topk_logprobs))
    with pytest.raises(pdmask.SpecError) as e:
        pdmask.PolicyLoss(mode="pdm-topk-kl", anchor="old")(z, r, adv, anchor=anchor)
    assert e.value.field == field


def test_an_anchor_given_to_a_rollout_centred_loss_is_refused():
    z, z_old, rollout, adv, _ = case()
    r = rollout.replace(logits=None)
    with pytest.raises(pdmask.SpecError, match="anchor='old'"):
        pdmask.PolicyLoss()(z, r, adv, anchor=pdmask.Anchor.from_logits(z_old, r))
    with pytest.raises(pdmask.SpecError) as e:
        pdmask.PolicyLoss(anchor="middle")
    assert "rollout, old" in str(e.value)


# ------------------------------------------------ the once-per-run region warning (every front end)
def test_start_quantiles_are_float64_quantiles_of_the_valid_tokens():
    g = torch.Generator().manual_seed(3)
    d = torch.rand(4, 7, generator=g, dtype=torch.float32) ** 3
    valid = torch.rand(4, 7, generator=g) > 0.3
    d_pad = torch.where(valid, d, torch.full_like(d, 1e6))  # padding never counts
    q = pdmask.anchor.start_quantiles(d_pad, valid)
    want = torch.quantile(d[valid].double(), torch.tensor([0.5, 0.9, 1 - pdmask.anchor.SUGGESTED_OUT_SHARE], dtype=F64))
    got = torch.stack([q["q50"], q["q90"], q["suggested_delta"]])
    assert got.dtype == F64
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-15)  # two float64 graphs (masked nanquantile vs quantile of the selection): rounding only, which may differ by CPU
    # the suggested delta leaves SUGGESTED_OUT_SHARE out (up to one token's interpolation)
    out = float((d[valid].double() > q["suggested_delta"]).double().mean())
    assert out <= pdmask.anchor.SUGGESTED_OUT_SHARE + 1 / int(valid.sum())
    none = pdmask.anchor.start_quantiles(d, torch.zeros_like(valid))
    assert all(float(v) == 0.0 for v in none.values())


def test_region_warning_fires_above_the_share_and_names_its_numbers():
    th = pdmask.Thresholds(0.002, 0.003)
    w = pdmask.anchor.WARN_OUT_BEFORE_UPDATE
    warn = pdmask.anchor.region_warning
    assert warn(w, 0.01, 0.02, 0.03, th, "anchor=old") is None  # at the share: quiet
    assert warn(w / 2, 0.01, 0.02, 0.03, th, "anchor=old") is None
    assert warn(None, 0.01, 0.02, 0.03, th, "anchor=old") is None
    msg = warn(0.375, 0.0123, 0.0456, 0.0789, th, 'anchor="old"')
    assert msg is not None and "\n" not in msg
    for part in ("37.5%", "0.002/0.003", "q50 0.0123", "q90 0.0456", "delta ~ 0.0789", "q95", 'anchor="old"',
                 f"{w:.0%}"):
        assert part in msg, (part, msg)
