"""pdmask against verl 0.9.1's own code (the installed package) on the same batches: the built-in
``dppo_kl`` and ``vanilla`` losses, the ``bypass_mode`` loss, the rollout-correction weights at
the edges of verl's ±20 clamp, and the smooth modes through their registered losses. Every
documented difference (docs/corrections.md, docs/verl.md) is asserted as a difference."""

from __future__ import annotations

import math

import pytest
import torch

from verl_helpers import actor_config, binary_batch, needs_verl

import pdmask
from pdmask import corrections as C
from tests import flat  # noqa: E402

pytestmark = needs_verl
F64 = torch.float64


def _verl(name):
    import verl  # noqa: F401  (loads the plugin through verl's entry-point loader)
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    return get_policy_loss_fn(name)


def _call(name, logits, ids, old, adv, mask, cfg, **kw):
    leaf = logits.clone().requires_grad_(True)
    log_prob = torch.log_softmax(leaf, -1).gather(-1, ids[..., None]).squeeze(-1)
    loss, metrics = _verl(name)(old_log_prob=old, log_prob=log_prob, advantages=adv, response_mask=mask,
                                loss_agg_mode=cfg.loss_agg_mode, config=cfg, **kw)
    (g,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), g, metrics


def _pdmask(mode, logits, ids, rlp, adv, mask, **kw):
    leaf = logits.clone().requires_grad_(True)
    out = flat.policy_loss(leaf, ids, rlp, None, None, adv, mask, mode=mode, **kw)
    (g,) = torch.autograd.grad(out.loss, leaf)
    return out, g


def _ratio_batch(seed, ratios, adv=None):
    """A (B, T) batch whose tokens have the given ratios pi/mu (rollout log-probs set from them)."""
    logits, ids, _, adv0, mask, _ = binary_batch(seed=seed)
    logp = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    r = torch.tensor(ratios, dtype=F64).repeat(logp.numel() // len(ratios) + 1)[: logp.numel()].reshape(logp.shape)
    return logits, ids, logp - r.log(), adv0 if adv is None else adv, mask, r


# ------------------------------------------------------------------ verl's built-in losses
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_binary_kl_matches_verl_builtin_dppo_kl(agg):
    logits, ids, rlp, adv, mask, _ = binary_batch(seed=6)
    cfg = actor_config(delta_low=0.05, delta_high=0.07, is_cap=5.0, agg=agg)
    ours, g, _ = _call("pdmask_dppo_binary_kl", logits, ids, rlp, adv, mask, cfg)
    theirs, g_v, _ = _call("dppo_kl", logits, ids, rlp, adv, mask, cfg)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g, g_v, rtol=1e-12, atol=1e-12)
    ref, _ = _pdmask("dppo-binary-kl", logits, ids, rlp, adv, mask, delta_low=0.05, delta_high=0.07, is_cap=5.0,
                     loss_agg=agg)
    assert 0 < float(ref.metrics["masked_frac"]) < 1


@pytest.mark.parametrize("agg", ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("clip_c", [3.0, 10.0])
def test_grpo_equals_verl_vanilla_on_the_rollout_anchor(agg, clip_c):
    """verl's ``vanilla`` (PPO clip + dual clip) with old_log_prob = the rollout's mu is pdmask's
    grpo with eps_low/high = clip_ratio_low/high and dual_clip = clip_ratio_c."""
    logits, ids, rlp, adv, mask, r = _ratio_batch(7, [0.5, 0.9, 1.1, 1.5, 4.0, 12.0, 0.7, 2.5])
    cfg = actor_config(delta_low=0.2, delta_high=0.28, is_cap=clip_c, agg=agg)
    theirs, g_v, _ = _call("vanilla", logits, ids, rlp, adv, mask, cfg)
    out, g = _pdmask("grpo", logits, ids, rlp, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip=clip_c, loss_agg=agg)
    torch.testing.assert_close(out.loss.detach(), theirs, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(g, g_v, rtol=1e-12, atol=1e-13)
    assert bool(((adv < 0) & (r > clip_c) & mask).any()), "the batch must hit the dual clip"


def test_grpo_vs_vanilla_beyond_verls_20_clamp_is_a_documented_difference():
    """verl clamps log r to [-20, 20] before its PPO ratio; pdmask's grpo caps it above at 50 only.
    With the dual clip off (clip_ratio_c = inf), an A < 0 token at log r = 25 has verl's loss
    -A e^20 with zero gradient (the clamp) and pdmask's -A e^25 with gradient -A r. Elsewhere equal."""
    logits, ids, rlp, adv, mask, r = _ratio_batch(8, [0.9, 1.1])
    adv = adv.clone()
    adv[0, 0] = -1.0
    rlp = rlp.clone()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    rlp[0, 0] = logp[0, 0] - 25.0
    cfg = actor_config(delta_low=0.2, delta_high=0.2, is_cap=math.inf, agg="token-sum")
    theirs, g_v, _ = _call("vanilla", logits, ids, rlp, adv, mask, cfg)
    out, g = _pdmask("grpo", logits, ids, rlp, adv, mask, eps_low=0.2, eps_high=0.2, dual_clip=math.inf,
                     loss_agg="token-sum")
    tl = out.token_loss.detach()
    assert float(tl[0, 0]) == pytest.approx(math.exp(25.0), rel=1e-9)
    others = torch.where(mask, tl, torch.zeros_like(tl)).sum() - tl[0, 0]
    assert float(theirs - others) == pytest.approx(math.exp(20.0), rel=1e-9)
    assert float(g[0, 0].abs().max()) > 1e9 and float(g_v[0, 0].abs().max()) == 0.0
    torch.testing.assert_close(g[1:], g_v[1:], rtol=1e-12, atol=1e-13)


# ------------------------------------------------------------------ verl's bypass_mode loss
def _bypass_cfg(agg, **rc):
    """A real verl actor config whose policy loss is ``bypass_mode`` with these rollout-correction settings."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig

    return FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=0.2,
                           clip_ratio_high=0.28, clip_ratio_c=10.0, loss_agg_mode=agg,
                           policy_loss=PolicyLossConfig(loss_mode="bypass_mode",
                                                        rollout_correction=RolloutCorrectionConfig(**rc)))


def test_bypass_ppo_clip_ignores_icepop():
    """verl's bypass ``ppo_clip`` passes rollout_is_weights=None to the vanilla loss: an IcePop
    threshold there changes nothing. So grpo + token IcePop has no verl bypass equivalent: verl's
    loss equals pdmask's grpo *without* IcePop and differs from it with IcePop. The issue's case:
    one token, r = 0.33, A = 1, IcePop [0.5, 3]: verl's d loss / d log pi_k = -0.33, pdmask's 0."""
    logits, ids, rlp, adv, mask, r = _ratio_batch(9, [0.33, 0.9, 1.1, 1.5, 4.0, 0.7])
    cfg = _bypass_cfg("token-mean", bypass_mode=True, loss_type="ppo_clip", rollout_is="token",
                      rollout_is_threshold="0.5_3.0")
    theirs, g_v, _ = _call("bypass_mode", logits, ids, rlp, adv, mask, cfg)
    plain, g_plain = _pdmask("grpo", logits, ids, rlp, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip=10.0)
    icepop, g_ice = _pdmask("grpo", logits, ids, rlp, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip=10.0,
                            is_mask=True, is_floor=0.5, is_cap=3.0)
    torch.testing.assert_close(plain.loss.detach(), theirs, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(g_plain, g_v, rtol=1e-12, atol=1e-13)
    assert not torch.allclose(g_ice, g_v)
    # the token (r = 0.33, A = 1) beside an on-policy one (r = 1; verl's IS metrics need two), token-sum
    cfg = _bypass_cfg("token-sum", bypass_mode=True, loss_type="ppo_clip", rollout_is="token",
                      rollout_is_threshold="0.5_3.0")
    z = torch.zeros(1, 2, 4, dtype=F64)
    k = torch.zeros(1, 2, dtype=torch.long)
    rlp2 = torch.log_softmax(z, -1)[..., 0] - torch.tensor([[math.log(0.33), 0.0]], dtype=F64)
    adv2, mask2 = torch.ones(1, 2, dtype=F64), torch.ones(1, 2, dtype=torch.bool)
    leaf = z.clone().requires_grad_(True)
    logp = torch.log_softmax(leaf, -1)[..., 0]
    loss, _ = _verl("bypass_mode")(old_log_prob=rlp2, log_prob=logp, advantages=adv2, response_mask=mask2,
                                   loss_agg_mode="token-sum", config=cfg)
    (d_v,) = torch.autograd.grad(loss, logp)
    assert float(d_v[0, 0]) == pytest.approx(-0.33, rel=1e-9)  # d(-A r)/d log pi_k = -A r: IcePop ignored
    out = flat.policy_loss(z, k, rlp2, None, None, adv2, mask2, mode="grpo", eps_low=0.2, eps_high=0.28,
                           dual_clip=10.0, is_mask=True, is_floor=0.5, is_cap=3.0, loss_agg="token-sum")
    assert float(out.token_loss[0, 0]) == 0.0 and not bool(out.mask[0, 0])  # pdmask: masked, gradient 0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_bypass_reinforce_with_token_tis_is_mode_none(agg):
    """verl's bypass ``reinforce`` with token TIS at C: -sg(min(r, C)) A log pi_k = pdmask's ``none``
    with is_cap = C (the DPPO surrogate without a mask)."""
    logits, ids, rlp, adv, mask, r = _ratio_batch(10, [0.5, 0.9, 1.1, 1.5, 4.0, 0.7])
    cfg = _bypass_cfg(agg, bypass_mode=True, loss_type="reinforce", rollout_is="token", rollout_is_threshold=2.0)
    theirs, g_v, _ = _call("bypass_mode", logits, ids, rlp, adv, mask, cfg)
    out, g = _pdmask("none", logits, ids, rlp, adv, mask, is_cap=2.0, loss_agg=agg)
    torch.testing.assert_close(out.loss.detach(), theirs, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(g, g_v, rtol=1e-12, atol=1e-13)
    assert bool(((r > 2.0) & mask).any()), "the cap must bite"


# ------------------------------------------------------------------ verl's ±20 clamp (docs/corrections.md)
def _weights(lr, mask, level, thr, **kw):
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    w_v, _ = compute_rollout_correction_weights(lr, mask.to(F64), level, thr, False)
    w, keep, _ = C.importance_weights(lr, mask, C.Corrections(is_level=level, **kw))
    return w_v, w, keep


def test_overflow_caps_are_documented_differences():
    """verl exponentiates log r (or a sequence's sum) clamped to [-20, 20]; pdmask's IS weights and
    IS masks cap above at 50 only. They differ (a) for a TIS cap above e^20, inf included (TRL's
    clip_max=None), (b) for a MIS bound outside [e^-20, e^20], (c) for a weight below e^-20."""
    mask = torch.ones(1, 2, dtype=torch.bool)
    lr = torch.tensor([[25.0, 0.1]], dtype=F64)
    for cap in (1e12, math.inf):  # (a)
        w_v, w, _ = _weights(lr, mask, "token", cap if math.isfinite(cap) else float("inf"), is_cap=cap)
        assert float(w_v[0, 0]) == pytest.approx(math.exp(20), rel=1e-12)  # 4.85e8
        assert float(w[0, 0]) == pytest.approx(math.exp(25), rel=1e-12)  # 7.2e10
        assert float(w_v[0, 1]) == pytest.approx(float(w[0, 1]), rel=1e-12)
    seq = torch.tensor([[-14.85, -14.85]], dtype=F64)  # sum -29.7
    w_v, w, keep = _weights(seq, mask, "sequence", "1e-12_1e12", is_mask=True, is_floor=1e-12, is_cap=1e12)  # (b)
    assert bool((w_v > 0).all()) and not bool(keep.any())  # verl keeps (e^-20 = 2e-9), pdmask masks (1.3e-13)
    low = torch.tensor([[-25.0, 0.0]], dtype=F64)  # (c)
    w_v, w, _ = _weights(low, mask, "token", 5.0, is_cap=5.0)
    assert float(w_v[0, 0]) == pytest.approx(math.exp(-20), rel=1e-12)
    assert float(w[0, 0]) == pytest.approx(math.exp(-25), rel=1e-12)


# ------------------------------------------------------------------ the smooth modes through the plugin
@pytest.mark.parametrize("mode,kw", [("drpo", {}), ("spo", {})])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_registered_smooth_losses_equal_the_core(mode, kw, agg):
    """``pdmask_drpo`` / ``pdmask_spo`` called as verl calls them: the core's loss and gradient
    (scale delta = clip_ratio_low/high; clip_ratio_c unused: their ratio is the weight)."""
    logits, ids, rlp, adv, mask, _ = binary_batch(seed=11)
    cfg = actor_config(delta_low=0.1, delta_high=0.3, is_cap=3.0, agg=agg)
    loss, g, metrics = _call(pdmask.integrations.verl.loss_name(mode), logits, ids, rlp, adv, mask, cfg)
    ref, g_ref = _pdmask(mode, logits, ids, rlp, adv, mask, delta_low=0.1, delta_high=0.3, loss_agg=agg)
    torch.testing.assert_close(loss, ref.loss.detach(), rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-13)
    assert float(metrics["pdmask/corrective_frac"]) == pytest.approx(float(ref.metrics["corrective_frac"]))
    assert float(ref.metrics["masked_frac"]) == 0.0
