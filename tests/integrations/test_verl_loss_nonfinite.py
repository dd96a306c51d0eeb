"""The verl plugin's policy losses stop at the first non-finite loss with one line naming the
loss, its call (verl passes a policy loss no step number) and the inputs holding the
non-finite values (issue 41): verl's own guard only skips an update whose gradient norm is
not finite and warns. The losses are called as verl calls them; verl itself is not needed
(``pdmask.integrations.verl.losses`` imports it only to register)."""

from __future__ import annotations

import types

import pytest
import torch

from pdmask.integrations.verl.losses import BINARY_MODES, loss_name, make_policy_loss


def _cfg():  # the fields a pdmask verl loss reads of verl's actor config
    return types.SimpleNamespace(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio=0.2, clip_ratio_c=3.0,
                                 global_batch_info={}, loss_agg_mode="token-mean",
                                 optim=types.SimpleNamespace(lr=1e308))


def _batch():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(3, 5, generator=g, dtype=torch.float64) - 0.1
    old = lp + 0.05 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(3, 1, generator=g, dtype=torch.float64).expand(3, 5).clone()
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[2, 3:] = False
    return lp, old.clamp(max=0.0), adv, mask


def _call(fn, lp, old, adv, mask):
    return fn(old_log_prob=old, log_prob=lp.clone().requires_grad_(True), advantages=adv, response_mask=mask,
              loss_agg_mode="token-mean", config=_cfg())


@pytest.mark.parametrize("mode", BINARY_MODES)
def test_a_diverged_policy_stops_at_the_call_it_shows(mode):
    fn = make_policy_loss(mode)
    lp, old, adv, mask = _batch()
    loss, _ = _call(fn, lp, old, adv, mask)  # call 1: finite
    assert torch.isfinite(loss)
    lp[1, 2] = float("nan")  # the policy's log-prob after an update that overflowed the weights
    lp[2, 4] = float("nan")  # on padding: not counted
    with pytest.raises(FloatingPointError) as e:
        _call(fn, lp, old, adv, mask)
    msg = str(e.value)
    assert msg.startswith(f"{loss_name(mode)}: the loss is nan (non-finite) on its call 2 ") and "\n" not in msg
    assert "non-finite inputs: log_prob (1 tokens)" in msg and "actor_rollout_ref.actor.optim.lr (now 1e+308)" in msg


def test_nonfinite_advantages_are_refused_by_the_core_naming_them():
    fn = make_policy_loss("dppo-binary-tv")
    lp, old, adv, mask = _batch()
    adv[0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"^advantages: contains NaN or inf on response tokens"):
        _call(fn, lp, old, adv, mask)


def test_a_nonfinite_anchor_is_named():
    fn = make_policy_loss("dppo-binary-kl")
    lp, old, adv, mask = _batch()
    old[0, 0] = float("nan")
    with pytest.raises(FloatingPointError) as e:
        _call(fn, lp, old, adv, mask)
    assert "old_log_prob" in str(e.value) and "\n" not in str(e.value)
