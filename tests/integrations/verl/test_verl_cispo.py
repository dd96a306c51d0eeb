"""pdmask's ``cispo`` against verl 0.9.1's own ``compute_policy_loss_cispo`` (the installed package,
``verl/trainer/ppo/core_algos.py:2047-2105``): loss and gradient in float64 on the same batch, with
verl's ``clip_ratio_low`` / ``clip_ratio_high`` as ``eps_low`` / ``eps_high`` and its aggregation
modes (the restatement without verl: tests/core/test_cispo.py)."""

from __future__ import annotations

import pytest
import torch

from verl_helpers import actor_config, binary_batch, needs_verl

import pdmask

pytestmark = needs_verl
F64 = torch.float64


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("low,high", [(0.2, 0.2), (0.2, 0.28)])
def test_cispo_equals_verls_compute_policy_loss_cispo(agg, low, high):
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    logits, ids, rlp, adv, mask, _ = binary_batch(seed=11)
    cfg = actor_config(delta_low=low, delta_high=high, agg=agg, loss_mode="cispo")
    leaf = logits.clone().requires_grad_(True)
    log_prob = torch.log_softmax(leaf, -1).gather(-1, ids[..., None]).squeeze(-1)
    theirs, _ = get_policy_loss_fn("cispo")(old_log_prob=rlp, log_prob=log_prob, advantages=adv, response_mask=mask,
                                           loss_agg_mode=agg, config=cfg)
    (g_v,) = torch.autograd.grad(theirs, leaf)
    leaf = logits.clone().requires_grad_(True)
    out = pdmask.policy_loss(leaf, pdmask.Rollout(ids, rlp, response_mask=mask), adv, mode="cispo",
                             thresholds=pdmask.Thresholds(eps_low=low, eps_high=high),
                             aggregation=pdmask.Aggregation(agg))
    (g,) = torch.autograd.grad(out.loss, leaf)
    torch.testing.assert_close(out.loss.detach(), theirs.detach(), rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(g, g_v, rtol=1e-12, atol=1e-13)
    assert 0 < float(out.metrics["is_truncated_frac"]) < 1  # the clip binds on some tokens, not all
