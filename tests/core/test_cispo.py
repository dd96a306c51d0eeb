"""``cispo`` (and TRL's CISPO as ``none`` with ``is_cap``) against restatements of the peers' code,
written in our own words (the installed peers are compared in their CI environments:
tests/integrations/verl/test_verl_cispo.py, tests/integrations/test_trl_cispo.py):

- **verl 0.9.1** ``compute_policy_loss_cispo`` (``verl/trainer/ppo/core_algos.py:2047-2105``):
  ``negative_approx_kl = log_prob - old_log_prob`` clamped to [-20, 20] (:2069-2071), ``ratio`` its
  exp, ``clipped_ratio = clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)`` detached
  (:2079-2080), ``pg_losses = -clipped_ratio_sg * advantages * log_prob`` (:2084), ``agg_loss``
  (:2093). pdmask: ``mode="cispo"``, ``eps_low`` / ``eps_high`` = ``clip_ratio_low`` / ``_high``. The
  ±20 clamp never binds inside the clip (``1 - eps_low > e^-20``): equal at any ratio.
- **TRL 1.16** ``GRPOTrainer._compute_loss`` with ``loss_type="cispo"`` (``trl/trainer/grpo_trainer.py``):
  ``coef_1 = exp(log_importance_weights)`` (:3095), ``clamped_ratios = clamp(coef_1, max=epsilon_high).detach()``,
  ``per_token_loss = -clamped_ratios * advantages * per_token_logps`` (:3109-3111), then
  ``(per_token_loss * mask).sum() / normalizer`` with TRL's ``dapo`` normalizer (:3168-3173). pdmask:
  ``mode="none"``, ``Corrections(is_cap=epsilon_high)``, ``Aggregation("token-mean", num_tokens=N)``.
"""

from __future__ import annotations

import pytest
import torch

import pdmask

F64 = torch.float64


def batch(seed=0, B=3, T=6, V=9):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, V, generator=g, dtype=F64) * 2
    ids = torch.randint(0, V, (B, T), generator=g)
    lp = torch.log_softmax(z, -1).gather(-1, ids[..., None])[..., 0]
    log_r = torch.randn(B, T, generator=g, dtype=F64) * 0.6
    log_r[0, 0], log_r[1, 1] = 25.0, -30.0  # beyond verl's clamp, on both sides
    rlp = (lp - log_r).clamp(max=0.0)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[2, 4:] = False
    adv = torch.tensor([1.2, -0.8, 0.5], dtype=F64)
    return z, pdmask.Rollout(ids, rlp, response_mask=mask), adv


def _grad(loss_fn, z):
    leaf = z.clone().requires_grad_(True)
    loss = loss_fn(leaf)
    (g,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), g


def _logp(leaf, r):
    return torch.log_softmax(leaf, -1).gather(-1, r.sampled_ids[..., None])[..., 0]


@pytest.mark.parametrize("low,high", [(0.2, 0.2), (0.2, 0.28), (0.5, 3.0)])
def test_cispo_is_verls_compute_policy_loss_cispo(low, high):
    z, r, adv = batch()
    mask = r.response_mask

    def verl(leaf):  # core_algos.py:2047-2105, token-mean (agg_loss)
        log_prob = _logp(leaf, r)
        ratio = torch.exp(torch.clamp(log_prob - r.sampled_logprob, min=-20.0, max=20.0))
        pg = -torch.clamp(ratio, 1 - low, 1 + high).detach() * adv[:, None] * log_prob
        return (pg * mask).sum() / mask.sum()

    def ours(leaf):
        return pdmask.policy_loss(leaf, r, adv, mode="cispo", thresholds=pdmask.Thresholds(eps_low=low, eps_high=high)).loss

    (a, ga), (b, gb) = _grad(ours, z), _grad(verl, z)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-14)
    out = pdmask.policy_loss(z, r, adv, mode="cispo", thresholds=pdmask.Thresholds(eps_low=low, eps_high=high))
    assert 0 < float(out.metrics["is_truncated_frac"]) < 1 and float(out.metrics["masked_frac"]) == 0.0


@pytest.mark.parametrize("eps_high", [1.3, 5.0])
def test_trls_cispo_is_none_with_is_cap(eps_high):
    z, r, adv = batch(1)
    mask = r.response_mask
    n = 7.0  # TRL's normalizer: num_items_in_batch / processes (here any number: it divides both)

    def trl(leaf):  # grpo_trainer.py:3109-3111, 3168-3173
        logp = _logp(leaf, r)
        coef_1 = torch.exp(logp - r.sampled_logprob)
        per = -torch.clamp(coef_1, max=eps_high).detach() * adv[:, None] * logp
        return (per * mask).sum() / n

    def ours(leaf):
        return pdmask.policy_loss(leaf, r, adv, mode="none", corrections=pdmask.Corrections(is_cap=eps_high),
                                  aggregation=pdmask.Aggregation("token-mean", num_tokens=n)).loss

    (a, ga), (b, gb) = _grad(ours, z), _grad(trl, z)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-14)
    # and the two CISPOs differ where TRL has no floor: cispo's clip lifts the low ratios
    low = pdmask.policy_loss(z, r, adv, mode="cispo", thresholds=pdmask.Thresholds(eps_low=0.2, eps_high=eps_high - 1),
                             aggregation=pdmask.Aggregation("token-mean", num_tokens=n)).loss
    assert not torch.isclose(low, a)
