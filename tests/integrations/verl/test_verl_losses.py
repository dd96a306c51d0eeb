"""The registered verl losses called exactly as verl calls them, against pdmask's own loss."""

from __future__ import annotations

import math

import pytest
import torch

from verl_helpers import actor_config, binary_batch, needs_verl

import pdmask
from tests import flat  # noqa: E402
from tests.numerics import sum_atol

pytestmark = needs_verl

AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def _verl_loss(name):
    import verl  # noqa: F401  (loads the plugin through verl's entry-point loader)
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    return get_policy_loss_fn(name)


def _call(name, logits, ids, rlp, adv, mask, cfg, **kw):
    """verl's call (workers/utils/losses.py:ppo_loss): keyword arguments, (B, T) tensors."""
    leaf = logits.clone().requires_grad_(True)
    log_prob = torch.log_softmax(leaf, -1).gather(-1, ids[..., None]).squeeze(-1)
    loss, metrics = _verl_loss(name)(old_log_prob=rlp, log_prob=log_prob, advantages=adv, response_mask=mask,
                                    loss_agg_mode=cfg.loss_agg_mode, config=cfg, **kw)
    (g,) = torch.autograd.grad(loss, leaf)
    return loss, metrics, g


def _pdmask(mode, logits, ids, rlp, adv, mask, *, agg="token-mean", **kw):
    leaf = logits.clone().requires_grad_(True)
    out = flat.policy_loss(leaf, ids, rlp, None, None, adv, mask, mode=mode, delta_low=0.05, delta_high=0.07,
                             is_cap=5.0, loss_agg=agg, **kw)
    (g,) = torch.autograd.grad(out.loss, leaf)
    return out, g


@pytest.mark.parametrize("mode", ["dppo-binary-tv", "dppo-binary-kl"])
@pytest.mark.parametrize("agg", AGGS)
def test_binary_loss_equals_pdmask(mode, agg):
    logits, ids, rlp, adv, mask, _ = binary_batch(seed=1)
    cfg = actor_config(agg=agg)
    loss, metrics, g = _call(pdmask.integrations.verl.loss_name(mode), logits, ids, rlp, adv, mask, cfg)
    ref, g_ref = _pdmask(mode, logits, ids, rlp, adv, mask, agg=agg)
    torch.testing.assert_close(loss, ref.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-12)
    assert float(ref.metrics["masked_frac"]) > 0, "the batch must mask something or the test proves little"
    for k, v in ref.metrics.items():
        if k in ("entropy_mean", "loss"):
            continue
        torch.testing.assert_close(metrics[f"pdmask/{k}"].to(v.dtype), v, rtol=1e-12, atol=1e-12, msg=k)
    assert "pdmask/entropy_mean" not in metrics  # not available to a verl policy loss
    # binary divergences: the predictive direction IS the ratio direction (METHOD.md section 4)
    assert float(metrics["pdmask/disagreement_frac"]) == 0.0
    assert metrics["actor/pg_clipfrac"] is metrics["pdmask/masked_frac"]


def test_binary_tv_matches_verl_builtin_mask():
    """pdmask's dppo-binary-tv keeps exactly the tokens verl's own dppo_tv keeps (same
    thresholds, same IS cap), so the losses agree: an independent check of the semantics."""
    logits, ids, rlp, adv, mask, _ = binary_batch(seed=2)
    cfg = actor_config(delta_low=0.05, delta_high=0.07, is_cap=5.0)
    ours, _, g = _call("pdmask_dppo_binary_tv", logits, ids, rlp, adv, mask, cfg)
    theirs, _, g_v = _call("dppo_tv", logits, ids, rlp, adv, mask, cfg)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g, g_v, rtol=1e-12, atol=1e-12)


def test_global_batch_info_normalisation():
    """token-mean under data parallelism: verl's agg_loss divides by the global token count
    and multiplies by dp_size; pdmask.aggregate with num_tokens gives the same sum / N_global."""
    logits, ids, rlp, adv, mask, _ = binary_batch(seed=3)
    n_global, dp = 40, 2
    cfg = actor_config(global_batch_info={"dp_size": dp, "batch_num_tokens": n_global, "global_batch_size": 12,
                                          "loss_scale_factor": None})
    loss, _, _ = _call("pdmask_dppo_binary_kl", logits, ids, rlp, adv, mask, cfg)
    ref, _ = _pdmask("dppo-binary-kl", logits, ids, rlp, adv, mask, num_tokens=n_global)
    torch.testing.assert_close(loss, ref.loss * dp, rtol=1e-12, atol=1e-12)
    cfg = actor_config(agg="seq-mean-token-mean", global_batch_info={"dp_size": dp, "global_batch_size": 12})
    loss, _, _ = _call("pdmask_dppo_binary_kl", logits, ids, rlp, adv, mask, cfg)
    ref, _ = _pdmask("dppo-binary-kl", logits, ids, rlp, adv, mask, agg="seq-mean-token-mean", num_seqs=12)
    torch.testing.assert_close(loss, ref.loss * dp, rtol=1e-12, atol=1e-12)


def test_rollout_is_weights_multiply_per_token():
    logits, ids, rlp, adv, mask, _ = binary_batch(seed=4)
    cfg = actor_config(agg="seq-mean-token-sum")
    w = torch.rand(adv.shape, generator=torch.Generator().manual_seed(0), dtype=adv.dtype) + 0.5
    loss, _, _ = _call("pdmask_dppo_binary_tv", logits, ids, rlp, adv, mask, cfg, rollout_is_weights=w)
    ref, _ = _pdmask("dppo-binary-tv", logits, ids, rlp, adv, mask, agg="seq-mean-token-sum")
    expect = pdmask.aggregate(ref.token_loss * w, mask, pdmask.Aggregation("seq-mean-token-sum"))
    torch.testing.assert_close(loss, expect, rtol=1e-12, atol=1e-12)
    assert not math.isclose(float(loss.detach()), float(ref.loss.detach()))


def test_padding_garbage_does_not_leak():
    """verl pads log-probs with whatever the model produced; NaN there must not reach the loss."""
    logits, ids, rlp, adv, mask, _ = binary_batch(seed=5)
    cfg = actor_config()
    clean, _, g_clean = _call("pdmask_dppo_binary_kl", logits, ids, rlp, adv, mask, cfg)
    rlp2 = rlp.clone()
    rlp2[~mask] = float("nan")
    adv2 = adv.clone()
    adv2[~mask] = float("inf")
    dirty, _, g_dirty = _call("pdmask_dppo_binary_kl", logits, ids, rlp2, adv2, mask, cfg)
    torch.testing.assert_close(dirty, clean)
    torch.testing.assert_close(g_dirty, g_clean)


def test_errors_name_the_argument():
    logits, ids, rlp, adv, mask, _ = binary_batch()
    lp = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    fn = _verl_loss("pdmask_dppo_binary_tv")
    with pytest.raises(ValueError, match="config"):
        fn(rlp, lp, adv, mask, "token-mean", None, None)
    with pytest.raises(ValueError, match="old_log_prob"):
        fn(rlp[:, :-1], lp, adv, mask, "token-mean", actor_config(), None)
    topk = _verl_loss("pdmask_pdm_topk_kl")
    with pytest.raises(ValueError, match="model_type=pdmask_language_model"):
        topk(rlp, lp, adv, mask, "token-mean", actor_config(), None)


# ---------------------------------------------------------------- the aggregation is verl's agg_loss
#: every agg_loss mode, with verl's global_batch_info as ppo_loss fills it (every key, every mode)
AGG_CASES = [(agg, info) for agg in ["token-mean", "token-sum", *AGGS[1:]] for info in (
    {},  # local counts (dp_size 1, no global counts)
    {"dp_size": 1, "batch_num_tokens": 23, "global_batch_size": 9, "loss_scale_factor": None},
    {"dp_size": 4, "batch_num_tokens": 61, "global_batch_size": 13, "loss_scale_factor": 12},
)]


@pytest.mark.parametrize("agg,info", AGG_CASES, ids=[f"{a}-{i % 3}" for i, (a, _) in enumerate(AGG_CASES)])
def test_aggregation_equals_verl_agg_loss(agg, info):
    """pdmask.aggregate with the plugin's Aggregation equals verl's real agg_loss, mode by
    mode, local and data-parallel, up to the rounding of float64 sums taken in another order.

    seq-mean-token-mean: verl divides by ``n_b + 1e-8``, pdmask by ``n_b`` exactly. With the
    bool response mask verl's ppo_loss passes, verl's ``n_b`` is an int64 count and
    ``n_b + 1e-8`` a float32 that rounds back to ``n_b``: the same number. With a float64
    mask the two differ, by at most 1e-8 relative."""
    from verl.trainer.ppo.core_algos import agg_loss

    from pdmask.integrations.verl.losses import aggregation

    g = torch.Generator().manual_seed(len(info) + len(agg))
    x = torch.randn(5, 7, generator=g, dtype=torch.float64) * 3
    mask = torch.rand(5, 7, generator=g) > 0.4
    mask[0], mask[1, :2] = False, True  # an empty sequence: verl's seq_mask leaves it out, as pdmask does
    # finite padding junk: both exclude it (verl's seq-mean modes multiply by the mask, so a
    # NaN there would reach verl's sum; pdmask's where() excludes even that)
    x = torch.where(mask, x, torch.full_like(x, 1e6))
    ours = pdmask.aggregate(x, mask, aggregation(agg, info))
    theirs = agg_loss(loss_mat=x, loss_mask=mask, loss_agg_mode=agg, **info)
    # one positive linear map of x in two orders: 2 n eps of the map of |x| (tests/numerics.py)
    atol = sum_atol(x.numel(), pdmask.aggregate(x.abs(), mask, aggregation(agg, info)))
    torch.testing.assert_close(ours, theirs.double(), rtol=0, atol=atol)
    if agg == "seq-mean-token-mean":
        theirs64 = agg_loss(loss_mat=x, loss_mask=mask.double(), loss_agg_mode=agg, **info)
        # |ours - theirs64| = |D/G sum_b S_b/n_b * 1e-8/(n_b + 1e-8)| <= 1e-8 * the same mean of |x|
        bound = 1e-8 * pdmask.aggregate(x.abs(), mask, aggregation(agg, info))
        assert 0 < abs(float(ours - theirs64)) <= float(bound) * (1 + 1e-12)
        n = mask.sum(-1).double()
        S = torch.where(mask, x, 0.0).sum(-1)
        exact = info.get("dp_size", 1) * (S[n > 0] / n[n > 0]).sum() / info.get("global_batch_size", (n > 0).sum())
        torch.testing.assert_close(ours, exact.double(), rtol=0, atol=atol)  # pdmask's is n_b exactly


@pytest.mark.parametrize("agg", ["token-mean", "token-sum", *AGGS[1:]])
def test_registered_loss_aggregates_like_agg_loss_under_data_parallelism(agg):
    """The whole registered loss with dp_size 4 and global counts: verl's agg_loss of the
    plugin's own per-token loss (PolicyLossOutput.token_loss) is the plugin's loss."""
    from verl.trainer.ppo.core_algos import agg_loss

    logits, ids, rlp, adv, mask, _ = binary_batch(seed=6)
    info = {"dp_size": 4, "batch_num_tokens": 50, "global_batch_size": 11, "loss_scale_factor": 16}
    cfg = actor_config(agg=agg, global_batch_info=info)
    loss, _, _ = _call("pdmask_dppo_binary_kl", logits, ids, rlp, adv, mask, cfg)
    ref, _ = _pdmask("dppo-binary-kl", logits, ids, rlp, adv, mask)
    theirs = agg_loss(loss_mat=ref.token_loss, loss_mask=mask, loss_agg_mode=agg, **info)
    # one positive linear map of the token losses in two orders: 2 n eps of the map of |token_loss|
    from pdmask.integrations.verl.losses import aggregation

    abs_terms = pdmask.aggregate(ref.token_loss.abs(), mask, aggregation(agg, info))
    torch.testing.assert_close(loss, theirs, rtol=0, atol=sum_atol(mask.numel(), abs_terms))


@pytest.mark.parametrize("agg,info,key", [
    ("token-mean", {"dp_size": 2, "batch_num_tokens": None, "global_batch_size": 8}, "batch_num_tokens"),
    ("seq-mean-token-sum", {"dp_size": 2, "batch_num_tokens": 30, "global_batch_size": None}, "global_batch_size"),
    ("token-mean", {"dp_size": 1, "batch_num_tokens": 0}, "batch_num_tokens"),
    ("seq-mean-token-sum-norm", {"loss_scale_factor": -1.0}, "loss_scale_factor"),
    ("token-sum", {"dp_size": 0}, "dp_size"),
])
def test_global_batch_info_errors_name_verls_key(agg, info, key):
    """verl requires the global counts when dp_size > 1 (its agg_loss raises too); the error
    is one line naming verl's key, not the core's field."""
    logits, ids, rlp, adv, mask, _ = binary_batch()
    with pytest.raises(ValueError) as e:
        _call("pdmask_dppo_binary_tv", logits, ids, rlp, adv, mask, actor_config(agg=agg, global_batch_info=info))
    msg = str(e.value)
    assert msg.startswith(f"config.global_batch_info[{key!r}]:") and "\n" not in msg, msg


def test_unknown_global_batch_info_key_and_mode_are_refused():
    logits, ids, rlp, adv, mask, _ = binary_batch()
    with pytest.raises(ValueError, match=r"^config.global_batch_info: unknown key\(s\) 'cp_size'"):
        _call("pdmask_dppo_binary_tv", logits, ids, rlp, adv, mask, actor_config(global_batch_info={"cp_size": 2}))
    from pdmask.integrations.verl.losses import aggregation

    with pytest.raises(ValueError, match="^loss_agg_mode: unknown value 'seq-sum'"):
        aggregation("seq-sum", {})
