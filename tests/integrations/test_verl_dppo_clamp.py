"""verl's ``dppo_tv`` / ``dppo_kl`` clamp their IS weight's log ratio to ±20; the plugin's
``pdmask_dppo_binary_tv`` / ``_kl`` cap it at ``pdmask.stats.MAX_LOG_RATIO`` (50) and then at
``clip_ratio_c`` (issue 41; docs/verl.md states it). Asserted against a restatement of verl
0.9.1's code, runnable without verl (the verl environment's ``test_verl_peers.py`` compares
the real functions where the two agree):

- ``verl/trainer/ppo/core_algos.py:1418-1421`` (``compute_policy_loss_dppo_tv``) and
  ``:1499-1502`` (``compute_policy_loss_dppo_kl``): ``negative_approx_kl = log_prob -
  old_log_prob`` clamped to [-20, 20], ``ratio = exp(...)``, ``ppo_kl`` the masked mean of the
  clamped ``-negative_approx_kl`` (reported as ``actor/ppo_kl``);
- ``:1427-1429`` / ``:1508-1510``: ``truncated_ratio = clamp(ratio, max=clip_ratio_c).detach()``;
- ``:1432-1439``: the TV mask ``prob - old_prob <= clip_ratio_high`` (A > 0), ``>= -clip_ratio_low``
  (A <= 0); ``pg_losses = -A * truncated_ratio * log_prob * valid_mask``.

So the two agree wherever |log r| <= 20. Beyond: above +20 only with ``clip_ratio_c`` > e^20
(verl's weight stops at e^20 = 4.9e8, pdmask's goes on to the cap), below -20 verl's weight
stays at e^-20 = 2.1e-9 where pdmask's is r (a difference under 2.1e-9)."""

from __future__ import annotations

import math
import types
from pathlib import Path

import pytest
import torch

from pdmask.integrations.verl.losses import make_policy_loss

F64 = torch.float64
DOC = Path(__file__).resolve().parents[2] / "docs" / "verl.md"


def verl_dppo_tv_token_grad(log_prob, old_log_prob, adv, *, low, high, c):
    """d pg_losses / d log_prob of verl's restated ``dppo_tv`` (module docstring), per token."""
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0))
    w = torch.clamp(ratio, max=c)
    diff = log_prob.exp() - old_log_prob.exp()
    valid = torch.where(adv > 0, diff <= high, diff >= -low).to(F64)
    return -adv * w * valid


def _cfg(c):
    return types.SimpleNamespace(clip_ratio_low=0.15, clip_ratio_high=0.15, clip_ratio=0.15, clip_ratio_c=c,
                                 global_batch_info={}, loss_agg_mode="token-sum")


def _ours(mode, log_prob, old, adv, c):
    """The plugin's loss called as verl calls it, on one sequence (1, T); per-token gradients."""
    lp = log_prob[None].clone().requires_grad_(True)
    loss, metrics = make_policy_loss(mode)(old_log_prob=old[None], log_prob=lp, advantages=adv[None],
                                           response_mask=torch.ones_like(lp, dtype=torch.bool),
                                           loss_agg_mode="token-sum", config=_cfg(c))
    (g,) = torch.autograd.grad(loss, lp)
    return g[0], metrics


# log r = +25, -30 (beyond the clamp), then three inside it; A > 0 keeps the first two in region
LOG_PROB = torch.tensor([-5.0, -35.0, -1.0, -0.7, -2.0], dtype=F64)
OLD = torch.tensor([-30.0, -5.0, -1.05, -0.72, -1.9], dtype=F64)
ADV = torch.tensor([1.0, 1.0, 0.5, -1.3, 2.0], dtype=F64)


@pytest.mark.parametrize("c", [5.0, 1e12])
def test_dppo_tv_equals_verl_inside_the_clamp_and_differs_as_documented_beyond(c):
    ours, metrics = _ours("dppo-binary-tv", LOG_PROB, OLD, ADV, c)
    verl = verl_dppo_tv_token_grad(LOG_PROB, OLD, ADV, low=0.15, high=0.15, c=c)
    torch.testing.assert_close(ours[2:], verl[2:], rtol=1e-12, atol=1e-14)
    # log r = +25: the same at a cap below e^20, e^25 vs e^20 above it
    if c < math.exp(20):
        assert float(verl[0]) == -c and float(ours[0]) == pytest.approx(-c, rel=1e-12)
    else:
        assert float(verl[0]) == pytest.approx(-math.exp(20), rel=1e-12)
        assert float(ours[0]) == pytest.approx(-math.exp(25), rel=1e-12)
    # log r = -30: verl's weight stays at e^-20, ours is r: different, both below 2.1e-9
    assert float(verl[1]) == pytest.approx(-math.exp(-20), rel=1e-12)
    assert float(ours[1]) == pytest.approx(-math.exp(-30), rel=1e-12)
    assert abs(float(ours[1] - verl[1])) < 2.1e-9
    # verl's actor/ppo_kl averages the clamped log ratio, the plugin's the raw one
    lr = LOG_PROB - OLD
    assert float(metrics["actor/ppo_kl"]) == pytest.approx(float(-lr.mean()), rel=1e-12)
    assert float(metrics["actor/ppo_kl"]) != pytest.approx(float(-lr.clamp(-20, 20).mean()), rel=1e-6)


def test_dppo_kl_weight_is_clamped_by_verl_not_by_pdmask():
    """dppo_kl reads the same clamped ratio (core_algos.py:1499-1510); with every token kept
    (A > 0 and pi <= mu, or inside the KL region) only the weight differs."""
    lp = torch.tensor([-3.0, -30.0], dtype=F64)
    old = torch.tensor([-28.0, -4.0], dtype=F64)  # log r = +25 (binary KL of a tiny mu: in region), -26
    adv = torch.tensor([1.0, 1.0], dtype=F64)
    ours, _ = _ours("dppo-binary-kl", lp, old, adv, 1e12)
    assert float(ours[0]) == pytest.approx(-math.exp(25), rel=1e-12)  # verl: -e^20
    assert float(ours[1]) == pytest.approx(-math.exp(-26), rel=1e-12)  # verl: -e^-20


def test_the_difference_is_stated_where_equality_is_claimed():
    text = " ".join(DOC.read_text().split())
    assert "clamp their log ratio to ±20" in text and "`verl/trainer/ppo/core_algos.py:1420`" in text
